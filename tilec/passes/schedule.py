"""Scheduling: assign the linearized tasks to W worker queues.

Requires: a linearized TaskGraph.
Guarantees: every queue lists its tasks in increasing linearized index, so all queues
respect one global topological order; with all workers co-resident this makes execution
deadlock-free (the lowest unfinished task can always run).

``round_robin``: task i goes to worker i mod W (the seed's baseline).
``list`` (default): tasks in linearized order (critical path first inside each group) go
to the worker where they can start earliest under the cost model (``tilec.cost``); ties go
to the worker with fewer bytes assigned, balancing weight streaming across workers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost import HOP_US, task_time_us
from ..taskgraph import TaskGraph


@dataclass(frozen=True)
class Schedule:
    """``queues[w]`` lists task ids in execution order; ``makespan_us`` is the predicted step time."""

    queues: tuple[tuple[int, ...], ...]
    makespan_us: float
    policy: str


def schedule(tg: TaskGraph, workers: int, policy: str = "list") -> Schedule:
    """Assigns the tasks of a linearized TaskGraph, in ``tg.order``, to ``workers`` queues while
    simulating the cost model (``tilec.cost``): a task starts when its worker is free and its
    wait event's last trigger plus ``HOP_US`` (0.76 µs) has passed, and runs
    :func:`tilec.cost.task_time_us`.

    ``policy``: ``"round_robin"`` (task i to worker i mod W), else greedy list scheduling (what
    ``Options.scheduler`` calls ``"list"``): the worker where the task starts earliest, ties to the
    fewest bytes assigned, then the lowest index. ``workers`` must be >= 1 (``Options`` checks it).

    Returns:
        A :class:`Schedule`: per worker the task ids in execution order, the predicted makespan
        (µs) and ``policy``. A TaskGraph without ``order`` (not linearized) gives empty queues.

    Raises:
        KeyError: ``order`` places a task before one of its predecessors.
    """
    by_id = {t.id: t for t in tg.tasks}
    wait_of = {s: e for e in tg.events for s in e.succs}
    finish: dict[int, float] = {}
    event_ready: dict[int, float] = {}
    free = [0.0] * workers
    load = [0] * workers
    queues: list[list[int]] = [[] for _ in range(workers)]
    for i, tid in enumerate(tg.order):
        t = by_id[tid]
        e = wait_of.get(tid)
        ready = 0.0
        if e is not None:
            if e.id not in event_ready:
                event_ready[e.id] = max(finish[p] for p in e.preds) + HOP_US
            ready = event_ready[e.id]
        if policy == "round_robin":
            w = i % workers
        else:
            w = min(range(workers), key=lambda w: (max(free[w], ready), load[w], w))
        start = max(free[w], ready)
        finish[tid] = start + task_time_us(t.nbytes, t.flops, t.kind)
        free[w] = finish[tid]
        load[w] += t.nbytes
        queues[w].append(tid)
    return Schedule(tuple(tuple(q) for q in queues), max(free, default=0.0), policy)
