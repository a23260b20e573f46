"""Paged indexer score of DeepSeek Sparse Attention (DeepSeek-V3.2 / GLM-5's lightning indexer).

``out[r, t, j] = ks[j] * sum_h w[r, t, h] * ReLU(scale * q[r, t, h] . k[j])`` over the
``KV = P * page`` cached positions j of request r, whose keys live in the pages
``block_table[r, :]`` of a paged key cache; ``-inf`` for ``j > pos[r, t]`` (causal).
``ks`` is the per-position key scale of an FP8 key cache (1 without one).
Operands: q [R, T, H, D], w [R, T, H], k_cache [pages, page, D], k_scale [pages, page]
(FP8 only), block_table [R, P] (int), pos [R, T] (int), out [R, T, KV] float32.
Params: scale bits, page, has_k_scale, quant, pow2, amin bits, FP8 max bits, w_scale bits, recip.
Tiles: one request x a chunk of whole pages, about one tile per worker.

With attr ``quant = (group, pow2, amin, recip)`` (made by :func:`tilec.passes.fuse_index_quant`) ``q`` is
bf16 and quantized inside the op, per (token, head) row (group = D), as ``fp8_quant`` would, and
the head weights become ``(w * s[r, t, h]) * w_scale`` with each row's scale ``s`` - the float32
products the unfused graph takes (DeepSeek-V3.2's ``fp8_index`` folds the query scales the same way).
The fusion is made only for query shapes the device's tensor-core path takes (:func:`mma_shape`); a
key cache whose pointer is not 16-byte aligned at run time sends a fused tile to the CUDA-core path,
which has no room to stage the queries then and stops the step with an error.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, _elem, bits_f32, chunks, f32_bits, full_box, register
from .fp8_quant import FP8_MAX, quantize


def positions_per_tile(requests: int, pages: int, page: int, workers: int) -> int:
    """Whole pages per tile so that the ``requests x pages`` pages spread over about ``workers`` tiles."""
    per = max(1, -(-requests * pages // max(workers, 1)))
    return min(per, pages) * page


def mma_shape(heads: int, dim: int) -> bool:
    """Whether ``heads`` x ``dim`` queries fit the device's tensor-core path (index_score_mma):
    whole m16 tiles of heads, 32-element chunks of D, D <= 256 (strides and alignment are checked
    at run time as well)."""
    return heads % 16 == 0 and dim % 32 == 0 and dim <= 256


@register
class IndexScore(OpDef):
    """``index_score``: the lightning-indexer score of DeepSeek Sparse Attention (DeepSeek-V3.2 /
    GLM-5) over a paged key cache: ``out[r, t, j] = ks[j] * sum_h w[r, t, h] * ReLU(scale *
    q[r, t, h] . k[j])`` in float32, ``-inf`` for ``j > pos[r, t]`` (module docstring).

    Operands: q [R, T, H, D], w [R, T, H], k_cache [pages, page, D], k_scale [pages, page] (FP8
    cache only), block_table [R, P] int, pos [R, T] int, out [R, T, P * page] float32. Params
    (:meth:`params`): scale bits, page, has_k_scale, then with attr ``quant`` 1, pow2, amin bits,
    FP8 max bits, w_scale bits, recip. Tiles: one request x a chunk of whole pages
    (:func:`positions_per_tile`: about ``workers`` tiles in all); each declares the whole key
    cache read (its pages are looked up at run time). Only the pages of positions up to the
    request's latest ``pos`` are read (later ones may not exist yet; eager gathers every page). A
    page id read counts from the end when negative, as torch indexes; one outside ``[-pages,
    pages)`` is an error (IndexError here; on the device the tile reads page 0 instead and the host
    raises TilecError naming the op at its next check).
    """

    kind, opcode = "index_score", 24

    def tiles(self, op, opts):
        q, w, kc = op.inputs[0], op.inputs[1], op.inputs[2]
        bt = op.inputs[-2]
        n_in = len(op.inputs)
        (out,) = op.outputs
        r_, t_, _, _ = q.shape
        kv = out.shape[2]
        page = kc.shape[1]
        step = positions_per_tile(r_, bt.shape[1], page, opts.workers)
        tiles = []
        for r in range(r_):
            for j0, j1 in chunks(kv, step):
                reads = [(0, ((r, r + 1),) + full_box(q.shape[1:])), (1, ((r, r + 1),) + full_box(w.shape[1:])),
                         (2, full_box(kc.shape))]
                if n_in == 6:
                    reads.append((3, full_box(op.inputs[3].shape)))
                reads += [(n_in - 2, ((r, r + 1), (0, bt.shape[1]))), (n_in - 1, ((r, r + 1), (0, t_)))]
                tiles.append(Tile(((r, r + 1), (j0, j1)), reads=tuple(reads),
                                  writes=((n_in, ((r, r + 1), (0, t_), (j0, j1)), "write"),)))
        return tiles

    def params(self, op):
        base = [f32_bits(op.attr("scale")), op.inputs[2].shape[1], int(len(op.inputs) == 6)]
        quant = op.attr("quant")
        if quant is None:
            return base
        _, pow2, amin, recip = quant
        return base + [1, int(pow2), f32_bits(amin), f32_bits(FP8_MAX), f32_bits(op.attr("w_scale", 1.0)), int(recip)]

    def smem_bytes(self, op):
        """Device staging (runtime/tilec/ops_glm.cuh). Shapes the tensor-core path takes
        (:func:`mma_shape`): the request's queries as bf16 rows (padded), its head weights and its
        tokens' positions. Otherwise a key row per warp (8), the head weights and the queries as
        float (rows padded to D + 1). (Reserving the float staging for GLM-5's 32 x 128 queries
        took the whole kernel's weight ring from 3 stages to 2.)"""
        _, t_, h, d = op.inputs[0].shape
        if mma_shape(h, d):
            rows, ldq = t_ * h, d + ((4 - (d // 8) % 8 + 8) % 8) * 8
            return 4 * (rows * ldq // 2 + rows + t_ + 16) + 64
        return 4 * (8 * d + t_ * h * (d + 2)) + 64

    def run_tile(self, t: TileArgs):
        scale, page, has_ks = bits_f32(t.params[0]), t.params[1], t.params[2]
        q, w, kc = t.operands[0], t.operands[1], t.operands[2]
        bt, pos, out = t.operands[-3], t.operands[-2], t.operands[-1]
        (r0, r1), (j0, j1) = t.coords
        for r in range(r0, r1):
            pages = bt[r, j0 // page:(j1 - 1) // page + 1].long()
            # as the device: only the pages of positions up to the request's latest are read (later
            # ones may not exist yet; their scores are -inf), and only those ids are checked
            read = (torch.arange(len(pages)) + j0 // page) * page <= int(pos[r].max())
            bad = pages[read & ((pages < -kc.shape[0]) | (pages >= kc.shape[0]))]
            if bad.numel():
                raise IndexError(f"block-table page id {int(bad[0])} outside the key cache's {kc.shape[0]} pages")
            pages = torch.where(read, pages, torch.zeros_like(pages))
            first = j0 - (j0 // page) * page
            keys = kc[pages].flatten(0, 1)[first:first + j1 - j0].float()  # [J, D]
            qr, wr = q[r].float(), w[r].float()
            if len(t.params) > 3 and t.params[3]:  # quantized here (fuse_index_quant)
                qq, qs = quantize(qr, qr.shape[-1], bool(t.params[4]), bits_f32(t.params[5]), bits_f32(t.params[6]),
                                  bool(t.params[8]))
                qr, wr = qq.float(), (wr * qs.squeeze(-1)) * bits_f32(t.params[7])
            logits = torch.matmul(qr, keys.t()) * scale  # [T, H, J]
            s = torch.matmul(wr.unsqueeze(-2), torch.relu(logits)).squeeze(-2)  # [T, J]
            if has_ks:
                s = s * t.operands[3][pages].flatten()[first:first + j1 - j0].float()
            later = torch.arange(j0, j1).view(1, -1) > pos[r].long().view(-1, 1)
            out[r, :, j0:j1].copy_(s.masked_fill(later, float("-inf")))

    def cost(self, op, tile):
        q, w, kc = op.inputs[0], op.inputs[1], op.inputs[2]
        (r0, r1), (j0, j1) = tile.coords
        n = r1 - r0
        t_, h, d = q.shape[1:]
        nbytes = n * (t_ * h * d * _elem(q) + t_ * h * _elem(w) + (j1 - j0) * d * _elem(kc) + t_ * (j1 - j0) * 4)
        if len(op.inputs) == 6:
            nbytes += n * (j1 - j0) * _elem(op.inputs[3])
        return nbytes, 2 * n * t_ * h * d * (j1 - j0)
