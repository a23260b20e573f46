"""Fits the per-op-kind cost of instructions from a measured trace (``profile_step.py``).

For each op kind, a least-squares line ``time_us = fixed_us + bytes / rate`` over its
instructions, printed as a table: the fixed cost per instruction (µs), the streaming rate of
one worker while the instruction runs (GB/s), and the fit's median absolute error. These
are the numbers ``tilec/cost.py`` should be calibrated with (issue 6).

    python benchmarks/fit_cost.py trace.json
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tilec.tracefile import read_trace  # noqa: E402


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed_us, us_per_byte) of the least-squares line through (bytes, us) points."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    var = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / var if var > 0 else 0.0
    if slope <= 0:  # all one size (or noise): the mean is all the data can say
        return my, 0.0
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a measured trace.json written by benchmarks/profile_step.py")
    args = ap.parse_args()
    events = [e for e in read_trace(args.trace, measured=False)["traceEvents"] if e.get("ph") == "X"]
    by_kind: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in events:
        by_kind[e["cat"]].append((float(e["args"]["bytes"]), float(e["dur"])))
    print(f"{'op kind':<18} {'count':>6} {'fixed us':>9} {'GB/s per worker':>16} {'median |err| us':>16}")
    for kind, pts in sorted(by_kind.items(), key=lambda kv: -sum(t for _, t in kv[1])):
        a, s = fit(pts)
        err = statistics.median(abs(t - (a + s * b)) for b, t in pts)
        rate = f"{1e-3 / s:.1f}" if s > 0 else "-"
        print(f"{kind:<18} {len(pts):>6} {a:>9.2f} {rate:>16} {err:>16.2f}")


if __name__ == "__main__":
    main()
