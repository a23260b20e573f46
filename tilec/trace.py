"""Schedule timelines as Chrome / Perfetto trace JSON (the "Trace Event Format").

A trace is a dict ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}``
that ``chrome://tracing`` and https://ui.perfetto.dev open as is:

* metadata events (``"ph": "M"``): the process is named ``"tilec plan"``, and each worker
  that has instructions is a thread (track) named ``"worker N"`` with ``tid = N``;
* one complete event (``"ph": "X"``) per instruction that is not a NoOp, with ``ts`` and
  ``dur`` in microseconds, named ``"<op kind> <FX node>"`` (``"empty"`` for normalization's
  empty tasks) and ``args``: ``worker``, ``instruction`` (index in the queue), ``task``
  (linearized task index), ``op`` (OpGraph op name, or None), ``coords`` (the tile's
  ``[lo, hi]`` ranges), ``bytes``, ``flops``, ``wait_event`` and ``signal_event`` (-1: none),
  and ``source`` (the user's source line, when known).

Two ways to get the times:

* :func:`predicted_trace` simulates the queues with the cost model (``tilec.cost``): an
  instruction starts at ``max(end of the previous instruction on its worker, last trigger
  of its wait event + HOP_US)`` and lasts ``task_time_us(bytes, flops, kind)``. This is the model
  the list scheduler optimizes, so the last slice ends at ``Schedule.makespan_us``.
* :func:`measured_trace` takes per-instruction ``(start_ns, end_ns)`` stamps from a GPU run
  (``%globaltimer``) and shifts them so the earliest start is at 0; instructions left unstamped
  (both 0) get no slice and are counted in ``otherData["unstamped"]``.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from .cost import HOP_US, task_time_us
from .errors import TilecError
from .ops import EMPTY, NOOP
from .plan import F, KernelPlan, decode_coords
from .taskgraph import TaskGraph

PROCESS_NAME = "tilec plan"
_W = {name: F[name][0] for name in ("opcode", "wait_event", "wait_count", "signal_event", "task", "op")}


def predicted_trace(plan: KernelPlan, taskgraph: TaskGraph) -> dict:
    """The plan's timeline as predicted by the cost model (times in microseconds).

    Args:
        plan: the encoded plan.
        taskgraph: the linearized TaskGraph the plan was encoded from (its ``order`` maps the
            descriptors' task indices to tasks, which carry bytes and flops).
    Raises:
        TilecError: the task graph does not match the plan, or the queues cannot progress
            (a deadlock the plan verifier should have caught).
    """
    tasks = _tasks_by_index(plan, taskgraph)
    queues = plan.queues.tolist()
    counts = [0] * plan.events.shape[0]
    last_trigger = [0.0] * plan.events.shape[0]
    free = [0.0] * len(queues)
    pos = [0] * len(queues)
    times: dict[tuple[int, int], tuple[float, float]] = {}
    pending = sum(1 for q in queues for d in q if d[_W["opcode"]] != NOOP)
    while pending:
        progressed = False
        for w, q in enumerate(queues):
            while pos[w] < len(q):
                d = q[pos[w]]
                if d[_W["opcode"]] == NOOP:
                    pos[w] += 1
                    continue
                e = d[_W["wait_event"]]
                if e >= 0 and counts[e] < d[_W["wait_count"]]:
                    break
                start = max(free[w], last_trigger[e] + HOP_US if e >= 0 else 0.0)
                t = tasks[d[_W["task"]]]
                end = start + task_time_us(t.nbytes, t.flops, t.kind)
                times[(w, pos[w])] = (start, end)
                free[w] = end
                s = d[_W["signal_event"]]
                if s >= 0:
                    counts[s] += 1
                    last_trigger[s] = max(last_trigger[s], end)
                pos[w] += 1
                pending -= 1
                progressed = True
        if not progressed:
            stuck = [(w, pos[w], queues[w][pos[w]][_W["wait_event"]]) for w in range(len(queues))
                     if pos[w] < len(queues[w])]
            raise TilecError(f"cannot predict the timeline: the queues make no progress at (worker, instruction, "
                             f"event) {stuck}")
    makespan = max(free, default=0.0)
    return _build(plan, times, tasks, {"clock": "predicted by tilec.cost", "makespan_us": round(makespan, 3)})


def measured_trace(plan: KernelPlan, stamps: torch.Tensor, taskgraph: TaskGraph | None = None) -> dict:
    """The plan's timeline from measured per-instruction stamps.

    Args:
        plan: the encoded plan that ran.
        stamps: int64 ``[W, L, 2]`` or ``[W, L, 4]`` (the plan's queue shape): ``(start_ns,
            end_ns)`` of each instruction, e.g. from ``%globaltimer``, then optionally two marks
            an op recorded (ns, 0 for none; slices carry them as ``mark1_us``/``mark2_us`` after
            the start); entries of NoOps are ignored. Times are shifted so the earliest start is 0.
            An instruction whose start and end are both 0 was not stamped (a run that did not reach
            it): it has no slice, and ``otherData["unstamped"]`` counts it (with the first few
            ``(worker, instruction)`` in ``otherData["unstamped_at"]``); one with a start but no end
            started and never finished (a step that trapped or timed out in it): no slice either, counted
            in ``otherData["unfinished"]`` / ``["unfinished_at"]``.
        taskgraph: optional; when given, slices also carry the tasks' bytes and flops.
    Raises:
        TilecError: ``stamps`` has the wrong shape or is not integer nanoseconds, or an instruction's
            stamps are negative or end before they start.
    """
    stamps = torch.as_tensor(stamps)
    w_n, l_n = plan.queues.shape[:2]
    if tuple(stamps.shape) not in ((w_n, l_n, 2), (w_n, l_n, 4)):
        raise TilecError(f"stamps must have shape [W, L, 2] or [W, L, 4] = [{w_n}, {l_n}, 2 or 4], "
                         f"got {list(stamps.shape)}")
    if stamps.is_floating_point() or stamps.is_complex() or stamps.dtype == torch.bool:
        raise TilecError(f"stamps must be integer nanoseconds (int64, as %globaltimer gives them), got "
                         f"{str(stamps.dtype).removeprefix('torch.')}")
    tasks = _tasks_by_index(plan, taskgraph) if taskgraph is not None else None
    live = (plan.queues[:, :, _W["opcode"]] != NOOP).nonzero().tolist()
    st = stamps.to(torch.int64).tolist()
    negative = [(w, j) for w, j in live if min(st[w][j]) < 0]
    if negative:
        raise TilecError(f"measured stamps are negative at (worker, instruction) {negative[:8]}: not %globaltimer "
                         f"nanoseconds")
    unstamped = [(w, j) for w, j in live if st[w][j][0] == 0 and st[w][j][1] == 0]
    # started but not finished (a step that trapped or timed out inside the op): the kernel stamps the end last
    unfinished = [(w, j) for w, j in live if st[w][j][0] != 0 and st[w][j][1] == 0]
    live = [(w, j) for w, j in live if st[w][j][1] != 0]
    bad = [(w, j) for w, j in live if st[w][j][1] < st[w][j][0]]
    if bad:
        raise TilecError(f"measured stamps end before they start at (worker, instruction) {bad[:8]}")
    t0 = min((st[w][j][0] for w, j in live), default=0)
    times = {(w, j): ((st[w][j][0] - t0) / 1000.0, (st[w][j][1] - t0) / 1000.0) for w, j in live}
    marks = {(w, j): tuple(round((m - st[w][j][0]) / 1000.0, 3) if m else None for m in st[w][j][2:])
             for w, j in live if any(st[w][j][2:])}
    makespan = max((end for _, end in times.values()), default=0.0)
    other = {"clock": "measured", "makespan_us": round(makespan, 3)}
    if unstamped:
        other.update(unstamped=len(unstamped), unstamped_at=[list(p) for p in unstamped[:8]])
    if unfinished:
        other.update(unfinished=len(unfinished), unfinished_at=[list(p) for p in unfinished[:8]])
    return _build(plan, times, tasks, other, marks)


def kind_table(trace: dict, taskgraph: TaskGraph) -> str:
    """A measured trace (:func:`measured_trace`) summed per op kind: instructions, summed and
    median instruction time (µs), bytes their tiles move (MB) and the rate while they ran
    (GB/s per instruction), most time first; the first line gives the step's span."""
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not slices:
        return "no instructions ran"
    span = max(e["ts"] + e["dur"] for e in slices) - min(e["ts"] for e in slices)
    tasks = {t.id: t for t in taskgraph.tasks}
    per: dict[str, list] = {}
    for e in slices:
        t = tasks[taskgraph.order[e["args"]["task"]]]
        row = per.setdefault(t.kind, [0.0, 0, []])
        row[0] += e["dur"]
        row[1] += t.nbytes
        row[2].append(e["dur"])
    lines = [f"step span {span:.1f} us over {len(slices)} instructions",
             f"{'op kind':<18} {'count':>6} {'sum us':>10} {'median us':>10} {'MB':>9} {'GB/s per instr':>15}"]
    for kind, (us, nbytes, durs) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{kind:<18} {len(durs):>6} {us:>10.1f} {statistics.median(durs):>10.2f} {nbytes / 1e6:>9.2f} "
                     f"{nbytes / max(us, 1e-9) / 1e3:>15.1f}")
    return "\n".join(lines)


