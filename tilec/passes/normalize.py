"""Normalization (MPK section 4.3).

Requires: a TaskGraph (fused or not).
Guarantees: every task waits on at most one event and triggers at most one event, so a
descriptor needs one wait field and one signal field. A task waiting on k > 1 events gets
k empty tasks (one per event) that trigger a new event it waits on; tasks triggering the
same set of k > 1 events share a new event that k empty tasks wait on, each triggering one
of the original events. Records ``empty_tasks_added``.
"""
from __future__ import annotations

import dataclasses

from ..taskgraph import Event, Task, TaskGraph


def normalize(tg: TaskGraph) -> TaskGraph:
    """Gives every task at most one wait and one trigger (Mirage MPK, arXiv 2512.22219, section
    4.3) with empty tasks (``op`` None, kind ``empty``) relaying the events:

    * fan-in: a task waiting on k > 1 events waits on a new ``join`` event instead, triggered by k
      empty tasks, each waiting on one of the k;
    * fan-out: the tasks triggering the same set of k > 1 events trigger a new ``fork`` event
      instead, whose k empty waiters each trigger one of the k.

    Returns:
        A new TaskGraph with the empty tasks appended (ids after the existing ones), events that
        have neither triggers nor waiters dropped and the rest renumbered from 0 in id order, and
        ``stats`` with ``empty_tasks_added`` and ``events_after_normalization``. Every ordering
        between the original tasks is kept (a relayed one through empty tasks).
    """
    tasks = list(tg.tasks)
    events = {e.id: {"preds": set(e.preds), "succs": set(e.succs), "strategy": e.strategy} for e in tg.events}
    next_event = max(events, default=-1) + 1
    added = 0

    def new_task() -> int:
        nonlocal added
        t = Task(len(tasks), None, "empty", None)
        tasks.append(t)
        added += 1
        return t.id

    # fan-in: waits on several events
    waits: dict[int, list[int]] = {}
    for eid, e in events.items():
        for s in e["succs"]:
            waits.setdefault(s, []).append(eid)
    for tid, eids in sorted(waits.items()):
        if len(eids) <= 1:
            continue
        joined = {"preds": set(), "succs": {tid}, "strategy": "join"}
        for eid in sorted(eids):
            e = new_task()
            events[eid]["succs"].discard(tid)
            events[eid]["succs"].add(e)
            joined["preds"].add(e)
        events[next_event] = joined
        next_event += 1

    # fan-out: triggers several events (grouped by identical trigger sets)
    trig: dict[int, list[int]] = {}
    for eid, e in events.items():
        for p in e["preds"]:
            trig.setdefault(p, []).append(eid)
    groups: dict[tuple[int, ...], list[int]] = {}
    for tid, eids in trig.items():
        if len(eids) > 1:
            groups.setdefault(tuple(sorted(eids)), []).append(tid)
    for eids, tids in sorted(groups.items()):
        fan = {"preds": set(tids), "succs": set(), "strategy": "fork"}
        for eid in eids:
            e = new_task()
            events[eid]["preds"] -= set(tids)
            events[eid]["preds"].add(e)
            fan["succs"].add(e)
        events[next_event] = fan
        next_event += 1

    out_events = tuple(Event(i, frozenset(e["preds"]), frozenset(e["succs"]), e["strategy"])
                       for i, (_, e) in enumerate(sorted(events.items())) if e["succs"] or e["preds"])
    out_events = tuple(dataclasses.replace(e, id=i) for i, e in enumerate(out_events))
    return dataclasses.replace(tg, tasks=tuple(tasks), events=out_events,
                               stats=dict(tg.stats, empty_tasks_added=added, events_after_normalization=len(out_events)))
