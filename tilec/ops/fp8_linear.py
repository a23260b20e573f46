"""Block-scaled FP8 GEMM for small M (DeepSeek-V3's ``fp8_gemm``; the DeepGEMM recipe).

``out[m, n] = sum_kb xs[m, kb] ws[n // Bn, kb] sum_{k in block kb} xq[m, k] wq[n, k]``:
activations quantized per token in groups of G along K (``fp8_quant``), weights per
``Bn x G`` block; each K block is accumulated in float32, then scaled and summed.
Operands: xq [..., K] fp8, xs [..., K/G] float32, wq [N, K] fp8, ws [ceil(N/Bn), K/G] float32,
out [..., N]. Params: K, G, Bn. Tiles: all rows x ``tile_n`` output columns.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, gemv_tile_n, out_tiles, register, sub, weight_rows_prefetch


@register
class Fp8Linear(OpDef):
    kind, opcode = "fp8_linear", 21

    def tiles(self, op, opts):
        xq, xs, wq, ws = op.inputs
        (out,) = op.outputs
        k, kb, bn = xq.shape[-1], xs.shape[-1], op.attr("block_n")
        rows = 1
        for s in out.shape[:-1]:
            rows *= s
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
        rows = 1
        for s in op.outputs[0].shape[:-1]:
            rows *= s
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
        w = wq[n0:n1].float()
        sw = ws[torch.arange(n0, n1) // bn].float()  # [n, K/G]
        acc = torch.zeros(*x.shape[:-1], n1 - n0)
        for kb in range(k // g):
            part = x[..., kb * g:(kb + 1) * g] @ w[:, kb * g:(kb + 1) * g].t()
            acc += part * sx[..., kb:kb + 1] * sw[:, kb]
        sub(out, box).copy_(acc)

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        rows = 1
        for lo, hi in tile.coords[:-1]:
            rows *= hi - lo
        n0, n1 = tile.coords[-1]
        return nbytes, 2 * rows * (n1 - n0) * op.inputs[0].shape[-1]
