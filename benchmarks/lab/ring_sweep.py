"""Executor experiment sweep: the same compiled plans run with runtime variants built from
nvcc defines (``TILEC_NVCC_FLAGS``) and with fewer weight-ring stages, in one process.

Prints, per (variant, ring stages): the Llama decode step under a CUDA graph (ms), the GEMV
microbenchmark (TB/s of weight bytes, 8 independent M = 1 GEMVs per plan) and the median
phases of ring-fed GEMV instructions.

    python benchmarks/lab/ring_sweep.py --variants base FOO FOO+BAR@2 --stages 2 1

A variant is ``base`` or '+'-joined macro names, each built as ``-DTILEC_EXP_<NAME>``, with
``@S[,S...]`` for its own ring stage counts (else ``--stages``; at most the plan's). The runtime
has no ``TILEC_EXP_*`` code of its own: an experiment adds ``#ifdef TILEC_EXP_<NAME>`` blocks,
measures them here, and keeps or deletes them (the ones measured on 2026-11-29 - INLINE,
NO_FENCE, WARP_ARRIVE, XREG, PRELOAD, MARKS - are in README.md's numbers, and gone).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tilec import codegen  # noqa: E402
from tilec.cuda import CudaExecutor  # noqa: E402
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.timing import cuda_graph, median_ms, need_gpu  # noqa: E402
from tilec.trace import measured_trace  # noqa: E402
from tilec.zoo import make_model, prefill  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode import Gemvs  # noqa: E402
from profile_step import phase_table  # noqa: E402


_PLANS = []
_STAGES = {}  # id(plan) -> the ring stages it was compiled with


def _build(job):
    flags, i = job
    os.environ["TILEC_NVCC_FLAGS"] = flags
    codegen.build(codegen.render(_PLANS[i]), "sm_90a")


def swap_executor(prog, flags: str, stages: int):
    """A new executor built with ``flags``, its shared memory sized for ``stages`` ring stages
    (fewer stages leave the SM a larger L1 cache)."""
    os.environ["TILEC_NVCC_FLAGS"] = flags
    prog.plan.ring_stages = min(stages, _STAGES[id(prog.plan)])
    prog.executor = CudaExecutor(prog.plan, prog.opts, prog.device)
    return prog.executor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", nargs="+", default=["base"],
                    help="base, or '+'-joined macro names; NAME@S runs it with S ring stages only")
    ap.add_argument("--stages", nargs="+", type=int, default=[5])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--gemv", nargs="*", default=["2048x8192", "128256x2048"])
    args = ap.parse_args()
    need_gpu("ring_sweep.py")
    runs = []  # (flags, ring stages)
    for v in args.variants:
        name, _, st = v.partition("@")
        flags = "" if name == "base" else " ".join(f"-DTILEC_EXP_{m}" for m in name.split("+"))
        runs += [(flags, int(x)) for x in st.split(",")] if st else [(flags, x) for x in args.stages]
    args.variants = list(dict.fromkeys(f for f, _ in runs))
    ctx = args.context
    model = make_model(args.model, torch.bfloat16, "cuda")
    cache, tok = prefill(model, 1, ctx, ctx + 8, "cuda")
    step = compile_decode_step(model, cache, 1, options=dict(check=False, profile=True))
    ref = None
    from tilec.api import compile_module

    gemvs = []
    for shape in args.gemv:
        n, k = (int(v) for v in shape.split("x"))
        mod = Gemvs(n, k).to("cuda", torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            prog = compile_module(mod, (x,), options=dict(check=False, profile=True))
            want = mod(x)
        gemvs.append((shape, n * k * 2 * 8, prog, x, want))

    # build every (variant, plan) library at once: nvcc is single-threaded per translation unit
    plans = [step.program.plan] + [g[2].plan for g in gemvs]
    jobs = [(f, i) for f in args.variants for i in range(len(plans))]
    _PLANS[:] = plans
    _STAGES.update((id(p), p.ring_stages) for p in plans)
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.map(_build, jobs)
    print(f"built {len(jobs)} libraries in {time.time() - t0:.0f} s", flush=True)

    def tilec_step():
        step.seek(ctx)
        return step(tok, ctx)

    print(f"{'variant':<40} {'stages':>6} {'step ms':>8} " + " ".join(f"{s:>12}" for s, *_ in gemvs), flush=True)
    for flags, stages in runs:
        if True:
            ex = swap_executor(step.program, flags, stages)
            stamps = ex.stamps
            gex = [swap_executor(g[2], flags, stages) for g in gemvs]
            ex.stamps = None
            out = tilec_step().float()
            ex.check()
            if ref is None:
                ref = out
            diff = float((out - ref).norm() / ref.norm())
            graph = cuda_graph(tilec_step)
            ms = median_ms(graph.replay, args.iters)
            tbs, phases = [], []
            for (shape, nbytes, prog, x, want), gx in zip(gemvs, gex):
                gstamps, gx.stamps = gx.stamps, None
                tensors, p = prog.bind_args((x,))
                table = prog.plan.bind_base(tensors)
                got = prog(x)
                err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want))
                gg = cuda_graph(lambda pr=prog, t=tensors, tb=table, p=p: pr.executor.run(t, tb, position=p))
                gms = median_ms(gg.replay, args.iters)
                tbs.append(f"{nbytes / gms / 1e9:7.2f} ({err:.0e})")
                gx.stamps = gstamps
                prog(x)
                gx.check()
                gtrace = measured_trace(prog.plan, gstamps.cpu(), prog.compiled.stages["linearized"])
                phases.append(f"    gemv {shape}: {phase_table(gtrace)}")
            ex.stamps = stamps
            for _ in range(2):
                tilec_step()
            ex.check()
            trace = measured_trace(step.program.plan, stamps.cpu(), step.program.compiled.stages["linearized"])
            print(f"{flags or 'baseline':<40} {stages:>6} {ms:>8.3f} " + " ".join(tbs)
                  + f"  logits vs first {diff:.1e}", flush=True)
            print(f"    {phase_table(trace)}", flush=True)
            print("\n".join(phases), flush=True)


if __name__ == "__main__":
    main()
