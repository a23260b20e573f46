"""Cost model: predicted time of a task on one worker, from its op kind, bytes and flops.

Planning figures measured on an H200 (``shared/DESIGN.md``): ~4.0 TB/s HBM read shared by
132 workers, ~790 TFLOP/s bf16 tensor-core rate, ~0.76 us per dependency hop between CTAs.
A task of a measured kind costs ``fixed + bytes / rate`` (:data:`MEASURED`, fitted by
``benchmarks/fit_cost.py`` from the per-instruction trace of a Llama-3.2-1B decode step on
an H200, context 1024, bf16); other kinds cost ``max(bytes / per-worker bandwidth, flops /
per-worker rate) + overhead``.
"""
from __future__ import annotations

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
    # the GLM-5 prelude's kinds (the bf16 and FP8 traces of benchmarks/glm5_prelude.py --profile,
    # 2026-11-29, main 629a4b3's runtime; FP8 bmm measured 73.6 us, bf16's is kept)
    "bmm": (33.68, 0.0),
    "index_score": (47.56, 0.0),
    "fp8_linear": (1.56, 3.3e3),
    "fp8_quant": (4.55, 1.6e3),
    # linear_fused's figures (a ring-fed GEMM tile): the plans measured on 2026-12-01 were scheduled
    # with them; that day's FP8 trace fits 3.11 us + 6.9 GB/s (benchmarks/fit_cost.py), not yet
    # tried as the planning figure
    "fp8_linear_quant": (8.54, 17.3e3),
    "layernorm": (8.51, 0.0),
    "concat": (3.13, 8.9e3),
    "paged_cache_write": (1.25, 1.1e3),
}


def task_time_us(nbytes: int, flops: int, kind: str | None = None) -> float:
    """Predicted microseconds of one task of op ``kind`` on one worker."""
    roof = max(nbytes / (HBM_BYTES_PER_US / SMS), flops / (FLOPS_PER_US / SMS))
    if kind in MEASURED:
        fixed, rate = MEASURED[kind]
        return max(roof, fixed + (nbytes / rate if rate else 0.0))
    return roof + TASK_OVERHEAD_US
