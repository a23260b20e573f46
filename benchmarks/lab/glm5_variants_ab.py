"""Compile-time variants of the executor on the GLM-5 DSA prelude, A/B in one process
(benchmarks/lab: an experiment).

Compiles the full-size prelude (FP8 by default, ``--bf16``; 2 x 8 tokens, KV 8192, ``tile_rows`` 4
and a 2-stage ring as ``benchmarks/glm5_prelude.py``, or ``--options``), builds its generated program again with each variant's
``#define`` lines prepended, and prints per variant: one profiled step's median tile time, start ->
mark 1 and mark 1 -> mark 2 per op kind (``stamps``), then the persistent kernel's median time
(alternating variants, several rounds; L2 flushed before each call).

    PYTHONPATH=. python benchmarks/lab/glm5_variants_ab.py 'base=' 'other=TILEC_MY_SWITCH'
    TILEC_CACHE_DIR=$PWD/.tilec-cache PYTHONPATH=. python benchmarks/lab/glm5_variants_ab.py --prebuild 'base=' ...

``--prebuild`` builds the variants' libraries into the build cache without a GPU (carry the cache
to the GPU machine). A variant is NAME=DEFINE[,DEFINE...] (DEFINE as NAME or NAME=VALUE); an
experiment puts its alternative code under an #ifdef in runtime/tilec. Variants that skip work
give wrong outputs: they measure where time goes. ``--plan NAME=JSON`` also times the plan compiled
with other options (and, under a "costs" key, other ``tilec.cost.MEASURED`` figures) with the first
variant's library. Used on an H200 on 2026-12-01 (the bf16 prelude with the weight loader's 1-byte /
paired item arithmetic: 314.3 us against 314.4 with the old code; the FP8 prelude's cost refit:
270.2 against 314.6 us with the old figures).
"""
import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "lab"))
import glm5_dsa_prelude as glm  # noqa: E402
from glm5_prelude import time_cuda  # noqa: E402
from variants_ab import parse_variants  # noqa: E402
from tilec import codegen, cost  # noqa: E402
from tilec.api import compile_module  # noqa: E402
from tilec.ops import opdef  # noqa: E402
from tilec.plan import F  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--bf16", action="store_true", help="the bf16 prelude instead of FP8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--prebuild", action="store_true", help="only build the libraries (no GPU needed)")
    ap.add_argument("--stages", default="", help="also time these weight-ring depths, e.g. 2,3 (CudaExecutor.use_ring_stages)")
    ap.add_argument("--options", default="{}", help="compile options of the plan, JSON (tile_rows 4 and ring_stages 2 "
                                                    "unless given, as benchmarks/glm5_prelude.py)")
    ap.add_argument("--plan", action="append", default=[], metavar="NAME=JSON",
                    help="also time the plan compiled with these options over --options (the first variant's "
                         "macros), e.g. 'rows1={\"tile_rows\": 1}'; a key \"costs\" replaces tilec.cost.MEASURED "
                         "entries for that plan, e.g. '{\"costs\": {\"bmm\": [33.68, 0]}}'")
    ap.add_argument("--per-op", default="fp8_linear_quant", help="op kinds whose ops get a row each in the profile")
    args = ap.parse_args()
    variants = parse_variants(args.variants, ap)
    fp8, dev = not args.bf16, "cpu" if args.prebuild else "cuda"
    mod = glm.make_prelude(glm.FULL, fp8, torch.bfloat16, dev)
    inputs = glm.make_inputs(glm.FULL, fp8, torch.bfloat16, dev)
    base_opts = {"workers": 132, "tile_rows": 4, "ring_stages": 2, **json.loads(args.options), "check": False,
                 "executor": "reference" if args.prebuild else "cuda"}
    prog = compile_module(mod, inputs, options=base_opts)
    sources = codegen.render(prog.plan)
    plans = []  # (name, program) compiled with other options, run with the first variant's macros
    for spec in args.plan:
        name, _, js = spec.partition("=")
        if not name or name in {n for n, _ in variants} | {n for n, _ in plans}:
            ap.error(f"--plan {spec!r}: needs a name no variant or other plan has")
        extra = json.loads(js)
        with cost.measured_overrides(extra.pop("costs", {})):  # tilec.cost.MEASURED entries to plan with instead
            plans.append((name, compile_module(mod, inputs, options={**base_opts, **extra})))

    def build(lines, srcs=sources):
        return codegen.build({**srcs, "program.cu": lines + srcs["program.cu"]}, prog.opts.arch)

    with ThreadPoolExecutor(2 if args.prebuild else len(variants)) as pool:
        libs = list(pool.map(build, (lines for _, lines in variants)))
        plan_libs = list(pool.map(lambda pp: build(variants[0][1], codegen.render(pp[1].plan)), plans))
    if args.prebuild:
        for (name, _), lib in zip(variants + plans, libs + plan_libs):
            print(f"{name}: {lib}")
        return
    from tilec.cuda import CudaExecutor
    base = prog.executor
    opts = dataclasses.replace(base.opts, profile=True)
    exs = {name: CudaExecutor(base.plan, opts, base.device, lib_path=lib) for (name, _), lib in zip(variants, libs)}
    progs = {name: prog for name, _ in variants}
    for (name, pp), lib in zip(plans, plan_libs):
        exs[name] = CudaExecutor(pp.plan, dataclasses.replace(pp.executor.opts, profile=True), pp.device, lib_path=lib)
        progs[name] = pp
    bound = {}
    for name, pg in progs.items():
        tensors, p = pg.bind_args(inputs)
        bound[name] = (tensors, pg.plan.bind(tensors, p))
    per_op_kinds = set(args.per_op.split(","))
    for name, ex in exs.items():
        pg = progs[name]
        tensors, table = bound[name]
        ops, opcodes = pg.plan.graph.ops, pg.plan.queues[..., F["opcode"][0]]
        opidx = pg.plan.queues[..., F["op"][0]]
        kinds = {opdef(op.kind).opcode: op.kind for op in ops}
        ex.run(tensors, table)
        torch.cuda.synchronize()
        ex.check()
        s = ex.stamps.cpu().double()
        per = defaultdict(lambda: ([], [], []))
        for w in range(s.shape[0]):
            for i in range(s.shape[1]):
                st, en, m1, m2 = s[w, i].tolist()
                k = kinds.get(int(opcodes[w, i]))
                if k is None or st <= 0 or en <= 0:
                    continue
                if k in per_op_kinds:
                    k = f"{k}:{ops[int(opidx[w, i])].name}"
                per[k][0].append((en - st) / 1e3)
                if m1 > 0:
                    per[k][1].append((m1 - st) / 1e3)
                    if m2 > 0:
                        per[k][2].append((m2 - m1) / 1e3)
        span = (s[..., 1].max() - s[..., 0][s[..., 0] > 0].min()).item() / 1e3
        med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
        print(f"{name}: step span {span:.1f} us; per kind: n, median tile us, start->mark1, mark1->mark2")
        for k, (d, a, b) in sorted(per.items(), key=lambda kv: -sum(kv[1][0])):
            print(f"  {k[:44]:44s} {len(d):5d} {med(d):8.2f} {med(a):8.2f} {med(b):8.2f}")
        ex.stamps = None
    res = defaultdict(list)
    for depth in [next(iter(exs.values())).ring_stages] + [int(v) for v in args.stages.split(",") if v]:
        for ex in exs.values():
            ex.use_ring_stages(depth)
        for _ in range(args.rounds):
            for name, ex in exs.items():
                res[(name, depth)].append(time_cuda(lambda ex=ex, b=bound[name]: ex.run(*b), args.iters))
        for ex in exs.values():
            ex.check()
    print(f"\n{'variant':12s} {'ring':>4s} {'median us':>10s}  rounds")
    for (name, depth), ts in res.items():
        print(f"{name:12s} {depth:4d} {statistics.median(ts) * 1e3:10.1f}  {[round(t * 1e3, 1) for t in ts]}")


if __name__ == "__main__":
    main()
