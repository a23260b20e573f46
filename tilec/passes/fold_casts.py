"""Fold a dtype cast into the float32 op whose output it reads (cast on store).

Models that compute a norm or RoPE in float32 and cast the result back (Gemma's RMSNorm
``(...).type_as(x)``, Cohere's LayerNorm and RoPE, ERNIE-4.5's RoPE) lower to an op writing a
float32 TEMP buffer and a ``unary`` cast reading it: one more dependent stage across the GPU, and
a float32 round trip through memory. Every op kind in :data:`FOLDABLE` computes its result in
float32 and rounds it to its output's dtype only when it stores it (``stf<TO>`` in
``runtime/tilec/ops.cuh``; the reference executor copies float32 values into the output), and
storing a float32 value as float32 is exact, so

    P = op(...) -> T            (T a float32 TEMP buffer)
    U = unary cast(T) -> O
  becomes
    P = op(...) -> O

keeping P's name and provenance; U and T are dropped. Results are bitwise those of the unfolded
plan: the same float32 value is rounded once, to O's dtype. The rewrite applies when

(a) T is float32, P's only output and written whole by P alone (its output view is T's whole
    view), read by U alone through that same view, and is neither a graph output nor a state;
(b) U is a ``cast`` to a float dtype (an integer result would take the exact integer copy, not a
    rounding through float32) whose output view has T's shape, and O is a TEMP or OUTPUT buffer U alone writes;
(c) P's kind is in :data:`FOLDABLE` (its device code uses the output type only to store), and not an
    RMSNorm of bf16 x and weight folded to bf16 (whose all-bf16 device paths sum in another order).

A graph with nothing to fold (or ``opts.fold_casts`` off) is returned unchanged (the same object).
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir import BufferKind, Op, OpGraph, View
from ._fold import rebuilt, touching

# op kinds whose device code reads the output dtype only in the final store - but for op_rmsnorm,
# whose all-bf16 instance takes other paths (rmsnorm_rows_bf16, or a GEMV prologue once fuse_gemv
# sees bf16 rows) that sum the squares in another order: an rmsnorm of bf16 x and weight is left
# unfolded (_changes_path)
FOLDABLE = frozenset({"rmsnorm", "layernorm", "rope", "softmax", "unary", "binary", "copy"})


def _changes_path(graph: OpGraph, op: Op, dtype) -> bool:
    """Whether writing ``dtype`` would send ``op`` down another device path than writing float32."""
    return op.kind == "rmsnorm" and dtype == torch.bfloat16 and \
        all(graph.buffers[v.buffer].dtype == torch.bfloat16 for v in op.inputs)


def fold_casts(graph: OpGraph, opts=None) -> OpGraph:
    """Folds each float32 op -> ``cast`` pair of ``graph`` into the op writing the cast's output.

    Returns:
        A new OpGraph without the folded casts and their float32 TEMP buffers (the conditions in
        the module docstring); or ``graph`` itself when nothing folds or ``opts.fold_casts`` is off.

    Raises:
        Nothing of its own: a pair that does not qualify is left as it is.
    """
    if opts is not None and not getattr(opts, "fold_casts", True):
        return graph
    ops: list[Op | None] = list(graph.ops)
    outputs = {v.buffer for v in graph.outputs}
    dropped: set[str] = set()
    for i, op in enumerate(ops):
        if op is None or op.kind not in FOLDABLE or len(op.outputs) != 1:
            continue
        (temp,) = op.outputs
        buf = graph.buffers[temp.buffer]
        if buf.kind is not BufferKind.TEMP or buf.dtype != torch.float32 or temp.buffer in outputs \
                or temp != View.whole(buf) or touching(ops, temp.buffer, "outputs") != [i]:
            continue
        readers = touching(ops, temp.buffer, "inputs")
        if len(readers) != 1 or readers[0] <= i:
            continue
        cast = ops[readers[0]]
        if cast.kind != "unary" or cast.attr("fn") != "cast" or cast.inputs != (temp,) or len(cast.outputs) != 1:
            continue
        (out,) = cast.outputs
        if out.shape != temp.shape or graph.buffers[out.buffer].kind not in (BufferKind.TEMP, BufferKind.OUTPUT) \
                or not graph.buffers[out.buffer].dtype.is_floating_point \
                or _changes_path(graph, op, graph.buffers[out.buffer].dtype) \
                or touching(ops, out.buffer, "outputs") != [readers[0]]:
            continue
        ops[i] = dataclasses.replace(op, outputs=(out,))
        ops[readers[0]] = None
        dropped.add(temp.buffer)
    return rebuilt(graph, ops, dropped)
