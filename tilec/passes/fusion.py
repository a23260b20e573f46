"""Event fusion (MPK section 4.2).

Requires: a TaskGraph with events derived from region overlap.
Guarantees: no two events have the same successor set, nor the same predecessor set;
the semantics (which tasks must finish before which) are unchanged. Records the event
and dependency counts before and after in ``stats``.
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


def fuse_events(tg: TaskGraph) -> TaskGraph:
    """Merges events with identical successor sets, then events with identical predecessor sets."""
    before_events, before_deps = len(tg.events), tg.dependency_count()
    events = list(tg.events)
    while True:
        n = len(events)
        events = _merge(events, lambda e: e.succs)
        events = _merge(events, lambda e: e.preds)
        if len(events) == n:
            break
    events = [dataclasses.replace(e, id=i) for i, e in enumerate(sorted(events, key=lambda e: (min(e.succs), e.id)))]
    out = dataclasses.replace(tg, events=tuple(events))
    stats = dict(tg.stats, events_before_fusion=before_events, deps_before_fusion=before_deps,
                 events_after_fusion=len(events), deps_after_fusion=out.dependency_count())
    return dataclasses.replace(out, stats=stats)
