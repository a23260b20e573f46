"""What the fold passes (``fold_cache_writes``, ``fold_rope``, ``fold_kv_append``) share: a view's dtype,
finding the ops that touch a buffer in a list being rewritten, and rebuilding the graph without the
folded ops and buffers."""
from __future__ import annotations

import dataclasses

from ..ir import Op, OpGraph


def dtype_of(graph: OpGraph, view):
    """The dtype of the buffer ``view`` reads."""
    return graph.buffers[view.buffer].dtype


def touching(ops: list[Op | None], buf: str, views: str) -> list[int]:
    """Indices of the ops still in ``ops`` (None: folded away) whose ``views`` (``"inputs"`` or
    ``"outputs"``) name buffer ``buf``."""
    return [i for i, o in enumerate(ops) if o is not None and any(v.buffer == buf for v in getattr(o, views))]


def rebuilt(graph: OpGraph, ops: list[Op | None], dropped: set[str]) -> OpGraph:
    """``graph`` with ``ops`` (the None entries left out) and without the ``dropped`` buffers; the
    same object when no op and no buffer changed."""
    if not dropped and all(a is b for a, b in zip(ops, graph.ops)):
        return graph
    buffers = {n: b for n, b in graph.buffers.items() if n not in dropped}
    return dataclasses.replace(graph, ops=tuple(o for o in ops if o is not None), buffers=buffers)
