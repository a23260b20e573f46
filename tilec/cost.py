"""Cost model: predicted time of a task on one worker, from its op kind, bytes and flops.

Planning figures measured on an H200 (``shared/DESIGN.md``): ~4.0 TB/s HBM read shared by
132 workers, ~790 TFLOP/s bf16 tensor-core rate, ~0.76 us per dependency hop between CTAs.
A task of a measured kind costs ``fixed + bytes / rate`` (:data:`MEASURED`, fitted by
``benchmarks/fit_cost.py`` from the per-instruction trace of a Llama-3.2-1B decode step on
an H200, context 1024, bf16); other kinds cost ``max(bytes / per-worker bandwidth, flops /
per-worker rate) + overhead``.

These figures are planning weights: the list scheduler uses their ratios, and they overstate the
current executor's times. The forty-first session's H200 trace of the Llama-3.2-1B step measured
GEMV tiles at about 2.7 µs + bytes / 33.5e3 (a 104 KB q / k / v tile 4.9 µs, where ``MEASURED``
says 14.5) and the step at 1093 µs, where the schedule's makespan (``predicted_step_us``) is 2018.
A refit of that kind planned a step as fast within noise (1.186 against 1.181 ms on an H200,
nineteenth session, ``benchmarks/lab/options_ab.py``); it waits for an A/B on the current executor.
"""
from __future__ import annotations

import contextlib

HBM_BYTES_PER_US = 4.0e6  # 4.0 TB/s in bytes per microsecond
FLOPS_PER_US = 790e6  # 790 TFLOP/s in flop per microsecond
SMS = 132
TASK_OVERHEAD_US = 0.3  # descriptor fetch, barriers, signal
HOP_US = 0.76  # one event hop between CTAs (release add -> acquire poll)

# op kind -> (fixed µs per instruction, bytes per µs of one worker while it runs); refitted on
# an H200 on 2026-11-29 for the loader-warp runtime (benchmarks/fit_cost.py on the trace of
# the final Llama-3.2-1B profile of that session; 0 = no size dependence in the data)
MEASURED: dict[str, tuple[float, float]] = {
    "linear_fused": (8.54, 17.3e3),
    "attention_partial": (13.08, 21.5e3),
    "attention_combine": (4.73, 0.0),
    "rope": (3.70, 0.0),
    "cache_write": (3.41, 0.0),
    "embedding": (9.84, 0.0),
    "empty": (0.71, 0.0),
    # the GLM-5 prelude's kinds, refitted on 2026-12-01 (benchmarks/fit_cost.py on the FP8 trace of
    # benchmarks/glm5_prelude.py --profile, H200; fp8_linear_quant rounded towards its faster
    # staging of that day). The FP8 step with these figures: 270.2 us against 314.6 scheduled with
    # the earlier ones (bmm 33.68, index_score 47.56, fp8_linear_quant = linear_fused's, no binary /
    # unary entries; glm5_variants_ab.py --plan, one process): the list scheduler had put the
    # indexer's short critical chain behind bmm tiles it predicted at 33.7 us (they take 11)
    # (binary, unary and concat are any model's kinds; the default Llama / Qwen3 decode plans have none)
    "bmm": (11.33, 0.0),
    "index_score": (51.78, 0.0),
    "fp8_linear": (1.56, 3.3e3),
    "fp8_quant": (5.71, 0.0),
    "fp8_linear_quant": (1.0, 9.0e3),
    "layernorm": (8.51, 0.0),
    "concat": (2.60, 7.6e3),
    "paged_cache_write": (10.0, 50e3),
    "binary": (5.22, 2.8e3),
    "unary": (6.95, 6.5e3),
}


@contextlib.contextmanager
def measured_overrides(costs: dict):
    """Plans compiled inside use other :data:`MEASURED` figures: ``costs`` maps an op kind to
    ``(fixed µs, bytes per µs)``, or to None to plan that kind by the roofline. Restored on exit
    (for A/Bs of cost figures, ``benchmarks/lab``).

    Raises:
        ValueError: a figure is not a pair of numbers.
    """
    bad = [k for k, v in costs.items() if v is not None and (len(v) != 2 or not all(isinstance(x, (int, float)) for x in v))]
    if bad:
        raise ValueError(f"cost figures must be [fixed_us, bytes_per_us] or null: {bad}")
    saved = dict(MEASURED)
    MEASURED.update({k: tuple(v) for k, v in costs.items() if v is not None})
    for k in [k for k, v in costs.items() if v is None]:
        MEASURED.pop(k, None)
    try:
        yield
    finally:
        MEASURED.clear()
        MEASURED.update(saved)


def task_time_us(nbytes: int, flops: int, kind: str | None = None) -> float:
    """Predicted microseconds of one task of op ``kind`` on one worker."""
    roof = max(nbytes / (HBM_BYTES_PER_US / SMS), flops / (FLOPS_PER_US / SMS))
    if kind in MEASURED:
        fixed, rate = MEASURED[kind]
        return max(roof, fixed + (nbytes / rate if rate else 0.0))
    return roof + TASK_OVERHEAD_US
