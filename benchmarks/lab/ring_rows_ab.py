"""2..4-row GEMV tiles on the tensor-core ring consumer, A/B in one process (benchmarks/lab: an experiment).

At batch 4 every GEMV tile has 4 x rows, which go to the CUDA-core ring consumer's "diagonal" tensor-core
instance (``gemv_bf16_ring<4>``: each warp one weight row, 7/8 of each mma discarded). It streamed 1.97 TB/s
(2048 x 8192, M = 4) on an H200 where one row streams 3.21 and the 5..16-row consumer
(``gemv_bf16_ring_mma``: each warp a K slice of 8 weight rows, one useful n = 8 mma) 2.34 at M = 8. This
script compiles the Llama-3.2-1B step twice over the same model and cache: as main plans it
(``tilec.ops.GEMV_RING_ROWS`` = 4), and with ``GEMV_RING_ROWS`` = 1, so that 2..16 rows go to
``gemv_bf16_ring_mma`` (the generated ``TILEC_GEMV_RING_ROWS`` and the plan's shared-memory reservations
follow; a library of its own). It prints the logits difference and the median CUDA-graph replay time per
round, the variants alternating.

    PYTHONPATH=. python benchmarks/lab/ring_rows_ab.py --batch 4 [--rounds 5] [--iters 30]
    PYTHONPATH=. python benchmarks/lab/ring_rows_ab.py --batch 4 --prebuild   # on the CPU: build both libraries
"""
import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tilec.ops as opreg  # noqa: E402
import tilec.ops.linear_fused as linear_fused  # noqa: E402
from _llama_step import alternating_rounds, llama_model, step_runner  # noqa: E402
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.timing import cuda_graph  # noqa: E402


@contextlib.contextmanager
def ring_rows(n: int):
    """``tilec.ops.GEMV_RING_ROWS`` (and ``linear_fused``'s copy of it) set to ``n`` while compiling."""
    saved = opreg.GEMV_RING_ROWS, linear_fused.GEMV_RING_ROWS
    opreg.GEMV_RING_ROWS = linear_fused.GEMV_RING_ROWS = n
    try:
        yield
    finally:
        opreg.GEMV_RING_ROWS, linear_fused.GEMV_RING_ROWS = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--prebuild", action="store_true", help="on the CPU: plan both variants and build their libraries")
    args = ap.parse_args()
    variants = {"main (4)": 4, "mma (1)": 1}
    if args.prebuild:
        from tilec.codegen.build import build
        from tilec.codegen.sources import render
        from tilec.zoo import make_model, prefill

        model = make_model("llama-3.2-1b", torch.bfloat16, "cpu")
        cache, _ = prefill(model, args.batch, 8, args.context + 64, "cpu")
        for name, n in variants.items():
            with ring_rows(n):
                step = compile_decode_step(model, cache, args.batch, options=dict(check=False, executor="reference"))
                print(f"{name}: {build(render(step.program.compiled.plan))}", flush=True)
        return
    model, cache, tok = llama_model("ring_rows_ab.py", args.context, batch=args.batch)
    graphs, ref, steps = {}, None, {}
    for name, n in variants.items():
        with ring_rows(n):
            step = compile_decode_step(model, cache, args.batch, options=dict(check=False))
        run = step_runner(step, tok, args.context)
        out = run().float()
        step.program.executor.check()
        ref = out if ref is None else ref
        print(f"{name:10s} logits max|diff| vs main: {float((out - ref).abs().max()):.3e}", flush=True)
        steps[name], graphs[name] = step, cuda_graph(run)
    res, mhz = alternating_rounds(graphs, args.rounds, args.iters)
    print(f"median SM clock {mhz if mhz is not None else '-'} MHz over the rounds\n")
    print(f"{'variant':10s} {'median ms':>10s}  rounds")
    for name, ts in res.items():
        print(f"{name:10s} {statistics.median(ts):10.3f}  {[round(t, 3) for t in ts]}")


if __name__ == "__main__":
    main()
