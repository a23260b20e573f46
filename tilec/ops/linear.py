"""Linear / GEMV: ``out[..., n] = sum_k x[..., k] * W[n, k] (+ bias[n])``.

Operands: x [..., K], W [N, K] (any strides), bias [N] (optional), out [..., N].
Tiles: all rows x the column ranges of ``tilec.ops.gemv_col_ranges`` (``tile_n`` columns, or
the sizes ``tilec.passes.gemv_groups`` chose). With ``split_k`` > 1 each column tile becomes
one init tile (variant 1: writes bias or zeros) and ``split_k`` partial tiles (variant 2:
accumulate a K-slice) - the ``tile_reduce`` case. Coords: the out box, then the K range.
Params: K, has_bias. Accumulation in float32.
"""
from __future__ import annotations

import torch

from . import (row_cap, ACCUMULATE, WRITE, OpDef, Tile, TileArgs, chunks, gemv_col_ranges, gemv_stream_word, out_tiles, register, sub,
               weight_rows_prefetch)


@register
class Linear(OpDef):
    """``linear``: GEMV / small-M GEMM ``out[..., n] = sum_k x[..., k] W[n, k] (+ bias[n])``,
    float32 accumulation, cast to out's dtype.

    Operands: x [..., K], W [N, K] (any strides), bias [N] (optional), out [..., N]. Params: K,
    has_bias. Tiles: all rows x the column ranges of :func:`~tilec.ops.gemv_col_ranges`; coords:
    the out box, then the K range. With ``split_k`` > 1 (and K >= 2 * split_k) a column range is
    an init tile (variant 1: bias or zeros) and at most ``split_k`` K-slice tiles (variant 2) that
    accumulate into it. bf16 PARAM / CONST weights may stream through the worker's ring
    (:func:`~tilec.ops.gemv_stream_word`); the device instance is specialized on
    :func:`~tilec.ops.row_cap`.
    """

    kind, opcode = "linear", 5
    shape_classed = True  # op_<kind><types..., kRowCap>

    def shape_class(self, op):
        """``kRowCap``: the row bound of the device instance (:func:`tilec.ops.row_cap`)."""
        return row_cap(op)

    def tiles(self, op, opts):
        x = op.inputs[0]
        has_bias = len(op.inputs) == 3
        out_idx = len(op.inputs)
        (out,) = op.outputs
        k = x.shape[-1]
        rows = 1
        for s in out.shape[:-1]:
            rows *= s
        tiles = []
        for box in out_tiles(out.shape, max(rows, 1), col_ranges=gemv_col_ranges(op, opts)):
            n0, n1 = box[-1]
            lead = box[:-1]
            bias_read = ((2, ((n0, n1),)),) if has_bias else ()
            if opts.split_k <= 1 or k < 2 * opts.split_k:
                tiles.append(Tile(box + ((0, k),), reads=((0, lead + ((0, k),)), (1, ((n0, n1), (0, k)))) + bias_read,
                                  writes=((out_idx, box, WRITE),)))
                continue
            tiles.append(Tile(box + ((0, 0),), reads=bias_read, writes=((out_idx, box, WRITE),), variant=1))
            for k0, k1 in chunks(k, -(-k // opts.split_k)):
                tiles.append(Tile(box + ((k0, k1),), reads=((0, lead + ((k0, k1),)), (1, ((n0, n1), (k0, k1)))),
                                  writes=((out_idx, box, ACCUMULATE),), variant=2))
        return tiles

    def prefetch(self, op, tile, graph):
        if tile.variant == 1:
            return None
        (n0, n1), (k0, k1) = tile.coords[-2], tile.coords[-1]
        return weight_rows_prefetch(graph, op.inputs[1], 1, n0, n1, k0, k1)

    def stream(self, op, tile, graph, scratch):
        return 0 if tile.variant == 1 else gemv_stream_word(graph, op.inputs[0], op.inputs[1], 1, tile, scratch)

    def params(self, op):
        return [op.inputs[0].shape[-1], int(len(op.inputs) == 3)]

    def run_tile(self, t: TileArgs):
        has_bias = t.params[1]
        x, w = t.operands[0], t.operands[1]
        out = t.operands[-1]
        box, (k0, k1) = t.coords[:-1], t.coords[-1]
        n0, n1 = box[-1]
        o = sub(out, box)
        if t.variant == 1:
            o.copy_(t.operands[2][n0:n1].float().expand(o.shape) if has_bias else torch.zeros_like(o))
            return
        xs = sub(x, box[:-1] + ((k0, k1),)).float()
        acc = xs @ w[n0:n1, k0:k1].float().t()
        if t.variant == 2:
            o.copy_(o.float() + acc)
            return
        if has_bias:
            acc = acc + t.operands[2][n0:n1].float()
        o.copy_(acc)

    def cost(self, op, tile):
        return super().cost(op, tile)[0], gemv_flops(tile)


def gemv_flops(tile: Tile) -> int:
    """Flops of a GEMV tile whose coords are the out box, then the K range."""
    rows = 1
    for lo, hi in tile.coords[:-2]:
        rows *= hi - lo
    (n0, n1), (k0, k1) = tile.coords[-2], tile.coords[-1]
    return 2 * rows * (n1 - n0) * (k1 - k0)
