"""Stage verifiers. Each raises :class:`VerificationError` with the broken invariant.

* :func:`verify_opgraph` - ops registered, operands inside their buffers at every planned
  position, every intermediate produced before it is read;
* :func:`verify_taskgraph` - acyclic, every event has predecessors, every element of each
  intermediate/output written exactly once per step (cache slots at most once; an op's
  dynamic writes once for the whole op),
  accumulations inside written regions; after normalization <= 1 wait and <= 1 trigger per
  task; after linearization a topological order with contiguous event ranges;
* :func:`verify_plan` - queues follow the global order, every task encoded once, wait and
  trigger counts equal the number of signalling instructions, each op's arrival counters its own
  range with exactly its count of arrivals per counter, and a simulation of the queues (no tile
  math) completes without deadlock.
"""
from __future__ import annotations

import networkx as nx
import torch

from . import ops as opreg
from .errors import DeadlockError, VerificationError
from .ir import BufferKind, OpGraph, View
from .ops import ACCUMULATE, DYNAMIC, EMPTY, NOOP, WRITE, Tile
from .plan import F, KernelPlan, decode_coords
from .taskgraph import TaskGraph, map_box


def _max_offset(v: View, p: int) -> int:
    return v.offset + p * v.pos_stride + sum((s - 1) * st for s, st in zip(v.shape, v.strides) if s > 0)


def verify_opgraph(g: OpGraph) -> None:
    """Checks an OpGraph: every op's kind is registered; every input is an INPUT / PARAM / CONST /
    TABLE / STATE buffer or written by an earlier op; every non-empty view lies inside its buffer
    (offset >= 0, no negative stride, its last element in range) at positions 0 and
    ``max_positions - 1``; every graph output is written.

    Raises:
        VerificationError: naming the op, view and buffer of the first broken invariant.
    """
    produced = {name for name, b in g.buffers.items() if b.kind not in (BufferKind.TEMP, BufferKind.OUTPUT)}
    for op in g.ops:
        if op.kind not in opreg.REGISTRY:
            raise VerificationError(f"op {op.name}: unknown kind {op.kind}")
        for v in (*op.inputs, *op.outputs):
            if v.buffer not in g.buffers:
                raise VerificationError(f"op {op.name}: view {v.render()} names no buffer of the graph")
        for v in op.inputs:
            if v.buffer not in produced:
                raise VerificationError(f"op {op.name} reads {v.buffer} before any op writes it")
        for v in (*op.inputs, *op.outputs):
            buf = g.buffers[v.buffer]
            if v.numel == 0:
                continue
            for p in {0, g.max_positions - 1}:
                if v.offset < 0 or _max_offset(v, p) >= buf.numel or any(st < 0 for st in v.strides):
                    raise VerificationError(f"op {op.name}: view {v.render()} overruns buffer {buf.name} "
                                            f"{list(buf.shape)} at position {p}")
        for v in op.outputs:
            produced.add(v.buffer)
    for v in g.outputs:
        if v.buffer not in produced:
            raise VerificationError(f"output {v.render()} is never written")


def _check_writes(tg: TaskGraph, opts) -> None:
    g = tg.graph
    counts: dict[str, torch.Tensor] = {}
    accum: list[tuple[str, tuple]] = []
    for op in g.ops:
        d = opreg.opdef(op.kind)
        operands = d.operands(op)
        dynamic: dict[str, torch.Tensor] = {}  # the op's DYNAMIC writes: counted once per element
        for tile in d.tiles(op, opts):
            for idx, box, access in tile.writes:
                v = operands[idx]
                buf = g.buffers[v.buffer]
                bbox, exact = map_box(v, box, buf, p=0)
                if not exact:
                    raise VerificationError(f"op {op.name}: write box {box} of {v.render()} is not exact")
                if access == WRITE:
                    if buf.name not in counts:
                        counts[buf.name] = torch.zeros(buf.shape, dtype=torch.int32)
                    c = counts[buf.name]
                    c[tuple(slice(lo, hi) for lo, hi in bbox)] += 1
                elif access == ACCUMULATE:
                    accum.append((buf.name, bbox))
                elif access == DYNAMIC:
                    if buf.name not in dynamic:  # (not setdefault: its default would be built per write)
                        dynamic[buf.name] = torch.zeros(buf.shape, dtype=torch.int32)
                    dynamic[buf.name][tuple(slice(lo, hi) for lo, hi in bbox)] = 1
        for name, m in dynamic.items():
            counts[name] = counts[name] + m if name in counts else m
    for name, c in counts.items():
        buf = g.buffers[name]
        if c.numel() == 0:
            continue
        if int(c.max()) > 1:
            raise VerificationError(f"buffer {name}: {int((c > 1).sum())} elements written more than once per step")
        if buf.kind in (BufferKind.TEMP, BufferKind.OUTPUT) and int(c.min()) < 1:
            raise VerificationError(f"buffer {name}: {int((c < 1).sum())} elements never written")
    for name, bbox in accum:
        c = counts.get(name)
        if c is None or int(c[tuple(slice(lo, hi) for lo, hi in bbox)].min()) < 1:
            raise VerificationError(f"buffer {name}: accumulation into {bbox} without an initializing write")
    for b in g.buffers.values():
        if b.kind in (BufferKind.TEMP, BufferKind.OUTPUT) and b.name not in counts and b.numel:
            raise VerificationError(f"buffer {b.name} is never written")


