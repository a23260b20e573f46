"""Measured per-instruction timeline of one compiled decode step on the GPU.

Writes a Chrome/Perfetto trace (one track per worker, one slice per instruction named by op
and FX node) and prints a table per op kind: summed instruction time, bytes moved by its
tiles, and the achieved bandwidth while those instructions ran.

    python benchmarks/profile_step.py --model llama-3.2-1b --context 1024 --out trace.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.trace import measured_trace, write_trace  # noqa: E402
from tilec.zoo import make_model, prefill  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="trace.json")
    ap.add_argument("--options", default="{}", help='extra compile options as JSON, e.g. \'{"attn_kv_chunk": 64}\'')
    args = ap.parse_args()
    model = make_model(args.model, torch.bfloat16, "cuda", layers=args.layers)
    cache, tok = prefill(model, 1, args.context, args.context + 8, "cuda")
    step = compile_decode_step(model, cache, 1, options=dict(json.loads(args.options), profile=True))
    for i in range(3):
        step(tok, args.context + i)  # warm-up; the last run's stamps are kept
    stamps = step.program.executor.stamps.cpu()
    tg = step.program.compiled.stages["linearized"]
    trace = measured_trace(step.program.plan, stamps, tg)
    write_trace(args.out, trace)
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    span = max(e["ts"] + e["dur"] for e in slices) - min(e["ts"] for e in slices)
    tasks = {t.id: t for t in tg.tasks}
    per = collections.defaultdict(lambda: [0.0, 0, 0, []])
    for e in slices:
        t = tasks[tg.order[e["args"]["task"]]]
        row = per[t.kind]
        row[0] += e["dur"]
        row[1] += t.nbytes
        row[2] += 1
        row[3].append(e["dur"])
    print(f"{args.model} step span {span:.1f} us over {len(slices)} instructions; trace -> {args.out}")
    print(f"{'op kind':<18} {'count':>6} {'sum us':>10} {'median us':>10} {'MB':>9} {'GB/s per instr':>15}")
    for kind, (us, nbytes, n, durs) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"{kind:<18} {n:>6} {us:>10.1f} {statistics.median(durs):>10.2f} {nbytes / 1e6:>9.2f} "
              f"{nbytes / max(us, 1e-9) / 1e3:>15.1f}")


if __name__ == "__main__":
    main()
