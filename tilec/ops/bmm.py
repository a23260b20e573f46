"""Batched matmul ``out[b] = a[b] @ w[b]`` (an einsum with one batch, one contracted and one
free letter per side: MLA's per-head absorption ``q_nope[t, h] @ W_UK[h]``).

``w`` may be a block-scaled FP8 weight read in place: a strided view of a row-major
``[R, C]`` float8_e4m3fn buffer whose element at buffer offset ``e`` is dequantized as
``w * ws[(e // C) // Br, (e % C) // Bc]`` (so a head's rows may start inside a block, as
``kv_b_proj``'s key half does), then optionally rounded to the output dtype (as eager
``weight_dequant(...).to(dtype)`` does). float32 accumulation.
Operands: a [B, M, K], w [B, K, N], ws [ceil(R/Br), ceil(C/Bc)] (FP8 only), out [B, M, N].
Params: has_scale, C, w view offset (elements), Br, Bc, round_w, rows_whole. Tiles: one batch x
``tile_n`` output columns, sized over all batches' columns (``gemv_tile_n`` of B x N): per-head
column slices of 8 made GLM-5's absorption 4096 tiles of ~20 µs fixed cost each on an H200.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, chunks, full_box, gemv_tile_n, register


def dequant_rows(w: torch.Tensor, ws: torch.Tensor, offset: int, row_len: int, br: int, bc: int) -> torch.Tensor:
    """float32 ``w * scale`` for a strided view ``w`` of an FP8 ``[R, row_len]`` buffer starting at ``offset``."""
    e = torch.full(w.shape, offset, dtype=torch.int64)
    for d, st in enumerate(w.stride()):
        shape = [1] * w.dim()
        shape[d] = w.shape[d]
        e = e + (torch.arange(w.shape[d]) * st).view(shape)
    return w.float() * ws[(e // row_len) // br, (e % row_len) // bc].float()


@register
class Bmm(OpDef):
    """``bmm``: batched matmul ``out[b] = a[b] @ w[b]`` with float32 accumulation (MLA's per-head
    absorption), ``w`` either a float view or a block-scaled FP8 view dequantized as it is read
    (DeepSeek-V3's ``weight_dequant`` block layout; the module docstring has the formula).

    Operands: a [B, M, K], w [B, K, N], ws [ceil(R/Br), ceil(C/Bc)] (FP8 only, read whole by every
    tile), out [B, M, N]. Params (:meth:`params`): has_scale, C, w offset (elements), Br, Bc,
    round_w, rows_whole. Tiles: one batch x a chunk of ``gemv_tile_n(B * N)`` (at most N) output
    columns, with all M rows and all of K.
    """

    kind, opcode = "bmm", 22

    def tiles(self, op, opts):
        a, w = op.inputs[0], op.inputs[1]
        out_idx = len(op.inputs)
        (out,) = op.outputs
        b_, m, k = a.shape
        n = w.shape[2]
        scale_read = ((2, full_box(op.inputs[2].shape)),) if len(op.inputs) == 3 else ()
        return [Tile(((b, b + 1), (n0, n1)),
                     reads=((0, ((b, b + 1), (0, m), (0, k))), (1, ((b, b + 1), (0, k), (n0, n1)))) + scale_read,
                     writes=((out_idx, ((b, b + 1), (0, m), (n0, n1)), "write"),))
                for b in range(b_) for n0, n1 in chunks(n, min(n, gemv_tile_n(b_ * n, opts)))]

    def params(self, op):
        """has_scale, C, w view offset, Br, Bc, round_w, rows_whole: 1 when every view row
        ``w[b, k, :]`` lies within one row of the ``[R, C]`` buffer (the device's tensor-core path
        takes a row's scales from where it starts; bmm_mma in runtime/tilec/ops_glm.cuh)."""
        if len(op.inputs) == 2:
            return [0, 0, 0, 0, 0, 0, 1]
        w = op.inputs[1]
        br, bc = op.attr("block")
        row_len, (nb, nk, nn) = op.attr("row_len"), w.shape
        starts = (w.offset + torch.arange(nb).view(-1, 1) * w.strides[0] + torch.arange(nk).view(1, -1) * w.strides[1])
        whole = w.strides[2] == 1 and bool(((starts % row_len) + nn <= row_len).all())
        return [1, row_len, w.offset, br, bc, int(op.attr("round_w")), int(whole)]

    def smem_bytes(self, op):
        """Device staging (runtime/tilec/ops_glm.cuh): one batch of ``a`` as float and a chunk of up
        to 128 k x 128 weight columns as float (all of K for K <= 128)."""
        a = op.inputs[0]
        return 4 * (a.shape[1] * a.shape[2] + 128 * min(a.shape[2], 128)) + 128

    def run_tile(self, t: TileArgs):
        has_scale, row_len, offset, br, bc, round_w = t.params[:6]
        a, w, out = t.operands[0], t.operands[1], t.operands[-1]
        (b0, b1), (n0, n1) = t.coords
        for b in range(b0, b1):
            wb = w[b, :, n0:n1]
            if has_scale:
                off = offset + b * w.stride(0) + n0 * w.stride(2)
                wf = dequant_rows(wb, t.operands[2], off, row_len, br, bc)
                if round_w:
                    wf = wf.to(out.dtype).float()
            else:
                wf = wb.float()
            out[b, :, n0:n1].copy_(a[b].float() @ wf)

    def cost(self, op, tile):
        nbytes, _ = super().cost(op, tile)
        (b0, b1), (n0, n1) = tile.coords
        a = op.inputs[0]
        return nbytes, 2 * (b1 - b0) * a.shape[1] * a.shape[2] * (n1 - n0)