def op_table(trace: dict, t_lo: float = 0.0, t_hi: float = float("inf")) -> str:
    """A measured trace's instructions grouped by OpGraph op, in order of their median start,
    for the ops whose median start lies in ``[t_lo, t_hi]`` (µs from the step's start; one
    decoder layer, say): tiles, first / median / last start, median / last end, the median
    tile time, the median time from a tile's start to its first mark (a GEMV's x staged; a split-KV
    attention partial's queries staged) and from there to its second (the first weight stage in;
    the scores and softmax done), and the median bytes per tile - the
    step's critical path, op by op (Empty tasks are left out)."""
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["args"].get("op")]
    if not slices:
        return "no instructions ran"
    per: dict[str, list] = {}
    for e in slices:
        per.setdefault(e["args"]["op"], []).append(e)
    rows = sorted(((statistics.median(e["ts"] for e in es), op, es) for op, es in per.items()), key=lambda r: r[0])
    med = statistics.median
    lines = [f"{'op':<40} {'tiles':>5} {'start':>8} {'median':>8} {'last':>8} {'end med':>8} {'end max':>8} "
             f"{'tile us':>8} {'->mark1':>8} {'->mark2':>8} {'KB':>7}"]
    for start, op, es in rows:
        if not t_lo <= start <= t_hi:
            continue
        m1 = [e["args"]["mark1_us"] for e in es if e["args"].get("mark1_us") is not None]
        m2 = [e["args"]["mark2_us"] - e["args"]["mark1_us"] for e in es
              if e["args"].get("mark2_us") is not None and e["args"].get("mark1_us") is not None]
        ends = [e["ts"] + e["dur"] for e in es]
        kb = med(e["args"].get("bytes", 0) for e in es) / 1024
        name = op if len(op) <= 40 else "..." + op[-37:]  # the end tells partial from combine
        lines.append(f"{name:<40} {len(es):>5} {min(e['ts'] for e in es):>8.1f} {start:>8.1f} "
                     f"{max(e['ts'] for e in es):>8.1f} {med(ends):>8.1f} {max(ends):>8.1f} "
                     f"{med(e['dur'] for e in es):>8.2f} {_cell(m1)} {_cell(m2)} {kb:>7.0f}")
    return "\n".join(lines)


