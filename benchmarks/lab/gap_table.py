"""The time a worker spends between two instructions, from measured traces (benchmarks/lab).

An instruction starts once its worker is free (its previous instruction ended) and its event is
ready (the last instruction signalling that event ended; both from ``tilec.trace.readiness``, as
``hop_table`` uses them). For the GEMV (``linear_fused``) and
split-KV attention-partial instructions that start in the middle 60 % of the step (their op's
first tile does; all of that op's tiles count), this prints medians in µs of:

* ``gap``: from the worker's previous instruction's end to this one's start;
* ``ready->start``: from the later of the two readiness times to the start (what the executor
  itself adds: the next descriptor, operand decoding, the op's setup, the event poll);
* the same two over the *worker-bound* instructions (the event was ready before the previous
  instruction ended; a tie counts as event-bound, as in ``hop_table``: ``tilec.trace.bound_by``),
  over the *self-signaled* ones (the worker's previous instruction was the event's last signal:
  the worker completes the event itself, so nothing overlaps the gap - its signal's way to L2,
  the next descriptor and operands, the op's setup, the poll - which is on the phase boundary's
  critical path when that tile is the op's last to start), and over the last eighth of each op's
  tiles to start ("late"): the tiles that end a phase, so what they add is on the step's
  critical path.

On an H200 (Llama-3.2-1B batch 1, context 1024; ``profile_step.py``, twenty-second session call
1) worker-bound GEMVs started a median 2.56 µs after their previous instruction ended, while a
GEMV whose worker was already waiting started 0.83 µs after its event was ready (the poll's hop).
In the twenty-seventh session's traces (calls 1-5) self-signaled GEMVs started a median 2.53-2.59
µs after their own signal, and an op's last tile to start often was one of them (about one GEMV op
in three). In the thirty-first session's call 8, self-signaled GEMVs started a median 1.54 µs after
their own signal, and self-signaled split-KV partials 0.77 instead of 1.57 µs once they no longer
issued L2 prefetches before their wait.

    python benchmarks/lab/gap_table.py trace.json[.gz] [more traces]

Traces come from ``benchmarks/profile_step.py`` or ``benchmarks/lab/variants_ab.py --trace``
(``otherData.clock`` "measured"; plain or gzip-compressed JSON, ``tilec.tracefile.read_trace``); a
predicted trace (an artifact's ``trace.json``) is refused.
Exits 1 if a file cannot be read or is not a measured tilec trace.
"""
import argparse
import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tilec.trace import bound_by, readiness  # noqa: E402
from tilec.tracefile import read_trace  # noqa: E402

KINDS = ("linear_fused", "attention_partial")


def self_signaled(trace: dict) -> set[tuple[int, int]]:
    """``(worker, instruction)`` of the instructions whose worker's previous traced instruction was
    a last signal of the event they wait for: its end is the event's readiness (every signal ending
    at that same time counts, as a tie counts as event-bound in ``tilec.trace.bound_by``). Built
    on ``tilec.trace.readiness``: a worker's previous instruction is its one slice ending at ``free``."""
    signals = {(e["args"]["worker"], e["args"].get("signal_event"), e["ts"] + e["dur"])
               for e in trace["traceEvents"] if e.get("ph") == "X"}
    return {(b["args"]["worker"], b["args"]["instruction"]) for b, free, ready in readiness(trace)
            if ready == free and (b["args"]["worker"], b["args"].get("wait_event"), free) in signals}


def gap_lines(trace: dict) -> list[str]:
    """The table's lines for one measured trace (Chrome trace JSON with ``otherData.makespan_us``;
    worker readiness and event readiness from ``tilec.trace.readiness``)."""
    span = trace["otherData"].get("makespan_us")
    if not isinstance(span, (int, float)):
        raise ValueError("no otherData.makespan_us (tilec.trace.measured_trace writes it)")
    own = self_signaled(trace)
    lines = []
    for cat in KINDS:
        by_op = collections.defaultdict(list)  # op -> [(slice, free, ready)], ready -inf without an event
        for e, free, ready in readiness(trace):
            if e["cat"] == cat:
                by_op[e["args"]["op"]].append((e, free, float("-inf") if ready is None else ready))
        rows, late = [], []
        for tiles in by_op.values():
            tiles.sort(key=lambda t: t[0]["ts"])
            if 0.2 * span < tiles[0][0]["ts"] < 0.8 * span:
                rows += tiles
                late += tiles[-max(1, len(tiles) // 8):]
        if not rows:
            lines.append(f"  {cat}: no instructions in the middle 60 % of the step")
            continue
        bound = [t for t in rows if bound_by(t[1], t[2]) == "worker-bound"]
        mine = [t for t in rows if (t[0]["args"]["worker"], t[0]["args"]["instruction"]) in own]
        for name, sel in (("all", rows), ("worker-bound", bound), ("self-signaled", mine), ("late 1/8", late)):
            if not sel:  # the count still shows (on recent traces no GEMV is worker-bound)
                lines.append(f"  {cat:18s} {name:13s} n={0:5d}  (none)")
                continue
            gap = statistics.median(e["ts"] - free for e, free, _ in sel)
            to_start = statistics.median(e["ts"] - max(free, ready) for e, free, ready in sel)
            lines.append(f"  {cat:18s} {name:13s} n={len(sel):5d}  gap {gap:5.2f}  ready->start {to_start:5.2f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="measured traces (JSON, plain or gzip-compressed)")
    status = 0
    for path in ap.parse_args().traces:
        try:
            trace = read_trace(path)
            lines = gap_lines(trace)
            head = f"{path}: makespan {float(trace['otherData']['makespan_us']):.1f} us (medians, us)"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)
            status = 1
            continue
        print(head)
        print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
