"""Copy (and dtype cast) of a strided view into a new contiguous buffer.

Used where a layout cannot be expressed as a view (e.g. ``contiguous()`` of a transpose
that a following reshape needs). Operands: src, out (same shape). Tiles: rows x cols.
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, out_tiles, register, sub


@register
class Copy(OpDef):
    """``copy``: ``out = src`` elementwise, cast to out's dtype: a strided view (e.g. a transpose a
    reshape needs contiguous) materialized as a new contiguous buffer.

    Operands: src, out (same shape). Tiles: :func:`~tilec.ops.out_tiles` of out, ``tile_rows``
    rows x ``tile_cols`` columns.
    """

    kind, opcode = "copy", 9

    def tiles(self, op, opts):
        (out,) = op.outputs
        return [Tile(box, reads=((0, box),), writes=((1, box, "write"),))
                for box in out_tiles(out.shape, opts.tile_rows, opts.tile_cols)]

    def run_tile(self, t: TileArgs):
        src, out = t.operands
        sub(out, t.coords).copy_(sub(src, t.coords))