def _cell(values: list) -> str:
    return f"{statistics.median(values):>8.2f}" if values else f"{'-':>8}"


def wait_table(trace: dict) -> str:
    """How long workers wait for producers in a measured trace: the gap between an
    instruction's end and the next one's start on the same worker, by the kind of the
    instruction that waits - count, mean, median and 90th percentile (µs) and the total per
    worker, most first. A start is the end of the instruction's event wait; a GEMV (linear,
    linear_fused) does its setup before that wait, so its gap includes that setup."""
    by_worker: dict[int, list] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            by_worker.setdefault(e["args"]["worker"], []).append(e)
    gaps: dict[str, list] = {}
    for es in by_worker.values():
        es.sort(key=lambda e: e["args"]["instruction"])
        for a, b in zip(es, es[1:]):
            gaps.setdefault(b["cat"], []).append(b["ts"] - (a["ts"] + a["dur"]))
    if not gaps:
        return "no waits: no worker ran two instructions"
    lines = [f"{'waiting kind':<18} {'count':>6} {'mean us':>8} {'median':>8} {'p90':>8} {'us/worker':>10}"]
    for kind, g in sorted(gaps.items(), key=lambda kv: -sum(kv[1])):
        g = sorted(g)
        lines.append(f"{kind:<18} {len(g):>6} {statistics.mean(g):>8.2f} {statistics.median(g):>8.2f} "
                     f"{g[min(len(g) - 1, int(0.9 * len(g)))]:>8.2f} {sum(g) / len(by_worker):>10.1f}")
    return "\n".join(lines)


