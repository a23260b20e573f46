"""Split-KV decode attention: flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding
for long-context inference"), as two ops that replace one ``attention`` op (``tilec.passes.split_kv``).

The S cache positions of every (batch, KV head) are cut into ``NS = ceil(S / chunk)`` splits.
``attention_partial`` computes, for every query of the head group and every split ``s``
(positions ``J_s = [s * chunk, min(S, (s + 1) * chunk))``, of which query ``i`` sees those
``< L_i``; see :mod:`tilec.ops.attention`)::

    m_s = max_{j in J_s, j < L_i} score_j          score_j = q . K[j] * scale
    p_j = exp(score_j - m_s)                       (0 for an unseen position)
    o_s = sum_j round_V(p_j) V[j]                  (unnormalized; p rounded to V's dtype, as
    l_s = sum_j p_j                                 the single-pass op rounds exp(s - max))

and ``attention_combine`` merges the splits of each query::

    M = max_s m_s,  out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s

A split that no query position sees stores ``m = -inf, l = 0, o = 0`` and weighs nothing.

The partial results live in two float32 intermediates whose second dim merges the query
heads and query tokens (the descriptor holds at most 4 dims; row ``r = hq * Sq + i``):
``o_part [B, Hq * Sq, NS, Dv]`` and ``ml [B, Hq * Sq, NS, 2]`` (``m`` then ``l``).

``attention_partial``: operands q [B, Hq, Sq, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv],
o_part, ml, valid (scalar: ``p + 1`` when causal, else S), and with attr ``rope`` (0: a
rotate-half RoPE, ``tilec.ops.rope``; set by ``tilec.passes.fold_rope``) cos and sin of q's
shape and dtype: the tile applies the RoPE to its queries as it loads them (``rope_rows``,
rounded to q's dtype as the rope op's store was). With attr ``append`` (set by
``tilec.passes.fold_kv_append``; causal, after the RoPE fold) four more: the step's new key
rows k_new [B, Hkv, Sq, D] (before their RoPE, q's dtype), value rows v_new [B, Hkv, Sq, Dv]
(v's dtype), and the cache slots they go to, k_slot and v_slot (k / v at rows p .. p + Sq - 1,
moving with the position). The tile whose split holds some of those rows writes them - the
keys rotated with the cos / sin rows of the queries (head stride 0), rounded to k's dtype - into
the slots and uses them for its split: on the device, when it stages its rows in shared memory,
it writes them there as it stages the others (their loads in the queries' round trip), and
otherwise into the slots first, then reads its split from the cache as usual (the reference
writes the slots first); no other tile reads them.
With attr ``combine`` (set by ``tilec.passes.fold_combine``) one more output, the combine's out
[B, Hq, Sq, Dv] (q's dtype), last among the operands: after storing its split, a tile adds one to
its (batch, first KV head) arrival counter, and the tile that arrives last of the group's NS
runs ``attention_combine`` over the group's query heads (the others' partials are complete
then). Params: scale bits, causal, chunk, RoPE style + 1 (0: none), append (0 / 1), and the
index of the op's first arrival counter (set by the plan; -1 without ``combine``). Tiles:
(batch, ``attn_heads_per_tile`` KV heads, one split).

``attention_combine``: operands o_part, ml, out [B, Hq, Sq, Dv] (the original attention
output view and dtype). Tiles: (batch, the query heads of ``attn_heads_per_tile`` KV heads).
"""
from __future__ import annotations

import torch

from ..errors import TilecError
from ..ir import ScalarOperand
from . import DYNAMIC, OpDef, Tile, TileArgs, bits_f32, chunks, f32_bits, register
from .rope import rope_rows

# device constants of runtime/tilec/ops_attention.cuh (shared-memory sizing)
ATTN_Q = 4  # queries (G * Sq) per pass over a split
ATTN_SEG_MAX = 2048  # cache positions per shared-memory score segment
ATTN_STAGE_POS = 128  # cache positions of K and V rows the plan reserves for the tile to stage
WARPS = 8
COMBINE_STAGE_MAX = 48 * 1024  # bytes of float32 partials a combine tile reserves room to stage


def slot_at_position(slot, cache) -> bool:
    """Whether view ``slot`` is view ``cache`` [B, H, S, D] at rows p .. p + Sq - 1 of the decode
    position p (same buffer, offset and strides, moving one cache row a position): the geometry
    the device relies on when an appending partial writes row i of the slot as cache row
    valid - 1 + i (``attn_append_rows`` and the staged rows of ``attention_partial_impl``)."""
    return ((slot.buffer, slot.offset, slot.strides, slot.pos_stride)
            == (cache.buffer, cache.offset, cache.strides, cache.strides[2]))


