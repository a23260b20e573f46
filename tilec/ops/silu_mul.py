"""SwiGLU activation: ``out = silu(gate) * up`` (Shazeer, arXiv 2002.05202).

Operands: gate, up, out (same shape). Tiles: rows x ``tile_cols`` columns. float32 math.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, out_tiles, register, sub


SILU_CHUNK = 64  # elements: a multiple of ATen's vectorized CPU loop step (2 x 16 float32 lanes)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.silu(x)`` (float32 [...]) with the same value for an element whatever
    the tile it is computed in. ATen's CPU kernel computes the elements of its vectorized loop
    and those of the loop's tail with different exp approximations (last-bit differences), so
    a tile's width would otherwise change its results; the rows are padded with zeros to a
    multiple of SILU_CHUNK, which puts every element in the vectorized loop."""
    flat = x.reshape(-1)
    pad = -flat.numel() % SILU_CHUNK
    y = torch.nn.functional.silu(torch.nn.functional.pad(flat, (0, pad)) if pad else flat)
    return y[:flat.numel()].reshape(x.shape)


@register
class SiluMul(OpDef):
    """``silu_mul``: the SwiGLU gate (Shazeer 2020, arXiv 2002.05202), ``out = silu(gate).to(gate's
    dtype) * up`` in float32, cast to out's dtype; the SiLU through :func:`silu`, so an element's
    value does not depend on its tile.

    Operands: gate, up, out (same shape). Tiles: ``tile_rows`` rows x ``tile_cols`` columns.
    """

    kind, opcode = "silu_mul", 7

    def tiles(self, op, opts):
        (out,) = op.outputs
        return [Tile(box, reads=((0, box), (1, box)), writes=((2, box, "write"),))
                for box in out_tiles(out.shape, opts.tile_rows, opts.tile_cols)]

    def run_tile(self, t: TileArgs):
        g, u, out = t.operands
        gs = sub(g, t.coords).float()
        sub(out, t.coords).copy_(silu(gs).to(g.dtype).float() * sub(u, t.coords).float())
