"""Compile-time variants of the executor, A/B in one process (benchmarks/lab: an experiment).

Compiles the Llama-3.2-1B decode step (or ``--model``'s; batch 1 or ``--batch``, context 1024, bf16, random weights) once, then
builds its generated program again with each variant's ``#define`` lines prepended (nvcc runs in
parallel), swaps each library in turn into the same compiled step and prints, per variant and
weight-ring depth, the median CUDA-graph replay time (alternating variants, several rounds), the
logits' max difference from the first variant, and the median time from a ring-fed GEMV tile's
start to its mark 1 (stamps[..., 2]) for tiles that stage x and tiles that reuse it.

    PYTHONPATH=. python benchmarks/lab/variants_ab.py 'base=' 'other=TILEC_MY_SWITCH,TILEC_N=2' --stages 3,4
    TILEC_CACHE_DIR=$PWD/.tilec-cache PYTHONPATH=. python benchmarks/lab/variants_ab.py --prebuild 'base=' ...

``--options JSON`` compiles the step with those tilec options (e.g. a lab patch's opt-in pass).
``--prebuild`` builds the variants' libraries into the build cache without a GPU (a 2-layer step
generates the same program as 16 layers), to carry to the GPU machine with the cache.

A variant is NAME=DEFINE[,DEFINE...] (DEFINE as NAME or NAME=VALUE): an experiment puts its
alternative code under an #ifdef in runtime/tilec and names the macro here. Used on 2026-12-01
(H200) for the GEMV setup before the event wait (executor.cuh; 1.689 vs 1.792 ms a step), the
tensor-core consumer for 1..8 rows (1.751 vs 1.734 ms: dropped) and relaxed event polls (1.779 vs
1.751 ms: dropped).
"""
import argparse
import dataclasses
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _llama_step import json_options, llama_step  # noqa: E402
from decode import time_cuda  # noqa: E402
from tilec import codegen  # noqa: E402
from tilec.cuda import CudaExecutor  # noqa: E402
from tilec.errors import TilecError  # noqa: E402
from tilec.ops import opdef  # noqa: E402
from tilec.plan import F  # noqa: E402
from tilec.timing import SmClock, cuda_graph  # noqa: E402
from tilec.trace import measured_trace, write_trace  # noqa: E402


def define_lines(macros: list[str]) -> tuple[str, list[str]]:
    """The ``#define`` lines of ``macros`` (each NAME or NAME=VALUE), and the names among them that
    runtime/tilec never tests (a typo would silently build the unchanged executor)."""
    runtime = "".join(f.read_text() for f in (Path(__file__).resolve().parents[2] / "runtime" / "tilec").glob("*.cuh"))
    names = [d.split("=")[0] for d in macros]
    unknown = [n for n in names if not n.startswith("TILEC_") or not re.search(rf"\b{re.escape(n)}\b", runtime)]
    return "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in macros), unknown


def parse_variants(specs, ap) -> list[tuple[str, str]]:
    """``(name, #define lines)`` of each NAME=DEFINE[,DEFINE...] spec (DEFINE as NAME or
    NAME=VALUE); ``ap.error`` for a repeated or empty name or a macro runtime/tilec never tests (a
    ``TILEC_`` name that appears as a whole word in runtime/tilec/*.cuh)."""
    variants = []
    for v in specs:
        name, _, defs = v.partition("=")
        lines, unknown = define_lines([d for d in defs.split(",") if d])
        if not name or name in (n for n, _ in variants):
            ap.error(f"variant {v!r}: needs a name, and one no other variant has")
        if unknown:
            ap.error(f"variant {v!r}: {unknown} not a TILEC_ macro that runtime/tilec tests (a typo would build the "
                     f"unchanged runtime)")
        variants.append((name, lines))
    return variants


def build_variant(sources: dict, lines: str, arch: str) -> str:
    """The library of generated ``sources`` with a variant's ``#define`` lines prepended to program.cu (cached)."""
    return codegen.build({**sources, "program.cu": lines + sources["program.cu"]}, arch)


