"""RMSNorm over the last dim: ``out = (x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight``.

Computed in float32 as HF's ``LlamaRMSNorm`` does. Operands: x [..., D], weight [D], out [..., D].
Params: eps (float32 bits). Tiles: whole rows.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, bits_f32, f32_bits, out_tiles, register, sub


@register
class RMSNorm(OpDef):
    """``rmsnorm``: RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467) over the last dim with HF
    ``LlamaRMSNorm``'s rounding: ``(x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight`` in float32,
    cast to out's dtype.

    Operands: x [..., D], weight [D], out [..., D]. Params: eps (float32 bits). Tiles: about
    ``tile_rows`` whole rows. :func:`tilec.passes.fuse_gemv_chains` folds it into a following
    GEMV's prologue where it can.
    """

    kind, opcode = "rmsnorm", 3

    def tiles(self, op, opts):
        x, w = op.inputs
        (out,) = op.outputs
        return [
            Tile(box, reads=((0, box), (1, ((0, w.shape[0]),))), writes=((2, box, "write"),))
            for box in out_tiles(out.shape, opts.tile_rows)
        ]

    def params(self, op):
        return [f32_bits(op.attr("eps"))]

    def run_tile(self, t: TileArgs):
        x, w, out = t.operands
        xs = sub(x, t.coords).float()
        y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + bits_f32(t.params[0]))
        sub(out, t.coords).copy_(y.to(x.dtype).float() * w.float())
