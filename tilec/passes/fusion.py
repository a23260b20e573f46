"""Event fusion (MPK section 4.2).

Requires: a TaskGraph with events derived from region overlap.
Guarantees: no two events have the same successor set, nor the same predecessor set;
the semantics (which tasks must finish before which) are unchanged - with ``coarsen``
(:func:`coarsen_forks`), orderings are added, never removed. Records the event
and dependency counts before and after in ``stats``.

Between the merges, triggers that are implied by another trigger of the same event are
dropped (:func:`drop_implied_triggers`, a transitive reduction at op granularity): in a
decode step the residual stream makes a GEMV tile wait on "all tiles of the previous GEMV
and tile j of the one before", and the second part is already implied by the first; kept,
it gives every consumer tile its own event and normalization an empty task per event.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from ..taskgraph import Event, TaskGraph


def _merge(events: list[Event], key) -> list[Event]:
    groups: dict[frozenset, list[Event]] = {}
    for e in events:
        groups.setdefault(key(e), []).append(e)
    out = []
    for es in groups.values():
        strategies = set().union(*(e.strategy.split("+") for e in es))
        out.append(Event(
            es[0].id,
            frozenset().union(*(e.preds for e in es)),
            frozenset().union(*(e.succs for e in es)),
            es[0].strategy if len(strategies) == 1 else "+".join(sorted(strategies)),
        ))
    return out


def drop_implied_triggers(tg: TaskGraph, events: list[Event]) -> tuple[list[Event], int]:
    """``events`` with implied triggers removed, and how many (task, event) triggers went.

    ``full[C]``: the ops every tile of op C depends on entirely (all their tiles), directly
    or transitively - op X is in it when each C tile waits on all X tiles, and ``full[X]`` is
    inherited when each C tile waits on at least one X tile. The triggers of op P are dropped
    from an event that op X != P also triggers when P is in ``full[X]``: every waiter already
    follows an X tile, which follows every P tile. Each dropped dependency is implied by a
    longer path of the original DAG, so removing all of them at once keeps every ordering
    (they are edges of no transitive reduction).
    """
    op_of = {t.id: t.op for t in tg.tasks}
    tasks_of: dict[str, list[int]] = {}
    for t in tg.tasks:
        if t.op is not None:
            tasks_of.setdefault(t.op, []).append(t.id)
    pred_ops: dict[int, dict[str, set[int]]] = {}  # task -> producer op -> its tiles waited on
    for e in events:
        for s in e.succs:
            by = pred_ops.setdefault(s, {})
            for p in e.preds:
                if op_of[p] is not None:
                    by.setdefault(op_of[p], set()).add(p)
    full: dict[str, set[str]] = {}
    for op in tg.graph.ops:  # topological order
        mine = tasks_of.get(op.name, [])
        producers = set().union(*(pred_ops.get(t, {}).keys() for t in mine)) if mine else set()
        f: set[str] = set()
        for x in producers:
            counts = [len(pred_ops.get(t, {}).get(x, ())) for t in mine]
            if min(counts) >= 1:
                f |= full.get(x, set())
                if min(counts) == len(tasks_of[x]):
                    f.add(x)
        full[op.name] = f
    out, dropped = [], 0
    for e in events:
        ops = {op_of[p] for p in e.preds}
        implied = {P for P in ops if P is not None and any(x != P and P in full.get(x, ()) for x in ops)}
        if implied:
            keep = frozenset(p for p in e.preds if op_of[p] not in implied)
            dropped += len(e.preds) - len(keep)
            e = dataclasses.replace(e, preds=keep)
        out.append(e)
    return out, dropped


def coarsen_forks(tg: TaskGraph, events: list[Event]) -> tuple[list[Event], int]:
    """``events`` with every fan-out into one op's tiles merged, and how many events went.

    A task that triggers several events whose waiters are all tiles of the same op X (a GEMV
    tile whose columns straddle two of X's tiles' reads) would get a relay through empty tasks
    from normalization (a dependent stage more on those waiters' path); instead those events,
    and every event sharing a producer with them, become one (union-find over the tasks'
    triggers), whose waiters then wait on all its producers; its strategy gains ``coarse`` (printed
    in the IR text, e.g. ``e7 coarse+tile``). Orderings are only added, never
    removed. An event one of whose producers is a tile of X that itself waits (a split-K init
    tile reading a computed bias) is left alone. So each added edge runs from a task of an op
    before X - a lower task id, as every edge of ``build_taskgraph`` - or from a task that waits
    on nothing: the graph stays a DAG.
    """
    op_of = {t.id: t.op for t in tg.tasks}
    parent = list(range(len(events)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    waited = set().union(*(e.succs for e in events))
    waiter = []
    for e in events:
        ops = {op_of[s] for s in e.succs}
        own = any(op_of[p] in ops and p in waited for p in e.preds)  # see above: would risk a cycle
        waiter.append(next(iter(ops)) if len(ops) == 1 and None not in ops and not own else None)
    first: dict[tuple[int, str], int] = {}  # (task, waiter op) -> an event it triggers
    for i, e in enumerate(events):
        if waiter[i] is None:
            continue
        for p in e.preds:
            j = first.setdefault((p, waiter[i]), i)
            if j != i:
                parent[find(i)] = find(j)
    roots = [find(i) for i in range(len(events))]
    size = Counter(roots)
    # a merged event is labelled "coarse" (its strategy joins the members', e.g. "coarse+tile"), so the
    # printed stages show which waiters wait on more producers than their reads need
    marked = [dataclasses.replace(e, strategy=e.strategy + "+coarse") if size[roots[i]] > 1 else e
              for i, e in enumerate(events)]
    pos = {id(e): i for i, e in enumerate(marked)}
    out = _merge(marked, lambda e: roots[pos[id(e)]])
    return out, len(events) - len(out)


def fuse_events(tg: TaskGraph, coarsen: bool = False) -> TaskGraph:
    """Merges events with identical successor sets, drops implied triggers, then merges events
    with identical successor or predecessor sets until nothing changes; with ``coarsen``, also
    merges each task's fan-out into one op's tiles (:func:`coarsen_forks`) between the rounds."""
    before_events, before_deps = len(tg.events), tg.dependency_count()
    events, implied = drop_implied_triggers(tg, _merge(list(tg.events), lambda e: e.succs))
    coarsened = 0
    while True:
        n = len(events)
        events = _merge(events, lambda e: e.succs)
        events = _merge(events, lambda e: e.preds)
        if coarsen:
            events, k = coarsen_forks(tg, events)
            coarsened += k
        if len(events) == n:
            break
    events = [dataclasses.replace(e, id=i) for i, e in enumerate(sorted(events, key=lambda e: (min(e.succs), e.id)))]
    out = dataclasses.replace(tg, events=tuple(events))
    stats = dict(tg.stats, events_before_fusion=before_events, deps_before_fusion=before_deps,
                 implied_triggers_dropped=implied, forks_coarsened=coarsened, events_after_fusion=len(events),
                 deps_after_fusion=out.dependency_count())
    return dataclasses.replace(out, stats=stats)
