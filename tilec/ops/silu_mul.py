"""SwiGLU activation: ``out = silu(gate) * up`` (Shazeer, arXiv 2002.05202).

Operands: gate, up, out (same shape). Tiles: rows x ``tile_cols`` columns. float32 math.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, out_tiles, register, sub


@register
class SiluMul(OpDef):
    kind, opcode = "silu_mul", 7

    def tiles(self, op, opts):
        (out,) = op.outputs
        return [Tile(box, reads=((0, box), (1, box)), writes=((2, box, "write"),))
                for box in out_tiles(out.shape, opts.tile_rows, opts.tile_cols)]

    def run_tile(self, t: TileArgs):
        g, u, out = t.operands
        gs = sub(g, t.coords).float()
        sub(out, t.coords).copy_(torch.nn.functional.silu(gs).to(g.dtype).float() * sub(u, t.coords).float())
