"""GEMV with a fused prologue and epilogue: one round trip instead of three.

``out[..., n] = epi(sum_k pro(inputs)[..., k] * W[n, k])`` where the prologue is

* ``none``: ``x`` itself;
* ``rmsnorm``: ``(x * rsqrt(mean(x^2) + eps)).to(x.dtype) * norm_w`` rounded to x's dtype -
  exactly the ``rmsnorm`` op (HF ``LlamaRMSNorm``), recomputed by every column tile from the
  whole row (a row of a decode step is a few KiB, the weights it multiplies are MiBs);
* ``silu_mul``: ``silu(g).to(g.dtype) * u`` rounded to g's dtype - the ``silu_mul`` op;
* ``mul``: ``s * u`` rounded to s's dtype - the second half of ``silu_mul`` when the GEMV that
  produced g applied the SiLU as its epilogue;

and the epilogue ``none``, ``add``: ``out = acc.to(out.dtype) + resid`` rounded - the
``binary`` add of a residual connection - or ``silu``: ``out = silu(acc.to(out.dtype))``
rounded - the first half of ``silu_mul``. Made by :func:`tilec.passes.fuse_gemv_chains`
(the DESIGN's "RMSNorm into the next GEMV, residual add into the epilogue, SiLU-mul into
the down projection"; Mirage MPK and the Hazy megakernel fuse the same chains).

Operands: the prologue's inputs (x; x, norm_w [K]; or g, u; or s, u), W [N, K], resid [..., N]
(with ``add``), out [..., N]. Side operands (norm_w, u, resid) have the dtype of x (or out).
Params: K, prologue code, epilogue code, eps bits, and (set per tile by the plan) 1 when the
worker's previous instruction left this tile's staged x rows in shared memory. Tiles: all rows x the
column ranges of ``tilec.ops.gemv_col_ranges``;
coords: the out box, then the K range (always whole: the prologue needs whole rows).
"""
from __future__ import annotations

import torch

from . import (GEMV_RING_ROWS, row_cap, OpDef, Tile, TileArgs, bits_f32, f32_bits, gemv_col_ranges, gemv_stream_word, out_tiles, register, sub,
               weight_rows_prefetch)
from .linear import gemv_flops
from .silu_mul import silu

PROLOGUES = {"none": 0, "rmsnorm": 1, "silu_mul": 2, "mul": 3}
EPILOGUES = {"none": 0, "add": 1, "silu": 2}
N_PROLOGUE_INPUTS = {"none": 1, "rmsnorm": 2, "silu_mul": 2, "mul": 2}


def staged_bytes(rows: int, k: int) -> int:
    """Shared memory (bytes) a GEMV tile needs to stage its rows as float32: the rows, per-row
    offsets and norm factors, and slack (device ``linear_impl`` in runtime/tilec/ops.cuh)."""
    return 4 * min(rows, 64) * k + 2560


def ring_staged_bytes(rows: int, k: int) -> int:
    """:func:`staged_bytes` plus what a weight-ring tile adds: for at most
    :data:`~tilec.ops.GEMV_RING_ROWS` rows their bf16 copy, which the CUDA-core consumer reads
    when it fits (else it reads the float rows); for more, up to 16 rows, the tensor-core
    consumer's cross-warp sums (8 warps x 128 floats)."""
    if rows <= GEMV_RING_ROWS:
        return staged_bytes(rows, k) + 2 * rows * k
    return staged_bytes(rows, k) + (4096 if rows <= 16 else 0)


