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

With ``--variants`` (variants_ab.py's NAME=DEFINE[,DEFINE...] specs) the variants run in one process instead:
per shape, each variant's library is swapped into the same compiled plan and the variants' CUDA graphs are
replayed in turn, ``--rounds`` times (their libraries are the variants_ab.py ones: its ``--prebuild`` builds them).
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
    ap.add_argument("--variants", nargs="+", default=[], metavar="NAME=DEFINES",
                    help="runtime variants to A/B in this process (variants_ab.py's form)")
    ap.add_argument("--rounds", type=int, default=5, help="with --variants: rounds of the variants in turn")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return
    if args.variants:
        ab(args.variants, args.iters, args.rounds, ap)
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


def ab(specs, iters: int, rounds: int, ap) -> None:
    """The three plans under each of ``specs``' variants in this process: per shape the median of
    ``iters`` replays each round, variants in turn, then each variant's median over the rounds."""
    import statistics

    from tilec.cuda import CudaExecutor
    from tilec.timing import cuda_graph
    from variants_ab import build_variant, parse_variants

    variants = parse_variants(specs, ap)
    for n, k in SHAPES:
        mod, x, prog, run = gemv_plan(n, k, COUNT)
        base = prog.executor
        graphs, errs, exs = {}, {}, {}  # (each graph launches its executor's buffers: keep them alive)
        for name, lines in variants:
            lib = build_variant(base.sources, lines, base.opts.arch)
            prog.executor = exs[name] = CudaExecutor(base.plan, base.opts, base.device, lib_path=lib)
            with torch.no_grad():
                got, want = prog(x)[0].float(), mod.ws[0](x).float()
            errs[name] = float((got - want).norm() / want.norm())
            graphs[name] = cuda_graph(run)
            once = time_cuda(graphs[name].replay, 3, warmup=1)
            time_cuda(graphs[name].replay, 3, warmup=max(5, int(GEMV_WARM_MS / once)))
        res = {name: [] for name, _ in variants}
        for _ in range(rounds):
            for name, _ in variants:
                res[name].append(time_cuda(graphs[name].replay, iters, warmup=5) * 1e3)
        mb = COUNT * n * k * 2 / 1e6
        for name, _ in variants:
            med = statistics.median(res[name])
            print(f"{name:<12} {n:>6} x {k:<6} {med:8.1f} us  {mb / med:.2f} TB/s  rounds {[round(t, 1) for t in res[name]]}"
                  f"  rel.L2 {errs[name]:.1e}", flush=True)
        del mod, prog, run, graphs, exs


if __name__ == "__main__":
    main()