def readiness(trace: dict) -> list[tuple[dict, float, float | None]]:
    """For each instruction of a measured trace that follows another on its worker: ``(slice,
    free, ready)`` - ``free`` the end of the worker's previous instruction (µs), ``ready`` the end
    of the last instruction that signals the event it waits for (None when it waits for none, or
    for one the trace does not signal). One step's trace: no event is signaled for two steps in it."""
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    signaled: dict[int, float] = {}
    by_worker: dict[int, list] = {}
    for e in slices:
        s = e["args"].get("signal_event", -1)
        if s is not None and s >= 0:
            signaled[s] = max(signaled.get(s, float("-inf")), e["ts"] + e["dur"])
        by_worker.setdefault(e["args"]["worker"], []).append(e)
    out = []
    for es in by_worker.values():
        es.sort(key=lambda e: e["args"]["instruction"])
        for a, b in zip(es, es[1:]):
            out.append((b, a["ts"] + a["dur"], signaled.get(b["args"].get("wait_event", -1))))
    return out


def bound_by(free: float, ready: float) -> str:
    """Which readiness came last for an instruction (times in µs): ``"event-bound"`` when its
    event's last signal was no earlier than its worker's previous end (a tie counts as event-bound),
    else ``"worker-bound"``. ``hop_table`` and ``benchmarks/lab/gap_table.py`` both split by it."""
    return "event-bound" if ready >= free else "worker-bound"


def hop_table(trace: dict) -> str:
    """Dependency hops in a measured trace: for each instruction with an event wait that follows
    another on its worker (a worker's first instruction has no previous end), its start minus the
    later of (a) its worker's previous end and (b) the end of the last instruction that
    signals its event - the time from "ready" to running, by the kind of the waiting instruction.
    "event-bound" rows count the instructions whose event came last (the hop is the counter's
    way to L2 and the waiter's poll - its next poll after a back-off, its response queued behind
    any weight copies still landing on that SM - plus, for a GEMV dispatched before its wait,
    setup that ends later); "worker-bound" ones, those whose own worker was still busy (the hop
    is the next instruction's dispatch and wait). Count, median and 90th percentile (µs). An
    end is stamped after the instruction's signal, so a hop does not include the producer's
    release fence. One step's trace: no event is signaled for two steps in it."""
    hops: dict[tuple[str, str], list[float]] = {}
    for b, free, ready in readiness(trace):
        if ready is None:
            continue
        hops.setdefault((b["cat"], bound_by(free, ready)), []).append(b["ts"] - max(free, ready))
    if not hops:
        return "no hops: no instruction waits, after another on its worker, for an event the trace signals"
    lines = [f"{'waiting kind':<18} {'bound by':<13} {'count':>6} {'median':>8} {'p90':>8}"]
    for (kind, bound), h in sorted(hops.items()):
        h = sorted(h)
        lines.append(f"{kind:<18} {bound:<13} {len(h):>6} {statistics.median(h):>8.2f} "
                     f"{h[min(len(h) - 1, int(0.9 * len(h)))]:>8.2f}")
    return "\n".join(lines)


