"""Softmax over the last dim (float32 math). Operands: x, out. Tiles: whole rows."""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, out_tiles, register, sub


@register
class Softmax(OpDef):
    """``softmax``: ``out = softmax(x)`` over the last dim in float32, cast to out's dtype.

    Operands: x [..., D], out [..., D]. Tiles: about ``tile_rows`` whole rows.
    """

    kind, opcode = "softmax", 8

    def tiles(self, op, opts):
        (out,) = op.outputs
        return [Tile(box, reads=((0, box),), writes=((1, box, "write"),)) for box in out_tiles(out.shape, opts.tile_rows)]

    def run_tile(self, t: TileArgs):
        x, out = t.operands
        sub(out, t.coords).copy_(torch.softmax(sub(x, t.coords).float(), -1))