def lanes_per_row(d: int) -> int:
    """Lanes of the device's lane group per cache row: the next power of two >= ceil(d / 8)."""
    n, g = -(-d // 8), 1
    while g < n:
        g *= 2
    return g


def num_splits(s: int, chunk: int) -> int:
    """NS, the splits of ``chunk`` positions (> 0) over ``s`` cache positions: ``ceil(s / chunk)``
    (the last split may be shorter)."""
    return -(-s // chunk)


@register
class AttentionPartial(OpDef):
    """``attention_partial``: the per-split pass of flash-decoding (Dao, Haziza, Massa, Sizov 2023),
    made by ``tilec.passes.split_kv``: for each query row and split, the max score m, the exp-sum l
    and the unnormalized P.V o over the split's positions (the module docstring has the math and
    the ``rope`` / ``append`` / ``combine`` folds).

    Operands (:meth:`operands`): q [B, Hq, Sq, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], o_part
    [B, Hq * Sq, NS, Dv] float32, ml [B, Hq * Sq, NS, 2] float32, valid (scalar), then the folds'
    operands. Params: scale bits, causal, chunk, RoPE style + 1, append, first arrival counter
    (-1: no ``combine``). Tiles: one batch x ``attn_heads_per_tile`` KV heads x one split of
    ``chunk`` positions. :meth:`params`, :meth:`smem_bytes` and :meth:`device_dtypes` raise
    TilecError for folds, head dims or operand dtypes the device cannot run.
    """

    kind, opcode = "attention_partial", 15

    arrival_param = 5

    def operands(self, op):
        """q, k, v, o_part, ml, valid, then cos, sin (``rope``), k_new, v_new, k_slot, v_slot (``append``),
        out (``combine``)."""
        s = op.inputs[1].shape[2]
        valid = ScalarOperand(1, 1) if op.attr("causal") else ScalarOperand(s, 0)
        return [*op.inputs[:3], *op.outputs[:2], valid, *op.inputs[3:], *op.outputs[2:]]

    def arrivals(self, op):
        """One arrival counter per (batch, KV head) with ``combine`` (the groups' first heads use theirs)."""
        return op.inputs[1].shape[0] * op.inputs[1].shape[1] if op.attr("combine") else 0

    def arrival(self, op, tile):
        """Counter b * Hkv + h0 of the tile's batch b and first KV head h0; the group's splits arrive."""
        if not op.attr("combine"):
            return None
        (b, _), (h0, _), _ = tile.coords
        return b * op.inputs[1].shape[1] + h0, op.outputs[0].shape[2]

    def device_dtypes(self, op, dtypes):
        """``op_attention_partial<TQ, TK, TV, TP, TM>``: the device reads cos, sin and k_new as q's
        dtype, v_new and the slots as the caches', the combine's out as q's (the fold passes ensure
        it).

        Raises:
            TilecError: cos / sin / k_new / v_new / a slot / out of a dtype the device would misread.
        """
        names = ((("cos", "sin") if op.attr("rope") is not None else ())
                 + (("k_new", "v_new", "k_slot", "v_slot") if op.attr("append") else ())
                 + (("out",) if op.attr("combine") else ()))
        want = {"cos": dtypes[0], "sin": dtypes[0], "k_new": dtypes[0], "v_new": dtypes[2], "k_slot": dtypes[1],
                "v_slot": dtypes[2], "out": dtypes[0]}
        if op.attr("append") and dtypes[0] != dtypes[1]:
            raise TilecError(f"op {op.name}: appended keys need the cache's dtype {dtypes[1]}, queries are {dtypes[0]}")
        for name, got in zip(names, dtypes[5:]):  # dtypes: the tensor operands (not valid)
            if got != want[name]:
                raise TilecError(f"op {op.name}: {name} is {got}, the device reads it as {want[name]}")
        return dtypes[:5]

    def tiles(self, op, opts):
        q, k, v = op.inputs[:3]
        rope = op.inputs[3:5]
        append, combine = op.attr("append"), op.attr("combine")
        out_idx = len(self.operands(op)) - 1
        o_part = op.outputs[0]
        b_, hq, sq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        dv = v.shape[3]
        g = hq // hkv
        chunk = op.attr("chunk")
        tiles = []
        for b in range(b_):
            for h0, h1 in chunks(hkv, opts.attn_heads_per_tile):
                rows = (h0 * g * sq, h1 * g * sq)
                qbox = ((b, b + 1), (h0 * g, h1 * g), (0, sq), (0, d))
                cs = tuple((6 + i, qbox) for i in range(len(rope)))  # cos, sin: q's shape
                new_rows, slots = (), ()
                if append:  # any split may hold the new rows: each reads them and may write the slots
                    kbox = ((b, b + 1), (h0, h1), (0, sq), (0, d))
                    vbox = ((b, b + 1), (h0, h1), (0, sq), (0, dv))
                    new_rows = ((8, kbox), (9, vbox))
                    slots = ((10, kbox, DYNAMIC), (11, vbox, DYNAMIC))
                if combine:  # any split may arrive last and combine the group's query heads
                    slots += ((out_idx, ((b, b + 1), (h0 * g, h1 * g), (0, sq), (0, dv)), DYNAMIC),)
                for sp in range(o_part.shape[2]):
                    j0, j1 = sp * chunk, min(s, (sp + 1) * chunk)
                    tiles.append(Tile(((b, b + 1), (h0, h1), (sp, sp + 1)),
                                      reads=((0, qbox),
                                             (1, ((b, b + 1), (h0, h1), (j0, j1), (0, d))),
                                             (2, ((b, b + 1), (h0, h1), (j0, j1), (0, dv))), *cs, *new_rows),
                                      writes=((3, ((b, b + 1), rows, (sp, sp + 1), (0, dv)), "write"),
                                              (4, ((b, b + 1), rows, (sp, sp + 1), (0, 2)), "write"), *slots)))
        return tiles

    def params(self, op):
        rope = op.attr("rope")
        if rope not in (None, 0):  # the device applies rotate-half only (rope_query)
            raise TilecError(f"op {op.name}: folded RoPE style {rope} is not rotate-half (0)")
        if op.attr("append"):  # tilec.passes.fold_kv_append
            if rope is None or not op.attr("causal"):
                raise TilecError(f"op {op.name}: appending the new KV rows needs a causal attention "
                                 f"with its RoPE folded")
            for cache, slot in zip(op.inputs[1:3], op.outputs[2:]):
                if not slot_at_position(slot, cache):
                    raise TilecError(f"op {op.name}: slot {slot.render()} is not {cache.render()} "
                                     f"at the position's rows")
        return [f32_bits(op.attr("scale")), int(op.attr("causal")), int(op.attr("chunk")),
                0 if rope is None else int(rope) + 1, int(bool(op.attr("append"))), -1]

    def smem_bytes(self, op):
        """runtime/tilec/ops_attention.cuh: ATTN_Q queries (256 floats each, or bf16 rows), 32
        floats of softmax statistics, then one region holding either a segment of scores (ATTN_Q x
        min(chunk, ATTN_SEG_MAX)) or the per-warp P.V partials (WARPS x ATTN_Q x padded Dv).
        For heads with D + Dv <= 256, also room for a segment of min(chunk, ATTN_STAGE_POS)
        positions staged in shared memory (their scores and probabilities, 2-byte K rows and V
        rows, each padded against bank conflicts as ``attn_staged_seg`` counts them; reserved for
        any dtype, the op sees no dtypes): with 2-byte K and V the device stages its rows
        whenever a segment of at least min(chunk, 32) positions fits (segments as long as the
        scratch allows) and reads them from global memory otherwise.

        Raises:
            TilecError: a head dim D or Dv above 256 (one warp's lanes hold at most 256 elements).
        """
        q, _, v = op.inputs[:3]
        d, dv = q.shape[3], v.shape[3]
        if d > 256 or dv > 256:
            raise TilecError(f"op {op.name}: attention head dim {d}/{dv} > 256")
        dvp = 8 * lanes_per_row(dv)
        chunk = op.attr("chunk")
        region = max(ATTN_Q * min(chunk, ATTN_SEG_MAX), WARPS * ATTN_Q * dvp)
        if d + dv <= 256:  # larger heads would take the weight ring's room: staged when it fits
            n = min(chunk, ATTN_STAGE_POS)
            # padded against bank conflicts (attn_staged_seg): per query 39 score floats and 19
            # probability words, per position 16 bytes of a K and of a V row
            region = max(region, ATTN_Q * (39 + 19) + (ATTN_Q + ATTN_Q // 2 + (d + dv + 16) // 2) * n)
        partial = 4 * (ATTN_Q * 256 + 32 + region)
        return max(partial, combine_smem_bytes(op.outputs[0].shape[2], dv)) if op.attr("combine") else partial

    def run_tile(self, t: TileArgs):
        q, k, v, o_part, ml, valid, *rest = t.operands
        combine = t.params[5] >= 0
        if combine:
            *rest, out = rest
        rope = rest[:2] if t.params[3] else []
        append = rest[len(rope):]
        scale, causal, chunk = bits_f32(t.params[0]), t.params[1], t.params[2]
        (b0, b1), (h0, h1), (s0, s1) = t.coords
        g = q.shape[1] // k.shape[1]
        sq, s = q.shape[2], k.shape[2]
        dv = v.shape[3]
        if append:
            _append_rows(t, rope, *append)
        # query i sees positions < limit[i]
        limit = (valid + torch.arange(sq) if causal else torch.full((sq,), s)).view(sq, 1)
        for b in range(b0, b1):
            for h in range(h0, h1):
                qs = q[b, h * g:(h + 1) * g]  # [G, Sq, D]
                if rope:  # the folded RoPE, rounded to q's dtype as the rope op's output was
                    cs = [c[b, h * g:(h + 1) * g] for c in rope]
                    # contiguous, as the rope op's TEMP output was (the matmul below sums in a
                    # layout-dependent order: float32 queries of a strided x differed in the last bit)
                    qs = rope_rows(qs, *cs, t.params[3] - 1).to(q.dtype).contiguous()
                qs = qs.float()
                rows = slice(h * g * sq, (h + 1) * g * sq)
                for sp in range(s0, s1):
                    j0, j1 = sp * chunk, min(s, (sp + 1) * chunk)
                    scores = qs @ k[b, h, j0:j1].float().t() * scale  # [G, Sq, n]
                    scores = scores.masked_fill(torch.arange(j0, j1).view(1, -1) >= limit, float("-inf"))
                    m = scores.amax(-1, keepdim=True)  # -inf where the query sees none of the split
                    e = torch.exp(scores - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
                    o = e.to(v.dtype).float() @ v[b, h, j0:j1].float()  # [G, Sq, Dv]
                    o_part[b, rows, sp].copy_(o.reshape(g * sq, dv))
                    ml[b, rows, sp, 0].copy_(m.reshape(g * sq))
                    ml[b, rows, sp, 1].copy_(e.sum(-1).reshape(g * sq))
        if combine:  # the group's last tile to arrive combines its query heads (device: atom.add.acq_rel)
            hkv = k.shape[1]
            for b in range(b0, b1):
                if t.arrive(t.params[5] + b * hkv + h0, o_part.shape[2]):
                    _combine_rows(o_part, ml, out, b, h0 * g, h1 * g)

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        q, k, v = op.inputs[:3]
        (b0, b1), (h0, h1), (sp, _) = tile.coords
        chunk = op.attr("chunk")
        n = min(k.shape[2], (sp + 1) * chunk) - sp * chunk
        g = q.shape[1] // k.shape[1]
        flops = 2 * (b1 - b0) * (h1 - h0) * g * q.shape[2] * n * (q.shape[3] + v.shape[3])
        if op.attr("combine"):  # one tile of the group combines: its reads, spread over the group's tiles
            nbytes += 4 * (b1 - b0) * (h1 - h0) * g * q.shape[2] * (v.shape[3] + 2)
            flops += 3 * (b1 - b0) * (h1 - h0) * g * q.shape[2] * v.shape[3]
        return nbytes, flops


def combine_smem_bytes(ns: int, dv: int) -> int:
    """Shared memory (bytes) of the combine of ``ns`` float32 splits of Dv values a row
    (``combine_rows``, runtime/tilec/ops_attention.cuh): the split weights of WARPS rows at a
    time, then, when there are at most 32 splits and it takes at most COMBINE_STAGE_MAX bytes,
    room to stage those rows' partials (WARPS x splits x Dv), which the device copies in one round
    trip whenever they fit (and reads from global memory otherwise)."""
    weights = 4 * (-(-WARPS * ns // 4) * 4)
    staged = 4 * WARPS * ns * dv
    return weights + (staged if ns <= 32 and staged <= COMBINE_STAGE_MAX else 0) + 64


def _combine_rows(o_part, ml, out, b: int, h0: int, h1: int) -> None:
    """``attention_combine`` of batch ``b``'s query heads h0 .. h1 - 1 (rows h0 * Sq .. h1 * Sq of
    the partials) into ``out`` [B, Hq, Sq, Dv]."""
    sq, dv = out.shape[2], out.shape[3]
    rows = slice(h0 * sq, h1 * sq)
    m, l = ml[b, rows, :, 0].float(), ml[b, rows, :, 1].float()  # [R, NS]
    big = m.amax(-1, keepdim=True)
    w = torch.exp(m - torch.where(torch.isfinite(big), big, torch.zeros_like(big)))  # 0 for empty splits
    num = (w.unsqueeze(-1) * o_part[b, rows].float()).sum(1)  # [R, Dv]
    den = (w * l).sum(-1, keepdim=True)
    res = torch.where(den > 0, num / den, torch.zeros_like(num))
    out[b, h0:h1].copy_(res.view(h1 - h0, sq, dv))


def _append_rows(t: TileArgs, rope, k_new, v_new, k_slot, v_slot) -> None:
    """What an ``append`` tile does before it reads its splits (``op_attention_partial``, which on
    the device writes them as it stages its rows): the new rows p + i of the
    tile's heads that its splits hold into the cache slots, the keys rotated (``rope_rows``, the
    queries' cos / sin rows, whose head stride is 0) and rounded to the cache's dtype."""
    valid, chunk = t.operands[5], t.params[2]
    (b0, b1), (h0, h1), (s0, s1) = t.coords
    sq, s = k_new.shape[2], t.operands[1].shape[2]
    lo, hi = max(s0 * chunk, valid - 1), min(s1 * chunk, s, valid - 1 + sq)  # cache rows of the tile and the step
    if lo >= hi:
        return
    rows = slice(lo - (valid - 1), hi - (valid - 1))
    heads, bs = slice(h0, h1), slice(b0, b1)
    cos, sin = (c[bs, heads, rows] for c in rope)
    k_slot[bs, heads, rows].copy_(rope_rows(k_new[bs, heads, rows], cos, sin, t.params[3] - 1))
    v_slot[bs, heads, rows].copy_(v_new[bs, heads, rows])


@register
class AttentionCombine(OpDef):
    """``attention_combine``: flash-decoding's merge of the splits (Dao et al. 2023): per query row
    ``out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s`` with ``M = max_s m_s``, in float32
    (0 for a row that no split saw a position of).

    Operands: o_part [B, Hq * Sq, NS, Dv] float32, ml [B, Hq * Sq, NS, 2] float32, out
    [B, Hq, Sq, Dv] (the replaced attention's output view and dtype). Attr ``kv_heads`` (Hkv); no
    params. Tiles: one batch x the query heads of ``attn_heads_per_tile`` KV heads, all NS splits.
    With ``tilec.passes.fold_combine`` the partials' last tile per group runs it instead of this op.
    """

    kind, opcode = "attention_combine", 16

    def tiles(self, op, opts):
        o_part = op.inputs[0]
        (out,) = op.outputs
        b_, hq, sq, dv = out.shape
        g = hq // op.attr("kv_heads")
        ns = o_part.shape[2]
        tiles = []
        for b in range(b_):
            for r0, r1 in chunks(hq, g * opts.attn_heads_per_tile):
                rows = (r0 * sq, r1 * sq)
                tiles.append(Tile(((b, b + 1), (r0, r1)),
                                  reads=((0, ((b, b + 1), rows, (0, ns), (0, dv))),
                                         (1, ((b, b + 1), rows, (0, ns), (0, 2)))),
                                  writes=((2, ((b, b + 1), (r0, r1), (0, sq), (0, dv)), "write"),)))
        return tiles

    def smem_bytes(self, op):
        """:func:`combine_smem_bytes` of the op's splits and Dv."""
        return combine_smem_bytes(op.inputs[0].shape[2], op.inputs[0].shape[3])

    def run_tile(self, t: TileArgs):
        o_part, ml, out = t.operands
        (b0, b1), (r0, r1) = t.coords
        for b in range(b0, b1):
            _combine_rows(o_part, ml, out, b, r0, r1)

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        (b0, b1), (r0, r1) = tile.coords
        o_part = op.inputs[0]
        return nbytes, 3 * (b1 - b0) * (r1 - r0) * op.outputs[0].shape[2] * o_part.shape[2] * o_part.shape[3]
