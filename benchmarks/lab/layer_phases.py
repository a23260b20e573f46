"""A Llama-family decode step's layer phases, from measured traces (benchmarks/lab).

A phase is one op's tiles, joined by the tiles of the ops of its kind that start before its first
tile ends (sibling ops: q / k / v, gate / up; a next phase's tiles wait for the previous one's).
Phases are named by the FX source line their tiles carry (``args.source``, HF Llama / Qwen3
``modeling_*.py``): q / k / v projections ``qkv``, the attention call ``attn``, ``o_proj`` ``o``,
the MLP line ``gateup`` right after ``o`` and ``down`` otherwise (gate / up and down share the
line), ``lm_head`` ``lm``. Other ops (the embedding, Qwen3's q / k norms) are not reported but end
the previous phase of what follows them. For each name this prints, over its ``n`` phases, the
medians in µs of:

* ``span``: from the phase's first tile start to its last tile end;
* ``tile``: the median tile (instruction) time;
* ``mark1``: the median time from a tile's start to its mark 1 (a GEMV's x staged, a split-KV
  partial's queries staged; a tile's start is when its event wait returned);
* ``mark2``: the same to its mark 2 (a GEMV's first weight stage in, a split-KV partial's scores
  and softmax done; with ``benchmarks/lab/patches/s34-tail-marks.patch`` a batch-1 ring GEMV's mark 1
  is its last weight stage in and mark 2 the barrier after every warp's last item);
* ``first`` / ``last``: from the previous phase's last end to this phase's first / last tile start
  (the step's first op has none: these columns may have one value fewer than ``n``). ``first`` is
  negative when a tile's own producers finished before the previous phase's last tile (split-KV
  partials wait on their own heads' q / k / v tiles);
* ``last_m1``: ``last`` plus that last-starting tile's own mark 1 - when the tile that ends the
  boundary had its rows (NaN without a mark 1).

Not a per-instruction table: ``benchmarks/profile_step.py``'s ``phase_table`` splits one
instruction at its marks. Used on 2026-12-03 (H200, Llama-3.2-1B batch 1, context 1024;
twenty-fifth session) on GEMVs that took x from LL words (branch ``s25/lab``, whose LL tiles stamp
their start once x is staged, so their ``first`` can be negative too): each phase's last-starting
tile had its rows later than with the event protocol.

    python benchmarks/lab/layer_phases.py trace.json[.gz] [more traces]

Traces come from ``benchmarks/profile_step.py`` or ``benchmarks/lab/variants_ab.py --trace``
(``otherData.clock`` "measured"; plain or gzip-compressed JSON, recognized by its first bytes:
``tilec.tracefile.read_trace``). Exits 1 if a file cannot be read, is not a measured trace or holds
no named phase.
"""
import argparse
import collections
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tilec.tracefile import read_trace  # noqa: E402  (no torch)

SOURCES = (("qkv", r"\b[qkv]_proj\("), ("attn", r"attention_interface\(|scaled_dot_product_attention\("),
           ("o", r"\bo_proj\("), ("mlp", r"\bdown_proj\("), ("lm", r"\blm_head\("))
NAMES = ("qkv", "attn", "o", "gateup", "down", "lm")
COLUMNS = ("span", "tile", "mark1", "mark2", "first", "last", "last_m1")


def _source_class(e: dict) -> str | None:
    src = e["args"].get("source", "")
    return next((name for name, rx in SOURCES if re.search(rx, src)), None)


def phases(trace: dict) -> list[tuple[str | None, list[dict]]]:
    """The trace's phases in start order: (name, tiles); name None for an op of no phase."""
    by_op = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "op" in e.get("args", {}):
            by_op[e["args"]["op"]].append(e)
    ops = sorted(((min(e["ts"] for e in es), _source_class(es[0]), es) for es in by_op.values()), key=lambda r: r[0])
    merged: list[list] = []  # [class, tiles, first tile end]
    for t0, cls, es in ops:
        end = min(e["ts"] + e["dur"] for e in es)
        if cls is not None and merged and merged[-1][0] == cls and t0 < merged[-1][2]:
            merged[-1][1].extend(es)
            merged[-1][2] = min(merged[-1][2], end)
        else:
            merged.append([cls, list(es), end])
    out, prev = [], None
    for cls, es, _ in merged:
        name = ("gateup" if prev == "o" else "down") if cls == "mlp" else cls
        out.append((name, es))
        prev = name
    return out


def phase_rows(trace: dict) -> dict[str, dict[str, float]]:
    """{phase name: {column: median µs, "n": phases}} (module docstring); a column without values is NaN."""
    cols = collections.defaultdict(lambda: collections.defaultdict(list))
    prev_end = None
    for name, es in phases(trace):
        starts, ends = [e["ts"] for e in es], [e["ts"] + e["dur"] for e in es]
        if name is None:  # not reported; the boundary of what follows starts at its end
            prev_end = max(ends)
            continue
        c = cols[name]
        c["n"].append(1)
        c["span"].append(max(ends) - min(starts))
        c["tile"].append(statistics.median(e["dur"] for e in es))
        for k in ("mark1", "mark2"):
            m = [e["args"][f"{k}_us"] for e in es if e["args"].get(f"{k}_us") is not None]
            if m:
                c[k].append(statistics.median(m))
        if prev_end is not None:
            last = max(es, key=lambda e: e["ts"])
            c["first"].append(min(starts) - prev_end)
            c["last"].append(last["ts"] - prev_end)
            if last["args"].get("mark1_us") is not None:
                c["last_m1"].append(last["ts"] - prev_end + last["args"]["mark1_us"])
        prev_end = max(ends)
    return {name: {k: statistics.median(c[k]) if c[k] else math.nan for k in COLUMNS} | {"n": len(c["n"])}
            for name, c in cols.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="measured traces (JSON, plain or gzip-compressed)")
    status, tables = 0, []
    for path in ap.parse_args().traces:
        try:
            trace = read_trace(path)
            rows = phase_rows(trace)
            if not rows:
                raise ValueError("no named phases (tiles with a Llama-family FX source line)")
            span = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("ph") == "X")
            tables.append((path, float(span), rows))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)
            status = 1
    for path, span, _ in tables:
        print(f"{path}: last instruction ends at {span:.1f} us")
    for name in NAMES:
        rows = [(path, t[name]) for path, _, t in tables if name in t]
        if rows:
            print(f"\n{name} (medians over its phases, us)")
            print("  ".join(f"{k:>7s}" for k in COLUMNS) + "    n  trace")
            for path, r in rows:
                print("  ".join(f"{r[k]:7.2f}".replace("-0.00", " 0.00") for k in COLUMNS) + f" {r['n']:4d}  {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
