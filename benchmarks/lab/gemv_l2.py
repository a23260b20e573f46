"""Is the streamed GEMV bound by HBM or by the worker's pipeline? (benchmarks/lab: an experiment)

Compiles plans of ``count`` independent M = 1 bf16 GEMVs [N, K] for the persistent executor and
prints, per plan: the CUDA-graph replay time (back to back) as TB/s of weight bytes and GB/s per
worker, then two stamped runs - after L2 was flushed (256 MB written) and after the weights were
read by torch with the normal L2 policy (so the ring's bulk copies hit L2 when they fit: 50 MB on
an H200) - as the median tile's KB, µs, start -> x staged (mark 1) and GB/s. If the warm tiles
stream no faster than the flushed ones, the worker's ring pipeline, not HBM, sets the rate.

Measured on an H200 (2026-12-02, fourteenth session, call 3): per tile, flushed / warm, 23.7 / 21.1
GB/s (512 x 8192, 8.4 MB, 128 KB tiles), 19.9 / 20.4 (1024 x 8192, 16.8 MB), 24.2 / 24.9 (2048 x
8192, 33.6 MB): L2-resident weights stream no faster; 8 GEMVs of 2048 x 8192 (268 MB: from HBM in
both runs, 2 MB per worker) 29.4 / 31.2. So ~30 GB/s per worker at most - about HBM's 4 TB/s / 132:
a GEMV phase with every worker streaming is at the HBM limit, but a worker cannot catch up from
L2 what it did not stream while it waited (prefetching into L2 during the attention window did
not help either: README, fourteenth session). On an H100 (fifty-third session, 3 stages, warm L2) a tile streamed
34-40 GB/s after x was staged with its dot products and 46-62 without them (TILEC_LAB_NODOTS of
benchmarks/lab/patches/s49-consumer-labs.patch): the batch-1 consumer, not the copies, sets a worker's rate from L2 -
at or under an H200 worker's 35 GB/s share of HBM.

    PYTHONPATH=. python benchmarks/lab/gemv_l2.py [--define MACRO[=VALUE] ...] [--stages 2,3,4,5]
    TILEC_CACHE_DIR=$PWD/.tilec-cache PYTHONPATH=. python benchmarks/lab/gemv_l2.py --prebuild [--define ...]

``--stages`` repeats the stamped runs with each weight-ring depth (a latency-bound ring streams
faster with more stages in flight; a rate-bound one does not). ``--define`` prepends ``#define``
lines to the generated program (an executor variant, as ``variants_ab.py`` does; the macro must
be one runtime/tilec tests); ``--prebuild`` only builds the libraries (the plain one and the
variant's) without a GPU: every case's plan generates the same program. ``GB/s/worker`` divides
by the workers that have instructions.
"""
import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from decode import Gemvs, time_cuda  # noqa: E402
from tilec import codegen  # noqa: E402
from tilec.api import compile_module  # noqa: E402
from tilec.cuda import CudaExecutor  # noqa: E402
from tilec.errors import TilecError  # noqa: E402
from tilec.ops import NOOP  # noqa: E402
from tilec.plan import F  # noqa: E402
from tilec.timing import cuda_graph, need_gpu  # noqa: E402
from variants_ab import define_lines  # noqa: E402

