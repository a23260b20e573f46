"""Paged indexer score of DeepSeek Sparse Attention (DeepSeek-V3.2 / GLM-5's lightning indexer).

``out[r, t, j] = ks[j] * sum_h w[r, t, h] * ReLU(scale * q[r, t, h] . k[j])`` over the
``KV = P * page`` cached positions j of request r, whose keys live in the pages
``block_table[r, :]`` of a paged key cache; ``-inf`` for ``j > pos[r, t]`` (causal).
``ks`` is the per-position key scale of an FP8 key cache (1 without one).
Operands: q [R, T, H, D], w [R, T, H], k_cache [pages, page, D], k_scale [pages, page]
(FP8 only), block_table [R, P] (int), pos [R, T] (int), out [R, T, KV] float32.
Params: scale bits, page, has_k_scale. Tiles: one request x a chunk of whole pages, about
one tile per worker.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, _elem, bits_f32, chunks, f32_bits, full_box, register


def positions_per_tile(requests: int, pages: int, page: int, workers: int) -> int:
    """Whole pages per tile so that the ``requests x pages`` pages spread over about ``workers`` tiles."""
    per = max(1, -(-requests * pages // max(workers, 1)))
    return min(per, pages) * page


@register
class IndexScore(OpDef):
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
        return [f32_bits(op.attr("scale")), op.inputs[2].shape[1], int(len(op.inputs) == 6)]

    def smem_bytes(self, op):
        """Device staging (runtime/tilec/ops_glm.cuh): a key row per warp (8), the request's
        head weights and its queries as float (rows padded to D + 1)."""
        _, t_, h, d = op.inputs[0].shape
        return 4 * (8 * d + t_ * h * (d + 2)) + 64

    def run_tile(self, t: TileArgs):
        scale, page, has_ks = bits_f32(t.params[0]), t.params[1], t.params[2]
        q, w, kc = t.operands[0], t.operands[1], t.operands[2]
        bt, pos, out = t.operands[-3], t.operands[-2], t.operands[-1]
        (r0, r1), (j0, j1) = t.coords
        for r in range(r0, r1):
            pages = bt[r, j0 // page:(j1 - 1) // page + 1].long()
            first = j0 - (j0 // page) * page
            keys = kc[pages].flatten(0, 1)[first:first + j1 - j0].float()  # [J, D]
            logits = torch.matmul(q[r].float(), keys.t()) * scale  # [T, H, J]
            s = torch.matmul(w[r].float().unsqueeze(-2), torch.relu(logits)).squeeze(-2)  # [T, J]
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
