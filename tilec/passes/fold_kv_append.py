"""Fold the step's KV-cache append (the keys' RoPE and both cache writes) into the split-KV
attention that reads the cache.

After ``fold_cache_writes`` and ``fold_rope`` (both needed: without the first the key RoPE writes a
temporary that a cache_write copies) a Llama decode layer runs

    RK = rope(kx, cos_k, sin_k) -> K[:, :, p:p+Sq]      (the key slot, moving with the position)
    CV = cache_write(vx) -> V[:, :, p:p+Sq]
    P  = attention_partial(qx, K, V, cos, sin; rope) -> o_part, ml

and every partial tile waits for RK and CV: one more dependent stage (~1.5 us a layer on an H200,
trace of 2026-12-02) for a few hundred bytes. Only the tile whose split of cache positions holds
rows p .. p + Sq - 1 reads them, so that tile can write them itself as it reads its split (on the
device straight into its staged rows too, runtime/tilec/ops_attention.cuh):

    P = attention_partial(qx, K, V, cos, sin, kx, vx; rope, append) -> o_part, ml, K[p:], V[p:]

keeping P's name and provenance; RK and CV are dropped (no buffer is: the slots are the cache's).
Which tile writes the slots depends on p, so every tile declares them as
:data:`~tilec.ops.DYNAMIC` writes (no events among the op's own tiles). The rewrite applies when

(a) P is causal, its queries' RoPE is folded (rotate-half, attr ``rope`` 0), it reads the whole
    cache (K and V views that do not move with the position), and has no ``append`` yet;
(b) RK is the only op writing K's buffer and CV the only one writing V's; P is the only reader of
    both, and comes after RK and CV; RK is a rotate-half rope with one output, CV has one input;
(c) each slot is its cache view at rows p .. p + Sq - 1: the view's strides and offset, Sq rows,
    and a position stride of one cache row (so row i of the slot is cache row valid - 1 + i), and
    the attention's view holds every row a planned position writes (max_positions - 1 + Sq rows:
    a view of a prefix of a longer cache would leave the rows past it unwritten);
(d) kx has the key slot's shape, vx the value slot's; kx, cos_k, sin_k, the queries and K one
    dtype, vx V's (RK's roundings and CV's copy are then exact on the device);
(e) cos_k / sin_k are P's cos / sin rows for the KV heads: the same buffer, offset, position
    stride and strides, with a head stride of 0 (the frontend broadcasts them to the heads);
(f) no op between RK and P writes kx's, cos_k's or sin_k's buffer, none between CV and P vx's
    (P now reads them later).

Results are bitwise those of the unfolded plan (``Rope.run_tile`` / ``op_rope`` arithmetic on the
same values, written to the same slots). A graph with nothing to fold (or ``opts.fold_kv_append``
off) is returned unchanged (the same object).
"""
from __future__ import annotations

import dataclasses
import functools

from ..ir import Op, OpGraph, View
from ..ops.attention_split import slot_at_position
from ._fold import dtype_of, rebuilt, touching


def _is_slot(slot: View, cache: View, positions: int) -> bool:
    """Whether ``slot`` is ``cache`` [B, H, S, D] at rows p .. p + Sq - 1 of the decode position p,
    for every p < ``positions``."""
    return (slot_at_position(slot, cache) and cache.pos_stride == 0
            and slot.shape[:2] + slot.shape[3:] == cache.shape[:2] + cache.shape[3:]
            and positions - 1 + slot.shape[2] <= cache.shape[2])


def _head_broadcast(ck: View, cq: View) -> bool:
    """Whether ``ck`` (the keys' cos or sin) reads ``cq``'s rows (the queries'), broadcast over heads."""
    others = (0, 2, 3)
    return (ck.buffer == cq.buffer and ck.offset == cq.offset and ck.pos_stride == cq.pos_stride
            and ck.strides[1] == cq.strides[1] == 0 and all(ck.strides[i] == cq.strides[i] for i in others)
            and all(ck.shape[i] == cq.shape[i] for i in others))


def fold_kv_append(graph: OpGraph, opts=None) -> OpGraph:
    """Folds each layer's key RoPE + cache writes into the split-KV ``attention_partial`` reading them.

    Returns:
        A new OpGraph in which each qualifying partial also reads the unrotated new key rows and
        the new value rows and writes the cache slots (attr ``append``), and the rope and
        cache_write ops are gone; or ``graph`` itself when nothing folds or
        ``opts.fold_kv_append`` is off.

    Raises:
        Nothing of its own: a partial that does not qualify (module docstring, (a)-(f)) is kept.
    """
    if opts is not None and not getattr(opts, "fold_kv_append", True):
        return graph
    ops: list[Op | None] = list(graph.ops)
    dtype = functools.partial(dtype_of, graph)

    for j, part in enumerate(ops):
        if (part is None or part.kind != "attention_partial" or part.attr("rope") != 0 or not part.attr("causal")
                or part.attr("append") or len(part.inputs) != 5):
            continue
        q, k, v, cos, sin = part.inputs
        writers = []
        for cache in (k, v):
            w = touching(ops, cache.buffer, "outputs")
            ok = len(w) == 1 and w[0] < j and touching(ops, cache.buffer, "inputs") == [j]
            writers.append(w[0] if ok else None)
        if None in writers:
            continue
        rk, cv = (ops[i] for i in writers)
        if rk.kind != "rope" or rk.attr("style") != 0 or len(rk.inputs) != 3 or len(rk.outputs) != 1:
            continue
        if cv.kind != "cache_write" or len(cv.inputs) != 1 or len(cv.outputs) != 1:
            continue
        (kx, cos_k, sin_k), (k_slot,), (vx,), (v_slot,) = rk.inputs, rk.outputs, cv.inputs, cv.outputs
        slots_ok = _is_slot(k_slot, k, graph.max_positions) and _is_slot(v_slot, v, graph.max_positions)
        if not (slots_ok and k_slot.shape[2] == v_slot.shape[2] == q.shape[2]):
            continue
        if kx.shape != k_slot.shape or vx.shape != v_slot.shape:
            continue
        if len({dtype(kx), dtype(cos_k), dtype(sin_k), dtype(q), dtype(k)}) != 1 or dtype(vx) != dtype(v):
            continue
        if not (_head_broadcast(cos_k, cos) and _head_broadcast(sin_k, sin)):
            continue
        moved = ((writers[0], {kx.buffer, cos_k.buffer, sin_k.buffer}), (writers[1], {vx.buffer}))
        if any(ops[i] is not None and any(o.buffer in read for o in ops[i].outputs)
               for w, read in moved for i in range(w + 1, j)):
            continue
        attrs = tuple(sorted(part.attrs + (("append", True),)))
        outputs = (*part.outputs[:2], k_slot, v_slot, *part.outputs[2:])  # before a folded combine's out
        ops[j] = dataclasses.replace(part, inputs=(*part.inputs, kx, vx), outputs=outputs, attrs=attrs)
        for i in writers:
            ops[i] = None
    return rebuilt(graph, ops, set())
