"""Where the time between two instructions of a worker goes, from measured traces (benchmarks/lab).

A worker whose producer finished last starts its next instruction a fixed time after its previous
one ended, even though the event it waits for is already satisfied; that time is on the critical
path of every phase of a decode step. This script reads traces written by
``benchmarks/lab/variants_ab.py --trace DIR`` (or ``benchmarks/profile_step.py``) and prints, for
the GEMV (``linear_fused``) and split-KV attention-partial instructions of the middle 60 % of the
step, the median gap (µs) from the previous instruction's end to this one's start - over all
instructions, and over the last eighth of each op's tiles to start (the late workers).

On an H200 (Llama-3.2-1B batch 1, context 1024; ``profile_step.py``, twenty-second session call
1) the late workers' GEMVs started 2.56 µs after their previous instruction ended (attention
partials 1.86 µs): from one instruction's signal to the next one's event poll succeeding, a
worker's fixed cost, paid on the critical path at each of a layer's five phase boundaries.

    python benchmarks/lab/gap_table.py trace.json [more traces]
"""
import argparse
import collections
import json
import statistics


def gap_lines(path: str) -> list[str]:
    """The table's lines for one trace file (Chrome trace JSON with ``otherData.makespan_us``)."""
    trace = json.load(open(path))
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    by_worker = collections.defaultdict(list)
    for e in slices:
        by_worker[e["tid"]].append(e)
    prev_end = {}
    for row in by_worker.values():
        row.sort(key=lambda e: e["ts"])
        for a, b in zip(row, row[1:]):
            prev_end[id(b)] = a["ts"] + a["dur"]
    span = trace["otherData"]["makespan_us"]
    mid = [e for e in slices if 0.2 * span < e["ts"] < 0.8 * span and id(e) in prev_end]
    lines = [f"{path}: makespan {span:.1f} us"]
    for cat in ("linear_fused", "attention_partial"):
        rows = [e for e in mid if e["cat"] == cat]
        if not rows:
            continue
        by_op = collections.defaultdict(list)
        for e in rows:
            by_op[e["args"]["op"]].append(e)
        late = []
        for tiles in by_op.values():
            tiles.sort(key=lambda e: e["ts"])
            late += tiles[-max(1, len(tiles) // 8):]
        for name, sel in (("all", rows), ("late 1/8", late)):
            gap = statistics.median(e["ts"] - prev_end[id(e)] for e in sel)
            lines.append(f"  {cat:18s} {name:8s} n={len(sel):5d} gap {gap:5.2f} us")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    for path in ap.parse_args().traces:
        print("\n".join(gap_lines(path)))


if __name__ == "__main__":
    main()