def trace_text(trace: dict) -> str:
    """``trace`` as JSON text, one event per line (diffable)."""
    events = ",\n".join(json.dumps(e, sort_keys=True) for e in trace["traceEvents"])
    rest = {k: v for k, v in trace.items() if k != "traceEvents"}
    head = json.dumps(rest, sort_keys=True)[1:-1]
    return "{" + head + (", " if head else "") + '"traceEvents": [\n' + events + "\n]}\n"


def write_trace(path: str | os.PathLike, trace: dict) -> None:
    """Writes ``trace`` as JSON to ``path`` atomically, one event per line (:func:`trace_text`)."""
    write_atomic(path, trace_text(trace))


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file in the same directory and
    ``os.replace``, so a reader never sees a partial file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---- helpers -----------------------------------------------------------------------------

def _tasks_by_index(plan: KernelPlan, tg: TaskGraph) -> list:
    """Tasks by linearized index (the descriptors' ``task`` field)."""
    if not tg.order and tg.tasks:
        raise TilecError("the task graph is not linearized: pass the one the plan was encoded from")
    by_id = {t.id: t for t in tg.tasks}
    tasks = [by_id[tid] for tid in tg.order]
    idx = plan.queues[:, :, _W["task"]][plan.queues[:, :, _W["opcode"]] != NOOP]
    if idx.numel() and int(idx.max()) >= len(tasks):
        raise TilecError(f"the plan refers to task index {int(idx.max())} but the task graph has {len(tasks)} tasks")
    return tasks


def _slice_name(plan: KernelPlan, d: list[int]) -> tuple[str, str | None, str]:
    """(slice name, op name, source line) of one descriptor."""
    if d[_W["opcode"]] == EMPTY:
        return "empty", None, ""
    op = plan.graph.ops[d[_W["op"]]]
    prov = op.provenance
    return f"{op.kind} {prov.node if prov else op.name}", op.name, prov.source if prov else ""


def _build(plan: KernelPlan, times: dict, tasks: list | None, other: dict, marks: dict | None = None) -> dict:
    queues = plan.queues.tolist()
    events: list[dict] = [{"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": PROCESS_NAME}}]
    slices: list[dict] = []
    for w, q in enumerate(queues):
        mine = [(j, d) for j, d in enumerate(q) if d[_W["opcode"]] != NOOP and (w, j) in times]  # (not unstamped)
        if not mine:
            continue
        events.append({"ph": "M", "pid": 0, "tid": w, "name": "thread_name", "args": {"name": f"worker {w}"}})
        events.append({"ph": "M", "pid": 0, "tid": w, "name": "thread_sort_index", "args": {"sort_index": w}})
        for j, d in mine:
            start, end = (round(x * 1000) for x in times[(w, j)])  # whole ns: ts + dur == next ts
            name, op_name, source = _slice_name(plan, d)
            args = {"worker": w, "instruction": j, "task": d[_W["task"]], "op": op_name,
                    "coords": [list(c) for c in decode_coords(d)],
                    "wait_event": d[_W["wait_event"]], "signal_event": d[_W["signal_event"]]}
            if marks and (w, j) in marks:
                args["mark1_us"], args["mark2_us"] = marks[(w, j)]
            if tasks is not None:
                t = tasks[d[_W["task"]]]
                args["bytes"], args["flops"] = t.nbytes, t.flops
            if source:
                args["source"] = source
            slices.append({"ph": "X", "pid": 0, "tid": w, "name": name, "cat": name.split(" ")[0],
                           "ts": start / 1000, "dur": (end - start) / 1000, "args": args})
    return {"traceEvents": events + slices, "displayTimeUnit": "ns", "otherData": other}
