"""Linearization (MPK section 4.4).

Requires: a normalized TaskGraph (each task waits on <= 1 event).
Guarantees: ``order`` is a topological order in which the successors of every event are
contiguous; each event stores that range as ``[first, last]`` (indices into ``order``).
Within a group, tasks are ordered by descending bottom level (longest predicted path to
the end, from ``tilec.cost``) so the scheduler meets critical tasks first.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from ..cost import HOP_US, task_time_us
from ..errors import VerificationError
from ..taskgraph import TaskGraph


def bottom_levels(tg: TaskGraph) -> dict[int, float]:
    """Longest predicted time (µs) from the start of each task to the end of the graph: the task's
    :func:`tilec.cost.task_time_us` plus the largest ``level + HOP_US`` (0.76 µs) over its
    successors (0 without any).

    Raises:
        VerificationError: the task graph has a cycle.
    """
    # over the bipartite task / event graph, not the task graph it implies: an all-to-all event
    # between GEMV phases (88 triggers, 128 successors) is one node, not 11k task edges. An event's
    # level is the largest of its successors' plus HOP_US, known once they all are; a task's is its
    # cost plus the largest of its events' (0 without any: an event with no successors adds 0)
    triggers_of: dict[int, list[int]] = {t.id: [] for t in tg.tasks}
    wait_of: dict[int, list] = {t.id: [] for t in tg.tasks}
    for e in tg.events:
        for p in e.preds:
            triggers_of[p].append(e.id)
        for s in e.succs:
            wait_of[s].append(e)
    left = {e.id: len(e.succs) for e in tg.events}  # successors whose level is not known yet
    ev_level = {e.id: 0.0 for e in tg.events if not e.succs}
    waiting = {t: sum(e not in ev_level for e in es) for t, es in triggers_of.items()}
    cost = {t.id: task_time_us(t.nbytes, t.flops, t.kind) for t in tg.tasks}
    level: dict[int, float] = {}
    ready = deque(t for t, n in waiting.items() if n == 0)
    while ready:
        t = ready.popleft()
        level[t] = cost[t] + max((ev_level[e] for e in triggers_of[t]), default=0.0)
        for e in wait_of[t]:
            left[e.id] -= 1
            if left[e.id] == 0:
                ev_level[e.id] = max(level[s] for s in e.succs) + HOP_US
                for p in e.preds:
                    waiting[p] -= 1
                    if waiting[p] == 0:
                        ready.append(p)
    if len(level) != len(tg.tasks):
        raise VerificationError("task graph has a cycle")
    return level


def linearize(tg: TaskGraph) -> TaskGraph:
    """Orders the tasks of a normalized TaskGraph (Mirage MPK, arXiv 2512.22219, section 4.4):
    first the tasks that wait on nothing, then, event by event in the order they become complete
    (a FIFO of events whose triggers are all placed), each event's successors as one contiguous
    group; inside a group by descending :func:`bottom_levels` (µs), then task id.

    Returns:
        ``tg`` with ``order`` (task ids) set and each event's ``first`` / ``last`` the index range
        of its successors in ``order`` (-1 / -1 for an event without successors).

    Raises:
        VerificationError: a task waits on two events (normalize first), or not every task gets
            placed (a cycle, or an event that no task triggers).
    """
    level = bottom_levels(tg)
    wait_of: dict[int, int] = {}
    for e in tg.events:
        for s in e.succs:
            if s in wait_of:
                raise VerificationError(f"task t{s} waits on two events; normalize first")
            wait_of[s] = e.id
    events = {e.id: e for e in tg.events}
    trig: dict[int, list[int]] = {}
    for e in tg.events:
        for p in e.preds:
            trig.setdefault(p, []).append(e.id)
    remaining = {e.id: len(e.preds) for e in tg.events}
    key = lambda t: (-level[t], t)  # noqa: E731
    order: list[int] = []
    ranges: dict[int, tuple[int, int]] = {}
    queue = deque([None])  # None = the tasks that wait on nothing
    while queue:
        eid = queue.popleft()
        group = sorted((t.id for t in tg.tasks if t.id not in wait_of), key=key) if eid is None \
            else sorted(events[eid].succs, key=key)
        if eid is not None:
            ranges[eid] = (len(order), len(order) + len(group) - 1)
        order.extend(group)
        for t in group:
            for e2 in trig.get(t, ()):
                remaining[e2] -= 1
                if remaining[e2] == 0:
                    queue.append(e2)
    if len(order) != len(tg.tasks):
        raise VerificationError(f"linearization placed {len(order)} of {len(tg.tasks)} tasks: the graph has a cycle "
                                f"or an event that can never trigger")
    new_events = tuple(dataclasses.replace(e, first=ranges.get(e.id, (-1, -1))[0], last=ranges.get(e.id, (-1, -1))[1])
                       for e in tg.events)
    return dataclasses.replace(tg, events=new_events, order=tuple(order))
