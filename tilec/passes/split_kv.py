"""Split-KV attention: OpGraph -> OpGraph rewrite of decode attention into flash-decoding form
(Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference").

One ``attention`` op tiles by (batch, KV head) only, so a decode step with few KV heads runs
its attention on a handful of workers. This pass replaces every ``attention`` op whose cache
yields at least 2 splits by

    <name>_partial = attention_partial(q, k, v) -> <name>_opart, <name>_ml
    <name>_combine = attention_combine(<name>_opart, <name>_ml) -> the original output view

with two new float32 TEMP buffers (``tilec.ops.attention_split`` has the shapes and the math),
so the splits of all (batch, KV head) pairs spread over about all workers. Ops with fewer
than 2 splits are kept; a graph without such ops is returned unchanged (the same object).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import VerificationError
from ..ir import Buffer, BufferKind, Op, OpGraph, View
from ..ops.attention_split import num_splits

# At most 288 positions per split: a split is one tile, and the partial kernel keeps 128 positions in
# flight per round trip, so longer splits serialize round trips (Llama-3.2-1B at batch 16: 128
# (batch, KV head) pairs, one unsplit 1024-position tile each, took 424 us per tile on an H200).
CHUNK_ALIGN, CHUNK_MIN, CHUNK_MAX = 32, 64, 288


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def kv_chunk(batch: int, kv_heads: int, s: int, opts, pos_bytes: int = 256) -> int:
    """Cache positions per split of an attention op over ``s`` cached positions.

    ``opts.attn_kv_chunk`` when set; otherwise (auto) the split length, a multiple of 32 in [64, 288]
    (``CHUNK_MIN``, ``CHUNK_MAX``; each length evened out over its splits), whose partials take the
    least time by the cost model: rounds of partial tiles over the workers (``batch * KV head groups *
    splits / workers``, rounded up) times one tile's ``tilec.cost.MEASURED["attention_partial"]`` time
    (``fixed µs + bytes / rate``, ``pos_bytes`` bytes of K / V rows a position and head); ties go to the
    longer split (fewer tiles, less to combine). So other ``MEASURED`` figures (``cost.measured_overrides``)
    can change the split, not only the schedule. With few groups that is the shortest split that keeps the
    partials in one round (Llama-3.2-1B batch 1 at context 1024: 96 positions, 12 splits, 96 tiles);
    with many, long splits.

    Measured against the earlier rule (``ceil(s / (workers // groups))`` capped at 256: one round
    unless the cap bound): a cache of 1024 + 64 positions at batch 4 (32 pairs) took 5 splits of 256,
    160 tiles on 132 workers, where 28 workers ran two; 4 splits of 288 made one round. H100,
    forty-third session, ``benchmarks/lab/options_ab.py``, Llama-3.2-1B context 1024, one process:
    batch 4 2.083 against 2.206 ms a step, batch 16 3.438 against 3.569.
    """
    if opts.attn_kv_chunk is not None:
        return int(opts.attn_kv_chunk)
    from ..cost import MEASURED

    if s <= CHUNK_MIN:
        return CHUNK_MIN
    fixed, rate = MEASURED.get("attention_partial", (13.08, 21.5e3))
    per_pos = min(opts.attn_heads_per_tile, kv_heads) * pos_bytes / rate if rate else 0.0  # µs (rate 0: none)
    groups = batch * _ceil_div(kv_heads, opts.attn_heads_per_tile)
    best = None
    for splits in range(_ceil_div(s, CHUNK_MAX), _ceil_div(s, CHUNK_MIN) + 1):
        chunk = max(CHUNK_MIN, _ceil_div(_ceil_div(s, splits), CHUNK_ALIGN) * CHUNK_ALIGN)
        rounds = _ceil_div(groups * _ceil_div(s, chunk), max(opts.workers, 1))
        t = rounds * (fixed + per_pos * chunk)
        if best is None or t < best[0] - 1e-9:
            best = (t, chunk)
    return best[1]


def split_kv(graph: OpGraph, opts) -> OpGraph:
    """Rewrites each ``attention`` op of ``graph`` with >= 2 splits into partial + combine.

    Raises:
        VerificationError: a new buffer or op name collides with an existing one (a bug).
    """
    ops: list[Op] = []
    buffers = dict(graph.buffers)
    names = {op.name for op in graph.ops}
    changed = False
    for op in graph.ops:
        if op.kind != "attention":
            ops.append(op)
            continue
        q, k, v = op.inputs
        (out,) = op.outputs
        b_, hq, sq, _ = q.shape
        hkv, s = k.shape[1], k.shape[2]
        dv = v.shape[3]
        chunk = kv_chunk(b_, hkv, s, opts, (k.shape[3] + dv) * graph.buffers[k.buffer].dtype.itemsize)
        ns = num_splits(s, chunk)
        if ns < 2:
            ops.append(op)
            continue
        changed = True
        o_part = Buffer(f"{op.name}_opart", (b_, hq * sq, ns, dv), torch.float32, BufferKind.TEMP)
        ml = Buffer(f"{op.name}_ml", (b_, hq * sq, ns, 2), torch.float32, BufferKind.TEMP)
        new_ops = (f"{op.name}_partial", f"{op.name}_combine")
        for name in (o_part.name, ml.name):
            if name in buffers:
                raise VerificationError(f"split_kv: buffer {name} already exists")
        for name in new_ops:
            if name in names:
                raise VerificationError(f"split_kv: op {name} already exists")
        buffers[o_part.name] = o_part
        buffers[ml.name] = ml
        names.update(new_ops)
        ov, mv = View.whole(o_part), View.whole(ml)
        ops.append(Op(new_ops[0], "attention_partial", op.inputs, (ov, mv),
                      tuple(sorted((("scale", op.attr("scale")), ("causal", op.attr("causal")), ("chunk", chunk)))),
                      op.provenance))
        ops.append(Op(new_ops[1], "attention_combine", (ov, mv), (out,), (("kv_heads", hkv),), op.provenance))
    if not changed:
        return graph
    return replace(graph, ops=tuple(ops), buffers=buffers)


__all__ = ["CHUNK_MAX", "CHUNK_MIN", "kv_chunk", "split_kv"]
