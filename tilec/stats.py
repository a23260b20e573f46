"""Compile statistics: sizes before/after each pass and the cost model's predictions."""
from __future__ import annotations

from .ir import OpGraph
from .passes.linearize import bottom_levels
from .passes.schedule import Schedule
from .taskgraph import TaskGraph


def compile_stats(graph: OpGraph, tg: TaskGraph, sched: Schedule) -> dict:
    """Counts and predictions (times in us).

    Keys: ops, tasks, empty_tasks_added, events_before_fusion, deps_before_fusion,
    forks_coarsened, events_after_fusion, deps_after_fusion, events, deps_encoded, queue_len_max,
    queue_len_mean, critical_path_us, predicted_step_us, scheduler.
    """
    lens = [len(q) for q in sched.queues]
    levels = bottom_levels(tg)
    return {
        "ops": len(graph.ops),
        "tasks": len(tg.tasks),
        "empty_tasks_added": tg.stats.get("empty_tasks_added", 0),
        "events_before_fusion": tg.stats.get("events_before_fusion", 0),
        "deps_before_fusion": tg.stats.get("deps_before_fusion", 0),
        "forks_coarsened": tg.stats.get("forks_coarsened", 0),
        "events_after_fusion": tg.stats.get("events_after_fusion", 0),
        "deps_after_fusion": tg.stats.get("deps_after_fusion", 0),
        "events": len(tg.events),
        "deps_encoded": len(tg.tasks) * 2,  # one wait and one signal field per instruction
        "queue_len_max": max(lens, default=0),
        "queue_len_mean": round(sum(lens) / max(len(lens), 1), 2),
        "critical_path_us": round(max(levels.values(), default=0.0), 2),
        "predicted_step_us": round(sched.makespan_us, 2),
        "scheduler": sched.policy,
    }


def render_stats(stats: dict) -> str:
    """``stats`` (e.g. :func:`compile_stats`'s dict) as text: one ``key  value`` line per entry,
    in dict order, the keys padded to the longest ("" for an empty dict)."""
    width = max((len(k) for k in stats), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in stats.items())
