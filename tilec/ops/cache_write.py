"""In-place KV-cache write: ``cache[:, :, p:p+S, :] = src`` for decode position ``p``.

The destination is a view of the caller's cache buffer whose address moves with ``p``
(``View.pos_stride``), so the cache is updated in place and never copied back.
Operands: src [B, H, S, D], dst [B, H, S, D] (cache slot view). Tiles: rows (batch, heads).
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, out_tiles, register, sub


@register
class CacheWrite(OpDef):
    """``cache_write``: copies the step's new rows into the KV cache in place, cast to the cache's
    dtype: ``dst = src`` where dst is the cache slot at the decode position (module docstring).

    Operands: src [B, H, S, D], dst [B, H, S, D] (a view of the caller's STATE cache whose
    ``pos_stride`` moves it one cache row per position). Tiles: :func:`~tilec.ops.out_tiles` of dst
    with ``tile_rows`` (rows along the first leading dim of size > 1, D whole).
    :func:`tilec.passes.fold_cache_writes` (a RoPE writing the slot) and ``fold_kv_append`` (the
    split-KV attention appending the rows) remove it where they apply.
    """

    kind, opcode = "cache_write", 11

    def tiles(self, op, opts):
        (dst,) = op.outputs
        return [Tile(box, reads=((0, box),), writes=((1, box, "write"),)) for box in out_tiles(dst.shape, opts.tile_rows)]

    def run_tile(self, t: TileArgs):
        src, dst = t.operands
        sub(dst, t.coords).copy_(sub(src, t.coords))