@register
class LinearFused(OpDef):
    """``linear_fused``: a GEMV with a fused prologue (none / rmsnorm / silu_mul / mul) and
    epilogue (none / add / silu), made by :func:`tilec.passes.fuse_gemv_chains`; each keeps the
    rounding points of the ops it replaces (module docstring), float32 accumulation.

    Operands (:meth:`layout`): the prologue's inputs (x [..., K]; or x, norm_w [K]; or g, u; or
    s, u), W [N, K], resid [..., N] (``add``), out [..., N]. Params: K, prologue code, epilogue
    code, eps bits, staged-x flag (param 4, set by the plan). Tiles: all rows x
    :func:`~tilec.ops.gemv_col_ranges` columns over the whole K, each recomputing the prologue of
    its rows; coords: the out box, then (0, K).
    """

    kind, opcode = "linear_fused", 17
    shape_classed = True  # op_<kind><types..., kRowCap>

    def shape_class(self, op):
        """``kRowCap``: the row bound of the device instance (:func:`tilec.ops.row_cap`)."""
        return row_cap(op)

    @staticmethod
    def layout(op):
        """(prologue input count, index of W, index of resid or None) among the op's inputs."""
        npro = N_PROLOGUE_INPUTS[op.attr("prologue")]
        return npro, npro, (npro + 1 if op.attr("epilogue") == "add" else None)

    def tiles(self, op, opts):
        npro, wi, ri = self.layout(op)
        x = op.inputs[0]
        (out,) = op.outputs
        k = x.shape[-1]
        rows = 1
        for s in out.shape[:-1]:
            rows *= s
        out_idx = len(op.inputs)
        tiles = []
        for box in out_tiles(out.shape, max(rows, 1), col_ranges=gemv_col_ranges(op, opts)):
            n0, n1 = box[-1]
            lead = box[:-1] + ((0, k),)
            reads = [(i, lead) for i in range(npro)]
            if op.attr("prologue") == "rmsnorm":
                reads[1] = (1, ((0, k),))
            reads.append((wi, ((n0, n1), (0, k))))
            if ri is not None:
                reads.append((ri, box))
            tiles.append(Tile(box + ((0, k),), reads=tuple(reads), writes=((out_idx, box, "write"),)))
        return tiles

    def prefetch(self, op, tile, graph):
        wi = self.layout(op)[1]
        (n0, n1), (k0, k1) = tile.coords[-2], tile.coords[-1]
        return weight_rows_prefetch(graph, op.inputs[wi], wi, n0, n1, k0, k1)

    def stream(self, op, tile, graph, scratch):
        wi = self.layout(op)[1]
        return gemv_stream_word(graph, op.inputs[0], op.inputs[wi], wi, tile, scratch,
                                prologue=op.attr("prologue") != "none")

    staged_x_param = 4

    def staged_x(self, op, tile):
        """x (and the prologue's side input: the RMSNorm weight, or SiLU-mul's u), the
        prologue, and the tile's rows and K range: what ``stage_bf16_rows`` leaves in shared
        memory (ops.cuh). Tiles of different output columns and epilogues share it."""
        npro = self.layout(op)[0]
        return (op.inputs[:npro], op.attr("prologue"), op.attr("eps", 0.0), tile.coords[:-2], tile.coords[-1])

    def params(self, op):
        return [op.inputs[0].shape[-1], PROLOGUES[op.attr("prologue")], EPILOGUES[op.attr("epilogue")],
                f32_bits(op.attr("eps", 0.0))]

    def device_dtypes(self, op, dtypes):
        """``op_linear_fused<TX, TW, TO>``: side operands share x's (or out's) dtype."""
        return [dtypes[0], dtypes[self.layout(op)[1]], dtypes[-1]]

    def smem_bytes(self, op):
        """:func:`ring_staged_bytes`, or for the CUDA-core consumer's rows :func:`staged_bytes`
        where that leaves the weight ring more stages (``tilec.smem.ring_stages``): the float rows alone, in which the
        device's ring consumer stages bf16 x rows and the prologue's side rows too (``linear_impl``
        in runtime/tilec/ops.cuh; it reads the float rows where bf16 ones cannot be staged). The
        bf16 copy's room had cost Llama-3.2-1B's batch-4 plan its whole ring: the down projection's
        4 x 8192 rows asked 194.5 KiB of the CTA's 225, and no GEMV of the step streamed its weights
        (7.31 ms a step on an H200, against 1.17 at batch 1 and 3.64 at batch 16)."""
        from ..smem import ring_stages

        rows = 1
        for s in op.outputs[0].shape[:-1]:
            rows *= s
        k = op.inputs[0].shape[-1]
        full, floats = ring_staged_bytes(rows, k), staged_bytes(rows, k)
        if rows > GEMV_RING_ROWS or ring_stages(floats) <= ring_stages(full):
            return full  # (the tensor-core consumer's cross-warp sums are not optional)
        return floats

    def run_tile(self, t: TileArgs):
        k, pro, epi, eps = t.params[0], t.params[1], t.params[2], bits_f32(t.params[3])
        npro = 1 if pro == 0 else 2
        box = t.coords[:-1]
        n0, n1 = box[-1]
        lead = box[:-1] + ((0, k),)
        x = t.operands[0]
        xs = sub(x, lead).float()
        if pro == 1:  # the rmsnorm op's rounding points
            y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
            xs = (y.to(x.dtype).float() * t.operands[1].float()).to(x.dtype).float()
        elif pro == 2:  # the silu_mul op's rounding points
            s = silu(xs).to(x.dtype).float()
            xs = (s * sub(t.operands[1], lead).float()).to(x.dtype).float()
        elif pro == 3:  # silu_mul's product (the producer's epilogue applied the SiLU)
            xs = (xs * sub(t.operands[1], lead).float()).to(x.dtype).float()
        w = t.operands[npro]
        out = t.operands[-1]
        acc = xs @ w[n0:n1].float().t()
        if epi == 1:
            acc = acc.to(out.dtype).float() + sub(t.operands[npro + 1], box).float()
        elif epi == 2:  # silu_mul's SiLU of the rounded output
            acc = silu(acc.to(out.dtype).float())
        sub(out, box).copy_(acc)

    def cost(self, op, tile):
        return super().cost(op, tile)[0], gemv_flops(tile)
