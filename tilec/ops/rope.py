"""Rotary position embedding on [..., D] rows (RoFormer, arXiv 2104.09864).

style 0, rotate-half (HF ``apply_rotary_pos_emb``): ``out = x*cos + rotate_half(x)*sin``,
with cos/sin [..., D].
style 1, interleaved pairs (HF ``apply_rotary_pos_emb_interleave``, DeepSeek / GLM-5):
``out[i] = x[2i]*c[i] - x[2i+1]*s[i]``, ``out[D/2+i] = x[2i+1]*c[i] + x[2i]*s[i]``, with
cos/sin [..., D/2].
style 2, pairs rotated in place (GPT-J's ``rotate_every_two``; HF GLM / GLM-4, Cohere, Helium,
ERNIE-4.5): ``out[2i] = x[2i]*c[2i] - x[2i+1]*s[2i]``, ``out[2i+1] = x[2i+1]*c[2i+1] + x[2i]*s[2i+1]``,
with cos/sin [..., D] (HF repeats each frequency twice: ``repeat_interleave(2)``).
Operands: x, cos, sin (broadcast to x's leading dims), out. Tiles: whole rows.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, bcast_box, out_tiles, register, sub

ROTATE_HALF, INTERLEAVED, PAIRWISE = 0, 1, 2


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: int) -> torch.Tensor:
    """RoPE of rows ``x [..., D]`` (any float dtype) with ``cos``/``sin`` broadcast to them
    (``[..., D]`` for rotate-half and pairwise, ``[..., D / 2]`` for interleaved pairs), as float32 values
    with each product rounded to ``x``'s dtype, as eager HF computes them (the caller rounds the
    sum to its output dtype). Also the query RoPE that ``attention_partial`` applies when
    ``tilec.passes.fold_rope`` folded it in."""
    xs, c, s = x.float(), cos.float(), sin.float()
    h = xs.shape[-1] // 2

    def r(v):  # each product rounded to the storage type, as eager HF computes it
        return v.to(x.dtype).float()

    if style == ROTATE_HALF:
        return r(xs * c) + r(torch.cat([-xs[..., h:], xs[..., :h]], -1) * s)
    if style == PAIRWISE:
        return r(xs * c) + r(torch.stack([-xs[..., 1::2], xs[..., 0::2]], -1).flatten(-2) * s)
    x1, x2 = xs[..., 0::2], xs[..., 1::2]
    return torch.cat([r(x1 * c) - r(x2 * s), r(x2 * c) + r(x1 * s)], -1)


@register
class Rope(OpDef):
    """``rope``: rotary position embedding (RoFormer, Su et al. 2021, arXiv 2104.09864) of rows
    [..., D], rotate-half (style 0, HF ``apply_rotary_pos_emb``), interleaved pairs (style 1,
    DeepSeek / GLM-5: the output de-interleaved) or pairs rotated in place (style 2, GPT-J /
    GLM-4 / Cohere: the output interleaved like x), each product rounded to x's dtype as eager HF computes them
    (:func:`rope_rows`), the sum cast to out's dtype.

    Operands: x [..., D], cos, sin ([..., D] for styles 0 and 2, [..., D/2] for style 1: position
    table rows broadcast to x's leading dims), out [..., D]. Params: style. Tiles: about
    ``tile_rows`` whole rows.
    """

    kind, opcode = "rope", 6

    def tiles(self, op, opts):
        x, cos, sin = op.inputs
        (out,) = op.outputs
        tiles = []
        for box in out_tiles(out.shape, opts.tile_rows):
            cbox = bcast_box(cos.shape[:-1], box[:-1]) + ((0, cos.shape[-1]),)
            sbox = bcast_box(sin.shape[:-1], box[:-1]) + ((0, sin.shape[-1]),)
            tiles.append(Tile(box, reads=((0, box), (1, cbox), (2, sbox)), writes=((3, box, "write"),)))
        return tiles

    def params(self, op):
        return [op.attr("style")]

    def run_tile(self, t: TileArgs):
        x, cos, sin, out = t.operands
        box = t.coords
        c = sub(cos, bcast_box(cos.shape[:-1], box[:-1]) + ((0, cos.shape[-1]),))
        s = sub(sin, bcast_box(sin.shape[:-1], box[:-1]) + ((0, sin.shape[-1]),))
        sub(out, box).copy_(rope_rows(sub(x, box), c, s, t.params[0]))

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        return nbytes, 0