CASES = ((512, 8192, 1), (1024, 8192, 1), (2048, 8192, 1), (2048, 8192, 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--define", action="append", default=[])
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--stages", default="", help="ring depths for the stamped runs, e.g. 2,3,4,5 (default: the plan's)")
    args = ap.parse_args()
    lines, unknown = define_lines(args.define)
    if unknown:
        ap.error(f"--define: macros runtime/tilec never tests: {unknown}")
    if args.prebuild:
        mod = Gemvs(512, 8192, 1).to(torch.bfloat16)
        x = torch.randn(1, 8192, dtype=torch.bfloat16)
        prog = compile_module(mod, (x,), options=dict(executor="reference", check=False))
        srcs = codegen.render(prog.plan)
        for pre in dict.fromkeys(("", lines)):
            print(codegen.build({**srcs, "program.cu": pre + srcs["program.cu"]}, "sm_90a"))
        return
    need_gpu("gemv_l2.py")
    print(f"{'weight [N, K] x count':<24} {'MB':>7} {'us':>8} {'TB/s':>6} {'GB/s/worker':>12} "
          f"{'tile KB':>8} {'tile us':>8} {'m1 us':>6} {'tile GB/s':>9} {'stream GB/s':>11}")
    for n, k, count in CASES:
        mod = Gemvs(n, k, count).to("cuda", torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            prog = compile_module(mod, (x,), options=dict(check=False))
            if lines:  # the variant's library in the compiled program's executor (checked below)
                ex = prog.executor
                srcs = dict(ex.sources)
                srcs["program.cu"] = lines + srcs["program.cu"]
                prog.executor = CudaExecutor(prog.plan, ex.opts, ex.device, lib_path=codegen.build(srcs, ex.opts.arch))
            got, want = prog(x), mod(x)
        err = max(float((g.float() - w.float()).norm() / w.float().norm()) for g, w in zip(got, want))
        tensors, p = prog.bind_args((x,))
        table = prog.plan.bind_base(tensors)
        graph = cuda_graph(lambda: prog.executor.run(tensors, table, position=p))
        ms = time_cuda(graph.replay, 200)
        prog.executor.check()
        nbytes = count * n * k * 2
        busy = int((prog.plan.queues[..., F["opcode"][0]] != NOOP).any(-1).sum())  # workers with instructions
        # per-tile medians from stamped runs, after L2 was flushed and after torch re-read the weights
        ex = prog.executor
        sx = CudaExecutor(prog.plan, dataclasses.replace(ex.opts, profile=True), ex.device, lib_path=ex.lib_path)
        junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for depth in [int(d) for d in args.stages.split(",") if d] or [sx.ring_stages]:
            try:
                sx.use_ring_stages(depth)
            except TilecError as e:  # e.g. 6 stages beside this plan's scratch: more shared memory than a CTA has
                print(f"{f'{n} x {k} x {count}':<24} ring stages {depth}: {e}", flush=True)
                continue
            for warm in (False, True):
                for _ in range(3):
                    graph.replay()
                    junk.add_(1)  # evicts the weights from L2 (256 MB written)
                    if warm:  # reads every weight with the normal L2 policy: the copies then hit L2
                        for w in mod.ws:
                            w.weight.sum()
                    sx.run(tensors, table, position=p)
                torch.cuda.synchronize()
                label = f"{'warm L2' if warm else 'flushed'}, {depth} stages"
                report(n, k, count, err, ms, nbytes, busy, sx.stamps.cpu(), label)
        del mod, prog, sx, junk


def report(n, k, count, err, ms, nbytes, workers, s, label) -> None:
    """One table row: whole-plan rates from the timing, per-tile medians from stamps ``s``."""
    live = (s[..., 1] > 0) & (s[..., 0] > 0)
    dur = ((s[..., 1] - s[..., 0]).float() / 1e3)[live].tolist()
    m1 = ((s[..., 2] - s[..., 0]).float() / 1e3)[live & (s[..., 2] > 0)].tolist()
    tile = nbytes / max(1, len(dur))
    td = statistics.median(dur)
    tm = statistics.median(m1) if m1 else float("nan")
    print(f"{f'{n} x {k} x {count}':<24} {nbytes / 1e6:>7.1f} {ms * 1e3:>8.1f} {nbytes / ms / 1e9:>6.2f} "
          f"{nbytes / ms / 1e6 / workers:>12.1f} {tile / 1024:>8.0f} {td:>8.2f} {tm:>6.2f} {tile / td / 1e3:>9.1f}"
          f" {tile / (td - tm) / 1e3:>11.1f}   {label} (rel. L2 vs torch {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