def prebuild(variants, batch: int = 1, name: str = "llama-3.2-1b", options: dict | None = None) -> None:
    """Builds each variant's library of the step's program on the CPU (into the build cache)."""
    import torch

    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model(name, torch.bfloat16, "cpu", layers=2)
    cache, _ = prefill(model, batch, 8, 1024 + 64, "cpu")
    step = compile_decode_step(model, cache, batch, options=dict(options or {}, check=False, executor="reference"))
    srcs = codegen.render(step.program.compiled.plan)
    arch = step.program.opts.arch
    with ThreadPoolExecutor(2) as pool:
        libs = pool.map(lambda lines: build_variant(srcs, lines, arch), (lines for _, lines in variants))
        for (name, _), lib in zip(variants, libs):
            print(f"{name}: {lib}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+",
                    help="NAME=DEFINE[,DEFINE...] (DEFINE as MACRO or MACRO=VALUE); 'base=' builds the runtime as it is. "
                         "Lab macros come from a patch in benchmarks/lab/patches/ (git apply it first)")
    ap.add_argument("--stages", default="", help="weight-ring depths to time, e.g. 2,3 (default: the plan's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--model", default="llama-3.2-1b", help="a tilec.zoo Llama-family model (e.g. llama-3.1-8b)")
    ap.add_argument("--prebuild", action="store_true", help="only build the libraries (no GPU needed)")
    ap.add_argument("--options", type=json_options, default={}, metavar="JSON",
                    help='tilec compile options of the step, e.g. \'{"fuse_gemv": false}\' (default: none; no "costs" key)')
    ap.add_argument("--trace", type=Path, metavar="DIR",
                    help="also write each variant's measured trace (its first run) to DIR/trace_NAME.json")
    args = ap.parse_args()
    variants = parse_variants(args.variants, ap)
    if args.prebuild:
        prebuild(variants, args.batch, args.model, args.options)
        return
    step, run = llama_step("variants_ab.py", batch=args.batch, name=args.model, options=args.options)
    base = step.program.executor
    opts = dataclasses.replace(base.opts, profile=True)

    with ThreadPoolExecutor(len(variants)) as pool:
        libs = list(pool.map(lambda lines: build_variant(base.sources, lines, opts.arch),
                             (lines for _, lines in variants)))
    exs = {name: CudaExecutor(base.plan, opts, base.device, lib_path=lib) for (name, _), lib in zip(variants, libs)}

    q = base.queues
    lin = q[..., F["opcode"][0]] == opdef("linear_fused").opcode
    reuse = lin & (q[..., F["params"][0] + 4] != 0)
    staged = lin & (q[..., F["params"][0] + 4] == 0)
    ref = None
    for name, ex in exs.items():
        step.program.executor = ex
        out = run().float()
        ex.check()
        s = ex.stamps.cpu()
        ok = (s[..., 2] > 0) & (s[..., 0] > 0)
        d = ((s[..., 2] - s[..., 0]).float() / 1e3)
        m_st = statistics.median(d[staged.cpu() & ok].tolist()) if bool((staged.cpu() & ok).any()) else float("nan")
        m_re = statistics.median(d[reuse.cpu() & ok].tolist()) if bool((reuse.cpu() & ok).any()) else float("nan")
        ref = out if ref is None else ref
        print(f"{name:12s} logits max|diff| vs {variants[0][0]}: {float((out - ref).abs().max()):.3e}; "
              f"start->mark1 median us: staging {m_st:.2f}, reusing {m_re:.2f}", flush=True)
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            write_trace(args.trace / f"trace_{name}.json",
                        measured_trace(base.plan, s, step.program.compiled.stages["linearized"]))
        ex.stamps = None  # timing without stamps
    res = {}
    for depth in (int(v) for v in (args.stages or str(base.ring_stages)).split(",")):
        graphs = {}
        try:
            for ex in exs.values():
                ex.use_ring_stages(depth)
        except TilecError as e:
            print(f"ring stages {depth}: {e}")
            continue
        for name, ex in exs.items():
            step.program.executor = ex
            run()
            graphs[name] = cuda_graph(run)
        with SmClock() as clk:
            for _ in range(args.rounds):
                for name in exs:
                    step.program.executor = exs[name]
                    res.setdefault((name, depth), []).append(time_cuda(graphs[name].replay, args.iters))
        mhz = clk.mhz if clk.mhz is not None else "-"
        print(f"ring {depth}: median SM clock {mhz} MHz over the rounds", flush=True)
        for name, ex in exs.items():
            ex.check()
    print(f"\n{'variant':12s} {'ring':>4s} {'median ms':>10s}  rounds")
    for (name, depth), ts in res.items():
        print(f"{name:12s} {depth:4d} {statistics.median(ts):10.3f}  {[round(t, 3) for t in ts]}")


if __name__ == "__main__":
    main()
