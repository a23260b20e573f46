"""Fold the queries' RoPE into the split-KV attention tiles that read them.

A Llama decode layer's critical path runs q-projection -> rope -> attention_partial, and the
RoPE tiles (one head each, a few hundred bytes) cost a dependent stage: ~2.1 us per tile plus
an event hop on an H200 (trace of 2026-12-02), for work the attention tile can do while it
loads its queries. So

    R = rope(x, cos, sin) -> T                      (T a TEMP buffer, the queries)
    P = attention_partial(T, k, v) -> o_part, ml
  becomes
    P = attention_partial(x, k, v, cos, sin; rope=style) -> o_part, ml

keeping P's name and provenance; R and buffer T are dropped. The rewrite applies when

(a) T is R's only output, written by R alone, read by P alone (as its queries only, the same view),
    and is not a graph output; R comes before P;
(b) R is a rotate-half RoPE (style 0, HF ``apply_rotary_pos_emb``); x, cos and sin have T's
    shape (the frontend's cos / sin views are broadcast to the rows with zero strides) and
    x, cos, sin and T one dtype (the device tile rounds the rotated queries to it, as R's store
    did; ``AttentionPartial.device_dtypes``);
(c) no op between R and P writes x's, cos's or sin's buffer (P now reads them later).

Results are bitwise those of the unfolded plan: the tile computes each rotated query element
exactly as ``op_rope`` / ``Rope.run_tile`` do (``tilec.ops.rope.rope_rows``), rounds it to T's
dtype, then scales it. The keys' RoPE stays an op here (``fold_cache_writes`` lets it write the
cache slot; ``fold_kv_append`` then moves it into the same tiles). A graph with nothing to fold
(or ``opts.fold_rope`` off) is returned unchanged (the same object).
"""
from __future__ import annotations

import dataclasses
import functools

from ..ir import BufferKind, Op, OpGraph
from ._fold import dtype_of, rebuilt, touching


def fold_rope(graph: OpGraph, opts=None) -> OpGraph:
    """Folds each ``rope -> attention_partial`` query pair of ``graph`` into the partial.

    Returns:
        A new OpGraph in which each qualifying partial reads the unrotated queries, cos and sin
        (attr ``rope``: the RoPE style) and the rope op and its TEMP buffer are gone; or
        ``graph`` itself when nothing folds or ``opts.fold_rope`` is off.

    Raises:
        Nothing of its own: a pair that does not qualify (module docstring, (a)-(c)) is kept.
    """
    if opts is not None and not getattr(opts, "fold_rope", True):
        return graph
    ops: list[Op | None] = list(graph.ops)
    outputs = {v.buffer for v in graph.outputs}
    dtype = functools.partial(dtype_of, graph)

    dropped: set[str] = set()
    for j, part in enumerate(ops):
        if part is None or part.kind != "attention_partial" or part.attr("rope") is not None or len(part.inputs) != 3:
            continue
        q = part.inputs[0]
        if graph.buffers[q.buffer].kind is not BufferKind.TEMP or q.buffer in outputs:
            continue
        writers = touching(ops, q.buffer, "outputs")
        if len(writers) != 1 or writers[0] >= j or touching(ops, q.buffer, "inputs") != [j]:
            continue
        if any(v.buffer == q.buffer for v in part.inputs[1:]):  # T also P's keys or values
            continue
        i = writers[0]
        rope = ops[i]
        if rope.kind != "rope" or rope.outputs != (q,) or len(rope.inputs) != 3:
            continue
        x, cos, sin = rope.inputs
        if rope.attr("style") != 0 or any(t.shape != q.shape for t in (x, cos, sin)):
            continue
        if len({dtype(x), dtype(cos), dtype(sin), dtype(q)}) != 1:
            continue
        read = {x.buffer, cos.buffer, sin.buffer}
        if any(ops[k] is not None and any(v.buffer in read for v in ops[k].outputs) for k in range(i + 1, j)):
            continue
        attrs = tuple(sorted(part.attrs + (("rope", 0),)))
        ops[j] = dataclasses.replace(part, inputs=(x, *part.inputs[1:], cos, sin), attrs=attrs)
        ops[i] = None
        dropped.add(q.buffer)
    return rebuilt(graph, ops, dropped)
