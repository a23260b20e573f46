"""Decode attention over a static KV cache, with grouped-query heads (GQA, arXiv 2305.13245).

``out[b, h, i] = softmax(q[b, h, i] . K[b, h // G, :L_i]^T * scale) V[b, h // G, :L_i]``
where ``G = Hq / Hkv`` and, for a causal cache, query ``i`` sees ``L_i = valid + i``
positions with ``valid = p + 1`` (a per-call scalar operand); without a mask every one of
the S cache positions is seen. SDPA is kept whole (never decomposed).
Operands: q [B, Hq, Sq, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], out [B, Hq, Sq, Dv],
valid (scalar). Params: scale bits, causal. Tiles: (batch, ``attn_heads_per_tile`` KV heads).
"""
from __future__ import annotations

import torch

from ..ir import ScalarOperand
from . import OpDef, Tile, TileArgs, bits_f32, chunks, f32_bits, register


@register
class DecodeAttention(OpDef):
    """``attention``: single-pass decode SDPA with grouped-query heads (GQA, arXiv 2305.13245) over
    a static KV cache, the formula of the module docstring: float32 scores and softmax, ``exp(s -
    max)`` rounded to v's dtype for P.V and normalized by the sum of the unrounded values.

    Operands: q [B, Hq, Sq, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], out [B, Hq, Sq, Dv], valid
    (scalar: ``p + 1`` when causal, else S). Params: scale (float32 bits), causal. Tiles: one batch
    x ``attn_heads_per_tile`` KV heads with their G = Hq / Hkv query heads, over the whole cache.
    ``tilec.passes.split_kv`` replaces the op by ``attention_partial`` + ``attention_combine``
    when its cache yields at least 2 splits.
    """

    kind, opcode = "attention", 14

    def operands(self, op):
        causal = op.attr("causal")
        s = op.inputs[1].shape[2]
        valid = ScalarOperand(1, 1) if causal else ScalarOperand(s, 0)
        return [*op.inputs, *op.outputs, valid]

    def tiles(self, op, opts):
        q, k, v = op.inputs
        (out,) = op.outputs
        b_, hq, sq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        g = hq // hkv
        tiles = []
        for b in range(b_):
            for h0, h1 in chunks(hkv, opts.attn_heads_per_tile):
                obox = ((b, b + 1), (h0 * g, h1 * g), (0, sq), (0, out.shape[3]))
                tiles.append(Tile(((b, b + 1), (h0, h1)),
                                  reads=((0, ((b, b + 1), (h0 * g, h1 * g), (0, sq), (0, d))),
                                         (1, ((b, b + 1), (h0, h1), (0, s), (0, d))),
                                         (2, ((b, b + 1), (h0, h1), (0, s), (0, v.shape[3])))),
                                  writes=((3, obox, "write"),)))
        return tiles

    def params(self, op):
        return [f32_bits(op.attr("scale")), int(op.attr("causal"))]

    def run_tile(self, t: TileArgs):
        q, k, v, out, valid = t.operands
        scale, causal = bits_f32(t.params[0]), t.params[1]
        (b0, b1), (h0, h1) = t.coords
        g = q.shape[1] // k.shape[1]
        sq, s = q.shape[2], k.shape[2]
        for b in range(b0, b1):
            for h in range(h0, h1):
                qs = q[b, h * g:(h + 1) * g].float()  # [G, Sq, D]
                n = min(s, valid + sq - 1) if causal else s
                keys, vals = k[b, h, :n].float(), v[b, h, :n].float()
                scores = qs @ keys.t() * scale  # [G, Sq, n]
                if causal:
                    limit = valid + torch.arange(sq).view(sq, 1)  # query i sees positions < valid + i
                    scores = scores.masked_fill(torch.arange(n).view(1, n) >= limit, float("-inf"))
                # like fused SDPA kernels: exp(s - max) rounded to the value dtype for P.V,
                # normalized by the sum of the unrounded values
                e = torch.exp(scores - scores.amax(-1, keepdim=True))
                pv = e.to(v.dtype).float() @ vals
                out[b, h * g:(h + 1) * g].copy_(pv / e.sum(-1, keepdim=True))

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        q, k, v = op.inputs[0], op.inputs[1], op.inputs[2]
        (b0, b1), (h0, h1) = tile.coords
        g = q.shape[1] // k.shape[1]  # q.k over D, then p.v over Dv (MLA: D != Dv), a multiply-add each
        return nbytes, 2 * (b1 - b0) * (h1 - h0) * g * q.shape[2] * k.shape[2] * (q.shape[3] + v.shape[3])