def _event_dag(tg: TaskGraph, ids: set[int]) -> nx.DiGraph:
    """Tasks and events as the nodes of one graph (trigger -> event -> waiter)."""
    dag = nx.DiGraph()
    dag.add_nodes_from(ids)
    for e in tg.events:
        dag.add_edges_from((p, ("e", e.id)) for p in e.preds)
        dag.add_edges_from((("e", e.id), s) for s in e.succs)
    return dag


def verify_taskgraph(tg: TaskGraph, stage: str, opts) -> None:
    """``stage`` is one of ``tasks``, ``fused``, ``normalized``, ``linearized``."""
    ids = {t.id for t in tg.tasks}
    forward = True  # every event's triggers precede its waiters in task-id order
    for e in tg.events:
        if not e.preds and e.succs:
            raise VerificationError(f"event e{e.id} has waiters but no task triggers it")
        if not (e.preds | e.succs) <= ids:
            raise VerificationError(f"event e{e.id} names unknown tasks")
        forward = forward and (not e.succs or max(e.preds) < min(e.succs))
    # acyclic when the task ids order every event forward (build_taskgraph derives each event from
    # earlier tiles, so a valid graph usually is); otherwise, or to name a cycle, networkx on tasks
    # and events as nodes (trigger -> event -> waiter): edges linear in the events' sizes, not their
    # product (a 16-layer batch-16 Llama step's tile_cover events made ~600k task -> task edges).
    # The shortcut saves ~3.4 s of a Llama-3.2-1B compile on this CPU (1M task -> event edges).
    if not forward and not nx.is_directed_acyclic_graph(dag := _event_dag(tg, ids)):
        cycle = [u for u, _ in nx.find_cycle(dag)]
        raise VerificationError("task graph has a cycle: " + " -> ".join(
            f"e{u[1]}" if isinstance(u, tuple) else f"t{u}" for u in cycle + cycle[:1]))
    if stage == "tasks":
        _check_writes(tg, opts)
    if stage in ("normalized", "linearized"):
        for tid, es in tg.waits().items():
            if len(es) > 1:
                raise VerificationError(f"task t{tid} waits on {len(es)} events after normalization")
        for tid, es in tg.triggers().items():
            if len(es) > 1:
                raise VerificationError(f"task t{tid} triggers {len(es)} events after normalization")
    if stage == "linearized":
        pos = {tid: i for i, tid in enumerate(tg.order)}
        if sorted(tg.order) != sorted(ids):
            raise VerificationError("linearized order is not a permutation of the tasks")
        for e in tg.events:
            if e.preds and e.succs:
                p = max(e.preds, key=pos.__getitem__)
                s = min(e.succs, key=pos.__getitem__)
                if pos[p] >= pos[s]:
                    raise VerificationError(f"linearized order puts t{s} before its predecessor t{p}")
        for e in tg.events:
            idx = sorted(pos[s] for s in e.succs)
            if idx and (idx[0] != e.first or idx[-1] != e.last or e.last - e.first + 1 != len(idx)):
                raise VerificationError(f"event e{e.id}: successors are not the contiguous range [{e.first},{e.last}]")


def simulate(plan: KernelPlan, queues: torch.Tensor | None = None) -> None:
    """Runs the queues' waits and signals (no tile math) for two steps.

    Raises:
        DeadlockError: naming the cycle of (worker, instruction, event).
    """
    from .refexec import ReferenceExecutor

    class _Sim(ReferenceExecutor):
        def _execute(self, d, table, mem):
            pass

    sim = _Sim(plan)
    for _ in range(2):
        sim.run({}, plan.static_operands, queues)


