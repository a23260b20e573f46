"""Measured per-instruction timeline of one compiled decode step on the GPU.

Writes a Chrome/Perfetto trace (one track per worker, one slice per instruction named by op
and FX node) and prints a table per op kind: summed instruction time, bytes moved by its
tiles, and the achieved bandwidth while those instructions ran.

    python benchmarks/profile_step.py --model llama-3.2-1b --context 1024 --out trace.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.trace import hop_table, kind_table, measured_trace, op_table, wait_table, write_trace  # noqa: E402
from tilec.timing import need_gpu  # noqa: E402
from tilec.zoo import make_model, prefill  # noqa: E402


def phase_table(trace: dict) -> str:
    """Medians (µs) of the phases the device marks (two ``TileCtx::mark`` stamps per instruction):
    ring-fed GEMVs (runtime/tilec/ops.cuh gemv_bf16_ring): start -> x staged (mark 1) -> first
    weight stage in (mark 2) -> end; split-KV attention partials (ops_attention.cuh): start ->
    queries staged -> scores and softmax done -> end (marks of the tile's last head, split, query
    pass and segment: exact for a decode tile of one head group, one pass, one segment)."""
    lines = []
    for kinds, what, names in ((("linear", "linear_fused"), "ring-fed GEMV", ("x staged", "first weight stage")),
                               (("attention_partial",), "attention partial", ("queries staged", "scores + softmax"))):
        rows = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in kinds
                and e["args"].get("mark1_us") is not None and e["args"].get("mark2_us") is not None]
        if not rows:
            lines.append(f"no {what} instructions recorded phase marks")
            continue
        m1 = statistics.median(e["args"]["mark1_us"] for e in rows)
        m2 = statistics.median(e["args"]["mark2_us"] - e["args"]["mark1_us"] for e in rows)
        rest = statistics.median(e["dur"] - e["args"]["mark2_us"] for e in rows)
        lines.append(f"{what} phases over {len(rows)} instructions (median us): start -> {names[0]} {m1:.2f}, "
                     f"-> {names[1]} {m2:.2f}, -> end {rest:.2f}, whole {statistics.median(e['dur'] for e in rows):.2f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default="trace.json")
    ap.add_argument("--window", default="", metavar="LO,HI",
                    help="print the per-op table for ops starting in [LO, HI] us (default: the middle tenth of the step)")
    ap.add_argument("--options", default="{}", help='extra compile options as JSON, e.g. \'{"attn_kv_chunk": 64}\'')
    args = ap.parse_args()
    try:
        window = tuple(float(v) for v in args.window.split(",")) if args.window else None
        if window is not None and len(window) != 2:
            raise ValueError(args.window)
    except ValueError:
        ap.error(f"--window: expected LO,HI in microseconds, got {args.window!r}")
    need_gpu("profile_step.py")
    model = make_model(args.model, torch.bfloat16, "cuda", layers=args.layers)
    cache, tok = prefill(model, args.batch, args.context, args.context + 8, "cuda")
    step = compile_decode_step(model, cache, args.batch, options=dict(json.loads(args.options), profile=True))
    for i in range(3):
        step(tok, args.context + i)  # warm-up; the last run's stamps are kept
    stamps = step.program.executor.stamps.cpu()
    tg = step.program.compiled.stages["linearized"]
    trace = measured_trace(step.program.plan, stamps, tg)
    write_trace(args.out, trace)
    print(f"{args.model} batch {args.batch}: {kind_table(trace, tg)}; trace -> {args.out}")
    print(phase_table(trace))
    print(wait_table(trace))
    print(hop_table(trace))
    span = trace["otherData"]["makespan_us"]
    lo, hi = window or (0.45 * span, 0.55 * span)
    print(f"ops starting in [{lo:.0f}, {hi:.0f}] us (median start; times in us from the step's start):")
    print(op_table(trace, lo, hi))

if __name__ == "__main__":
    main()
