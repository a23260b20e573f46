"""Embedding lookup: ``out[..., c] = weight[ids[...], c]``.

Operands: weight [V, D], ids [...] int64, out [..., D]. Tiles: rows x column chunks of out.
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, _elem, full_box, out_tiles, register, sub


@register
class Embedding(OpDef):
    """``embedding``: the table-row gather ``out[..., c] = weight[ids[...], c]``.

    Operands: weight [V, D], ids [...] integer token ids, out [..., D]. Tiles: ``tile_rows`` rows x
    ``tile_cols`` columns of out; each declares the whole table read (the ids are known only at
    run time). Cost: the row bytes read and written and the ids. The CPU reference raises
    IndexError for an id outside [0, V) (where torch would wrap a negative one).
    """

    kind, opcode = "embedding", 2

    def tiles(self, op, opts):
        weight, ids = op.inputs
        (out,) = op.outputs
        return [
            Tile(box, reads=((0, full_box(weight.shape)), (1, box[:-1])), writes=((2, box, "write"),))
            for box in out_tiles(out.shape, opts.tile_rows, opts.tile_cols)
        ]

    def run_tile(self, t: TileArgs):
        weight, ids, out = t.operands
        box = t.coords
        c0, c1 = box[-1]
        tok = sub(ids, box[:-1])
        bad = tok[(tok < 0) | (tok >= weight.shape[0])]
        if bad.numel():  # torch would wrap a negative id around; eager HF raises
            raise IndexError(f"token id {int(bad.reshape(-1)[0])} outside the embedding table [0, {weight.shape[0]})")
        sub(out, box).copy_(weight[tok][..., c0:c1])

    def cost(self, op, tile):
        """Bytes: the gathered rows' columns read and written, and the rows' ids (no flops)."""
        weight, ids = op.inputs[0], op.inputs[1]
        rows = 1
        for lo, hi in tile.coords[:-1]:
            rows *= hi - lo
        c0, c1 = tile.coords[-1]
        return rows * (c1 - c0) * (_elem(weight) + _elem(op.outputs[0])) + rows * _elem(ids), 0