def _check_arrivals(plan: KernelPlan, q: list) -> None:
    """Arrival counters (``tilec.plan``): each op that counts arrivals owns its own range after the
    events, the ranges fill ``plan.arrivals``, every counter gets exactly its count of arrivals a
    step (``OpDef.arrival`` of each tile), and an op without counters carries -1. ``q``: the queues as lists."""
    n_events, p0, op_w = plan.events.shape[0], F["params"][0], F["opcode"][0]
    first: dict[int, int] = {}  # op index -> its first counter
    hits: dict[int, list[int]] = {}  # counter -> [count, arrivals]
    for w, qw in enumerate(q):
        for i, d in enumerate(qw):
            if d[op_w] in (NOOP, EMPTY):
                continue
            r = d[F["op"][0]]
            op = plan.graph.ops[r]
            od = opreg.opdef(op.kind)
            if od.arrival_param is None:
                continue
            got, n = d[p0 + od.arrival_param], od.arrivals(op)
            where = f"worker {w}: instruction {i} (op {op.name})"
            if n == 0:
                if got != -1:
                    raise VerificationError(f"{where} counts arrivals at {got} but its op has no counters")
                continue
            if first.setdefault(r, got) != got:
                raise VerificationError(f"{where} counts arrivals from {got}, other tiles of its op from {first[r]}")
            arrival = od.arrival(op, Tile(decode_coords(d), (), ()))  # the tile the executors see
            if arrival is not None:
                counter, count = arrival
                h = hits.setdefault(got + counter, [count, 0])
                h[1] += 1
    ranges = sorted((f, f + opreg.opdef(o.kind).arrivals(o), r) for r, f in first.items() for o in [plan.graph.ops[r]])
    end = n_events
    for lo, hi, r in ranges:
        if lo < end or hi > n_events + plan.arrivals:
            raise VerificationError(f"op {plan.graph.ops[r].name} counts arrivals at [{lo}, {hi}), overlapping "
                                    f"another op's or outside [{n_events}, {n_events + plan.arrivals})")
        end = hi
    if sum(hi - lo for lo, hi, _ in ranges) != plan.arrivals:
        raise VerificationError(f"the ops own {sum(hi - lo for lo, hi, _ in ranges)} arrival counters, "
                                f"the plan has {plan.arrivals}")
    for k, (count, n) in sorted(hits.items()):
        if n != count:
            raise VerificationError(f"arrival counter {k}: {n} tiles arrive a step, the last is expected at {count}")


def verify_plan(plan: KernelPlan, tg: TaskGraph) -> None:
    """Checks an encoded plan against the linearized TaskGraph ``tg`` it encodes: no instruction
    after a queue's NoOp padding; task indices strictly increasing along every queue (the global
    order); every task encoded exactly once; each wait's count equal to its event's trigger count,
    and each event's trigger count equal to the instructions signalling it; the arrival counters
    (:func:`_check_arrivals`); and a two-step simulation of the queues (:func:`simulate`) that
    completes.

    Raises:
        VerificationError: the first broken invariant, naming the worker, instruction, event or
            op involved (a deadlock the simulation found is chained from its DeadlockError).
    """
    q = plan.queues.tolist()
    op_w, task_w, sig_w, wait_w, cnt_w = (F[n][0] for n in ("opcode", "task", "signal_event", "wait_event", "wait_count"))
    seen: list[int] = []
    signals = [0] * plan.events.shape[0]
    for w, qw in enumerate(q):
        last = -1
        padded = False
        for i, d in enumerate(qw):
            if d[op_w] == NOOP:
                padded = True
                continue
            if padded:
                raise VerificationError(f"worker {w}: instruction {i} after NoOp padding")
            if d[task_w] <= last:
                raise VerificationError(f"worker {w}: instruction {i} (task {d[task_w]}) breaks the global order")
            last = d[task_w]
            seen.append(d[task_w])
            if d[sig_w] >= 0:
                signals[d[sig_w]] += 1
            if d[wait_w] >= 0 and d[cnt_w] != int(plan.events[d[wait_w], 0]):
                raise VerificationError(f"worker {w}: instruction {i} waits for {d[cnt_w]} signals of event "
                                        f"{d[wait_w]}, whose count is {int(plan.events[d[wait_w], 0])}")
    if sorted(seen) != list(range(len(tg.tasks))):
        raise VerificationError(f"plan encodes {len(seen)} instructions for {len(tg.tasks)} tasks")
    for e, n in enumerate(signals):
        if n != int(plan.events[e, 0]):
            raise VerificationError(f"event {e}: trigger count {int(plan.events[e, 0])} but {n} instructions signal it")
    _check_arrivals(plan, q)
    try:
        simulate(plan)
    except DeadlockError as err:
        raise VerificationError(f"plan simulation: {err}") from err
