"""Paged cache write: ``cache[slot[t]] = src[t]`` for the slots of this call (vLLM's
``reshape_and_cache``, with torch's indexing semantics: a negative slot counts from the end).

The cache keeps its own shape ``[*lead, D]`` (e.g. ``[pages, page_size, D]``) and a slot
indexes its leading dims flattened row-major (``page * page_size + offset``). The slot
mapping is a per-call input read at run time, so the written rows are unknown when compiling:
a tile declares its whole column range of the cache as written (every later reader is ordered
after it) but moves only T rows.
Operands: src [T, D], slot [T] (int64 / int32), cache [*lead, D] (the caller's cache, updated
in place). Tiles: ``tile_cols`` column chunks.
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, _elem, chunks, full_box, register


@register
class PagedCacheWrite(OpDef):
    """``paged_cache_write``: ``cache[slot[t]] = src[t]`` (vLLM's ``reshape_and_cache``), cast to
    the cache's dtype, with the slots read at run time; a negative slot counts from the end, one
    outside ``[-rows, rows)`` is an error (IndexError here; on the device the step fails and the
    host raises TilecError, writing nothing there).

    Operands: src [T, D], slot [T] int64 / int32 (indexing the cache's leading dims flattened
    row-major), cache [*lead, D] (STATE, updated in place). Tiles: all T rows x ``tile_cols``
    column chunks (D whole without it); each declares its columns of the whole cache written,
    as the rows are unknown when compiling. Cost: the T rows moved and their slots.
    """

    kind, opcode = "paged_cache_write", 23

    def tiles(self, op, opts):
        src, slot = op.inputs
        (dst,) = op.outputs
        t_, d = src.shape
        step, align = opts.tile_cols or d, op.attr("col_align", 1)  # col_align: whole inner rows (frontend)
        step = max(align, step // align * align)
        return [Tile(((0, t_), (c0, c1)), reads=((0, ((0, t_), (c0, c1))), (1, ((0, t_),))),
                     writes=((2, full_box(dst.shape[:-1]) + ((c0, c1),), "write"),))
                for c0, c1 in chunks(d, step)]

    def run_tile(self, t: TileArgs):
        src, slot, dst = t.operands
        (t0, t1), (c0, c1) = t.coords
        lead = dst.shape[:-1]
        rows = dst[..., 0].numel()
        bad = [int(v) for v in slot[t0:t1] if not -rows <= int(v) < rows]
        if bad:  # eager raises too (before writing); the device fails the step (fail_index)
            raise IndexError(f"slot {bad[0]} outside the cache's {rows} rows")
        for i in range(t0, t1):
            s = int(slot[i])
            if s < 0:
                s += rows
            idx = []
            for size in reversed(lead):
                idx.append(s % size)
                s //= size
            dst[tuple(reversed(idx))][c0:c1] = src[i, c0:c1].to(dst.dtype)

    def cost(self, op, tile):
        (t0, t1), (c0, c1) = tile.coords
        src, slot = op.inputs
        (dst,) = op.outputs
        return (t1 - t0) * ((c1 - c0) * (_elem(src) + _elem(dst)) + _elem(slot)), 0
