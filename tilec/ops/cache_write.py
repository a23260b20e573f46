"""In-place KV-cache write: ``cache[:, :, p:p+S, :] = src`` for decode position ``p``.

The destination is a view of the caller's cache buffer whose address moves with ``p``
(``View.pos_stride``), so the cache is updated in place and never copied back.
Operands: src [B, H, S, D], dst [B, H, S, D] (cache slot view). Tiles: rows (batch, heads).
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, out_tiles, register, sub


@register
class CacheWrite(OpDef):
    kind, opcode = "cache_write", 11

    def tiles(self, op, opts):
        (dst,) = op.outputs
        return [Tile(box, reads=((0, box),), writes=((1, box, "write"),)) for box in out_tiles(dst.shape, opts.tile_rows)]

    def run_tile(self, t: TileArgs):
        src, dst = t.operands
        sub(dst, t.coords).copy_(sub(src, t.coords))
