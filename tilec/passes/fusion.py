"""Event fusion (MPK section 4.2).

Requires: a TaskGraph with events derived from region overlap.
Guarantees: no two events have the same successor set, nor the same predecessor set;
the semantics (which tasks must finish before which) are unchanged. Records the event
and dependency counts before and after in ``stats``.

Between the merges, triggers that are implied by another trigger of the same event are
dropped (:func:`drop_implied_triggers`, a transitive reduction at op granularity): in a
decode step the residual stream makes a GEMV tile wait on "all tiles of the previous GEMV
and tile j of the one before", and the second part is already implied by the first; kept,
it gives every consumer tile its own event and normalization an empty task per event.
"""
from __future__ import annotations

import dataclasses

from ..taskgraph import Event, TaskGraph


def _merge(events: list[Event], key) -> list[Event]:
    groups: dict[frozenset, list[Event]] = {}
    for e in events:
        groups.setdefault(key(e), []).append(e)
    out = []
    for es in groups.values():
        strategies = {e.strategy for e in es}
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


def fuse_events(tg: TaskGraph) -> TaskGraph:
    """Merges events with identical successor sets, drops implied triggers, then merges events
    with identical successor or predecessor sets until nothing changes."""
    before_events, before_deps = len(tg.events), tg.dependency_count()
    events, implied = drop_implied_triggers(tg, _merge(list(tg.events), lambda e: e.succs))
    while True:
        n = len(events)
        events = _merge(events, lambda e: e.succs)
        events = _merge(events, lambda e: e.preds)
        if len(events) == n:
            break
    events = [dataclasses.replace(e, id=i) for i, e in enumerate(sorted(events, key=lambda e: (min(e.succs), e.id)))]
    out = dataclasses.replace(tg, events=tuple(events))
    stats = dict(tg.stats, events_before_fusion=before_events, deps_before_fusion=before_deps,
                 implied_triggers_dropped=implied, events_after_fusion=len(events),
                 deps_after_fusion=out.dependency_count())
    return dataclasses.replace(out, stats=stats)
