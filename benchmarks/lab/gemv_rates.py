"""The GEMV microbenchmark's three plans under one runtime variant (benchmarks/lab: an experiment).

Times the plans of ``decode.py --gemv`` (8 independent M = 1 bf16 GEMVs per plan: 2048 x 8192,
4096 x 14336, 128256 x 2048) as its table does - ``decode.gemv_plan``, a CUDA graph of the launch,
each plan replayed for ``GEMV_WARM_MS`` (50 ms) first - and prints per shape three medians of
``--iters`` replays (µs), the best as TB/s of weight bytes, and the first output's relative L2
against torch. The variant is whatever ``TILEC_NVCC_FLAGS`` builds (e.g. ``-DTILEC_HOLD_AHEAD=8``):
run it once per variant, each in its own process, to compare a runtime switch's effect on the
stream (forty-ninth and fiftieth sessions, benchmarks/RESULTS.md).

    PYTHONPATH=. python benchmarks/lab/gemv_rates.py
    TILEC_NVCC_FLAGS=-DTILEC_HOLD_AHEAD=8 PYTHONPATH=. python benchmarks/lab/gemv_rates.py
    TILEC_CACHE_DIR=$PWD/.tilec-cache PYTHONPATH=. python benchmarks/lab/gemv_rates.py --prebuild   # no GPU
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from decode import GEMV_WARM_MS, Gemvs, gemv_plan, time_cuda  # noqa: E402

SHAPES = ((2048, 8192), (4096, 14336), (128256, 2048))
COUNT = 8  # GEMVs per plan


def prebuild() -> None:
    """Builds the three plans' libraries into the build cache (no GPU: the plans compile for the
    reference executor, their CUDA sources are rendered and built as the GPU run will build them)."""
    from tilec.api import compile_module
    from tilec.codegen.build import build
    from tilec.codegen.sources import render

    for n, k in SHAPES:
        mod = Gemvs(n, k, COUNT).to(torch.bfloat16)
        with torch.no_grad():
            prog = compile_module(mod, (torch.randn(1, k, dtype=torch.bfloat16),),
                                  options=dict(check=False, executor="reference"))
        print(n, k, build(render(prog.plan)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prebuild", action="store_true", help="only build the libraries (no GPU needed)")
    ap.add_argument("--iters", type=int, default=50, help="replays per median")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return
    from tilec.timing import cuda_graph

    tag = os.environ.get("TILEC_NVCC_FLAGS", "") or "main's runtime"
    for n, k in SHAPES:
        mod, x, prog, run = gemv_plan(n, k, COUNT)
        graph = cuda_graph(run)
        once = time_cuda(graph.replay, 3, warmup=1)
        us = [time_cuda(graph.replay, args.iters, warmup=max(5, int(GEMV_WARM_MS / once))) * 1e3 for _ in range(3)]
        with torch.no_grad():
            got, want = prog(x)[0].float(), mod.ws[0](x).float()
        err = float((got - want).norm() / want.norm())
        mb = COUNT * n * k * 2 / 1e6
        print(f"{tag:<40} {n:>6} x {k:<6} " + " ".join(f"{t:7.1f}" for t in us)
              + f" us  {mb / min(us):.2f} TB/s (best)  rel.L2 {err:.1e}", flush=True)
        del mod, prog, run, graph


if __name__ == "__main__":
    main()
