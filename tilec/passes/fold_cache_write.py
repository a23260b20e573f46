"""Fold KV-cache writes into the RoPE ops that produce them.

A Llama decode layer's critical path runs k-projection -> rope -> cache_write -> attention,
and every op boundary is a dependent stage across the GPU (~5 us each measured on an H200).
``rope`` handles any output layout (``op_rope`` in ``runtime/tilec/ops.cuh``, ``Rope.run_tile``
through views), so it can write its rows straight into the cache slot:

    R = rope(x, cos, sin) -> T          (T a TEMP buffer)
    C = cache_write(T) -> S             (S the cache-slot view, moving with the position)
  becomes
    R = rope(x, cos, sin) -> S

keeping R's name and provenance; C and buffer T are dropped. The rewrite applies when

(a) T is R's only output, C's only input (the same view: buffer, shape, strides, offset,
    pos_stride), written by R alone, read by C alone, and is not a graph output;
(b) R's output shape equals S's shape (C is a whole copy, tile for tile);
(c) no op strictly between R and C reads or writes S's buffer, and R does not read it (the
    cache slot is written earlier, so nothing may observe or overwrite it in between);
(d) T and S have the same dtype: rope rounds its result to T's dtype, so C is an exact copy.

Results are bitwise those of the unfolded plan when ``split_k`` is 1: the same values reach the
same cache slot. (Split-K partial sums are added in the order the schedule runs them, and the
plan without the cache_write may be scheduled differently.)
A graph with nothing to fold (or ``opts.fold_cache_writes`` off) is returned unchanged (the
same object).
"""
from __future__ import annotations

import dataclasses
import functools

from ..ir import BufferKind, Op, OpGraph
from ._fold import dtype_of, rebuilt, touching


def fold_cache_writes(graph: OpGraph, opts=None) -> OpGraph:
    """Folds each ``rope -> cache_write`` pair of ``graph`` into one ``rope`` writing the slot.

    The rope writes rows ``[..., D]`` into a TEMP buffer that the cache_write copies, whole, into
    a cache-slot view of the same shape; a pair folds only under conditions (a)-(d) of the module
    docstring and is otherwise kept as it is.

    Returns:
        A new OpGraph in which the rope writes the slot view and the cache_write and the TEMP
        buffer are gone; or ``graph`` itself when nothing folds or ``opts.fold_cache_writes``
        is off.

    Raises:
        Nothing of its own: a pair that does not qualify is left unfolded.
    """
    if opts is not None and not getattr(opts, "fold_cache_writes", True):
        return graph
    ops: list[Op | None] = list(graph.ops)
    outputs = {v.buffer for v in graph.outputs}
    dtype = functools.partial(dtype_of, graph)

    dropped: set[str] = set()
    for i, rope in enumerate(ops):
        if rope is None or rope.kind != "rope" or len(rope.outputs) != 1:
            continue
        (temp,) = rope.outputs
        if graph.buffers[temp.buffer].kind is not BufferKind.TEMP or temp.buffer in outputs:
            continue
        readers = touching(ops, temp.buffer, "inputs")
        if len(readers) != 1 or readers[0] <= i or touching(ops, temp.buffer, "outputs") != [i]:
            continue
        j = readers[0]
        write = ops[j]
        if write.kind != "cache_write" or write.inputs != (temp,) or len(write.outputs) != 1:
            continue
        (slot,) = write.outputs
        if slot.shape != temp.shape or dtype(slot) != dtype(temp):
            continue
        if any(v.buffer == slot.buffer for v in rope.inputs):
            continue
        if any(ops[k] is not None and any(v.buffer == slot.buffer for v in ops[k].inputs + ops[k].outputs)
               for k in range(i + 1, j)):
            continue
        ops[i] = dataclasses.replace(rope, outputs=(slot,))
        ops[j] = None
        dropped.add(temp.buffer)
    return rebuilt(graph, ops, dropped)
