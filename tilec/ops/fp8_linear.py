"""Block-scaled FP8 GEMM for small M (DeepSeek-V3's ``fp8_gemm``; the DeepGEMM recipe).

``out[m, n] = sum_kb xs[m, kb] ws[n // Bn, kb] sum_{k in block kb} xq[m, k] wq[n, k]``:
activations quantized per token in groups of G along K (``fp8_quant``), weights per
``Bn x G`` block; each K block is accumulated in float32, then scaled and summed.
Operands: xq [..., K] fp8, xs [..., K/G] float32, wq [N, K] fp8, ws [ceil(N/Bn), K/G] float32,
out [..., N]. Params: K, G, Bn. Tiles: all rows x ``tile_n`` output columns.
"""
from __future__ import annotations

import torch

from . import (STREAM_BYTE, STREAM_K, STREAM_PAIRED, OpDef, Tile, TileArgs, bits_f32, box_rows, f32_bits,
               gemv_tile_n, leading_rows, out_tiles, register, sub, weight_rows_prefetch)
from .fp8_quant import FP8_MAX, quantize


def block_scaled(x: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, g: int) -> torch.Tensor:
    """``sum_kb (x[..., kb] @ w[:, kb].T) * sx[..., kb] * sw[:, kb]`` in float32: x [..., K],
    sx [..., K/g], w [n, K], sw [n, K/g] (float32) -> [..., n]."""
    acc = torch.zeros(*x.shape[:-1], w.shape[0])
    for kb in range(x.shape[-1] // g):
        part = x[..., kb * g:(kb + 1) * g] @ w[:, kb * g:(kb + 1) * g].t()
        acc += part * sx[..., kb:kb + 1] * sw[:, kb]
    return acc


@register
class Fp8Linear(OpDef):
    """``fp8_linear``: block-scaled FP8 GEMM for small M (DeepSeek-V3's ``fp8_gemm``, the DeepGEMM
    recipe): each K group's FP8 product accumulated in float32, then scaled by the activation's
    per-token group scale and the weight's block scale, and summed (:func:`block_scaled`).

    Operands: xq [..., K] float8_e4m3fn, xs [..., K/G] float32, wq [N, K] float8_e4m3fn, ws
    [ceil(N/Bn), K/G] float32, out [..., N]. Params: K, G (= K / xs's last dim), Bn (attr
    ``block_n``). Tiles: all rows x ``gemv_tile_n(N)`` output columns, each with the ws rows of its
    columns. :func:`tilec.passes.fuse_fp8_quant` turns ``fp8_quant -> fp8_linear`` into
    :class:`Fp8LinearQuant`.
    """

    kind, opcode = "fp8_linear", 21

    def tiles(self, op, opts):
        xq, xs, wq, ws = op.inputs
        (out,) = op.outputs
        k, kb, bn = xq.shape[-1], xs.shape[-1], op.attr("block_n")
        rows = leading_rows(out.shape)
        tiles = []
        for box in out_tiles(out.shape, max(rows, 1), gemv_tile_n(out.shape[-1], opts)):
            (n0, n1), lead = box[-1], box[:-1]
            tiles.append(Tile(box, reads=((0, lead + ((0, k),)), (1, lead + ((0, kb),)), (2, ((n0, n1), (0, k))),
                                          (3, ((n0 // bn, (n1 - 1) // bn + 1), (0, kb)))),
                              writes=((4, box, "write"),)))
        return tiles

    def prefetch(self, op, tile, graph):
        """The tile's FP8 weight rows (one contiguous range, clamped by the plan to
        ``PREFETCH_MAX_BYTES``): pulled into L2 while the tile waits for its quantized
        activations, so its weight loads (not streamed through the ring) wait on L2."""
        n0, n1 = tile.coords[-1]
        return weight_rows_prefetch(graph, op.inputs[2], 2, n0, n1, 0, op.inputs[2].shape[1])

    def params(self, op):
        xq, xs = op.inputs[0], op.inputs[1]
        return [xq.shape[-1], xq.shape[-1] // xs.shape[-1], op.attr("block_n")]

    def smem_bytes(self, op):
        """Device staging (runtime/tilec/ops_glm.cuh): 3 x 64 row offsets, then per row (<= 64)
        its K/G scales (float) and K FP8 bytes; for the K-split path (<= 16 rows) 64 more bytes a
        row, the weight scales of a tile up to 128 columns wide and the cross-warp sums (4096).
        A wider tile whose scales do not fit takes the other path (the device checks)."""
        xq, xs, _, ws = op.inputs
        rows = leading_rows(op.outputs[0].shape)
        kb, k = xs.shape[-1], xq.shape[-1]
        need = 3 * 64 * 8 + 80 + min(rows, 64) * (4 * kb + k) + 96
        if rows <= 16:
            scale_rows = min(ws.shape[0], 128 // op.attr("block_n") + 2)
            need += rows * 64 + 4 * (scale_rows * kb + 4) + 4096 + 16
        return need

    def run_tile(self, t: TileArgs):
        xq, xs, wq, ws, out = t.operands
        k, g, bn = t.params[:3]
        box = t.coords
        (n0, n1), lead = box[-1], box[:-1]
        x = sub(xq, lead + ((0, k),)).float()
        sx = sub(xs, lead + ((0, k // g),)).float()
        sw = ws[torch.arange(n0, n1) // bn].float()  # [n, K/G]
        sub(out, box).copy_(block_scaled(x, sx, wq[n0:n1].float(), sw, g))

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        n0, n1 = tile.coords[-1]
        return nbytes, 2 * box_rows(tile.coords) * (n1 - n0) * op.inputs[0].shape[-1]


QUANT_ROWS = 16  # rows of a fused tile at most (runtime/tilec/ops_glm.cuh op_fp8_linear_quant: one m16 A tile)
QUANT_TILE_N = 128  # columns of a fused tile at most (its weight-scale rows are staged: smem_bytes)


def quant_smem_bytes(rows: int, k: int, g: int, scale_rows: int) -> int:
    """Shared memory (bytes) of an ``fp8_linear_quant`` tile: row offsets (256), the rows' scales,
    the tile's weight-scale rows, the cross-warp sums of two column groups (8192) and ``rows`` FP8
    rows of K + 64 bytes (ops_glm.cuh op_fp8_linear_quant), plus a margin."""
    kb = k // g
    return 256 + 4 * (-(-16 * kb // 4) * 4) + 4 * (-(-scale_rows * kb // 4) * 4) + 8192 + rows * (k + 64) + 64


@register
class Fp8LinearQuant(OpDef):
    """``fp8_linear(fp8_quant(x))`` in one op (made by :func:`tilec.passes.fuse_fp8_quant`): each
    tile quantizes its bf16 x rows per token in groups of G (DeepSeek-V3's ``act_quant``) while it
    stages them, then runs the block-scaled FP8 GEMM (the DeepGEMM recipe: each K block's product
    in float32, then scaled). On the GPU the weights come from the worker's ring (the loader warp
    streams them as 1-byte items, two column groups a stage for K <= 2048) and both operands are
    widened exactly to f16 for ``mma.sync`` m16n8k16 (Hopper has no FP8 ``mma.sync``; its e4m3
    form is emulated the same way).

    Operands: x [..., K] bf16 (at most :data:`QUANT_ROWS` rows), wq [N, K] float8_e4m3fn,
    ws [ceil(N/Bn), K/G] float32, out [..., N]. Params: K, G, Bn, pow2, amin bits, FP8 max bits, recip.
    Attrs: block_n, group, pow2, amin, recip (the scale as ``fp8_quant``'s), stream (weights through the
    ring). Tiles: all rows x ``tile_n`` output columns (at most :data:`QUANT_TILE_N`); coords: the out
    box, then the K range.
    """

    kind, opcode = "fp8_linear_quant", 25

    def tiles(self, op, opts):
        x, wq, ws = op.inputs
        (out,) = op.outputs
        k, g, bn = x.shape[-1], op.attr("group"), op.attr("block_n")
        rows = leading_rows(out.shape)
        tiles = []
        for box in out_tiles(out.shape, max(rows, 1), min(gemv_tile_n(out.shape[-1], opts), QUANT_TILE_N)):
            (n0, n1), lead = box[-1], box[:-1]
            tiles.append(Tile(box + ((0, k),), reads=((0, lead + ((0, k),)), (1, ((n0, n1), (0, k))),
                                                      (2, ((n0 // bn, (n1 - 1) // bn + 1), (0, k // g)))),
                              writes=((3, box, "write"),)))
        return tiles

    def prefetch(self, op, tile, graph):
        """The tile's FP8 weight rows, when they are not streamed through the ring (the plan asks
        for a prefetch only then)."""
        (n0, n1), (k0, k1) = tile.coords[-2], tile.coords[-1]
        return weight_rows_prefetch(graph, op.inputs[1], 1, n0, n1, k0, k1)

    def stream(self, op, tile, graph, scratch):
        """``wq + 1 | n-range index << 4 | k-range index << 8 | STREAM_BYTE`` (``| STREAM_PAIRED``
        for K <= STREAM_K: two column groups per stage) when the op's ``stream`` attr is on, the
        weights are FP8, read-only (``OpGraph.read_only``), with unit K stride and 16-byte rows, K fits one 4096-byte item
        or the group divides 4096 (a consumer's K block never straddles two items), and the staged
        rows fit in ``scratch``; otherwise 0 (the device loads the weights itself)."""
        x, w, ws = op.inputs
        buf = graph.buffers[w.buffer]
        k = x.shape[-1]
        if not op.attr("stream") or not graph.read_only(w.buffer) \
                or buf.dtype != torch.float8_e4m3fn or w.strides[1] != 1 or k % 16 or w.strides[0] % 16:
            return 0
        if k > 2 * STREAM_K and (2 * STREAM_K) % op.attr("group"):  # a K block would straddle two items
            return 0
        if self.smem_bytes(op) > scratch:
            return 0
        nd = len(tile.coords) - 1
        return 2 | ((nd - 1) << 4) | (nd << 8) | STREAM_BYTE | (STREAM_PAIRED if k <= STREAM_K else 0)

    def params(self, op):
        return [op.inputs[0].shape[-1], op.attr("group"), op.attr("block_n"), int(op.attr("pow2")),
                f32_bits(op.attr("amin")), f32_bits(FP8_MAX), int(op.attr("recip", False))]

    def smem_bytes(self, op):
        x, _, ws = op.inputs
        rows = leading_rows(op.outputs[0].shape)
        scale_rows = min(ws.shape[0], QUANT_TILE_N // op.attr("block_n") + 2)  # a tile's, however it is aligned
        return quant_smem_bytes(rows, x.shape[-1], op.attr("group"), scale_rows)

    def run_tile(self, t: TileArgs):
        x, wq, ws, out = t.operands
        k, g, bn, pow2, amin, fmax = t.params[0], t.params[1], t.params[2], t.params[3], bits_f32(t.params[4]), \
            bits_f32(t.params[5])
        (n0, n1), lead = t.coords[-2], t.coords[:-2]
        xq, sx = quantize(sub(x, lead + ((0, k),)).float(), g, bool(pow2), amin, fmax, bool(t.params[6]))
        sw = ws[torch.arange(n0, n1) // bn].float()
        sub(out, lead + ((n0, n1),)).copy_(block_scaled(xq.float(), sx, wq[n0:n1].float(), sw, g))

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        n0, n1 = tile.coords[-2]
        return nbytes, 2 * box_rows(tile.coords[:-1]) * (n1 - n0) * op.inputs[0].shape[-1]
