"""FP8 quantization in groups along the last dim (DeepSeek-V3's ``act_quant``).

For each group of ``G`` consecutive elements: ``s = max(amax(|x|), amin) / 448`` (with
``recip``: ``* (1 / 448)``, a float32 product, as the source wrote it; on CUDA both forms are that
product, as eager's division by a Python number is there; rounded up to a power of two with
``pow2``), ``q = clamp(x / s, -448, 448)`` cast to float8_e4m3fn (round to nearest even). Used for
GEMM activations (G = 128 per token), indexer keys (one scale per position) and indexer queries (one
scale per token and head).
Operands: x [..., K], q [..., K] float8_e4m3fn, scale [..., K/G] float32.
Params: G, pow2, amin bits, fp8 max bits, recip. Tiles: rows x whole last dim (``tile_rows``).
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, bits_f32, f32_bits, out_tiles, register, sub

FP8_MAX = 448.0


def quantize(x: torch.Tensor, group: int, pow2: bool, amin: float, fmax: float = FP8_MAX, recip: bool = False):
    """``(q, scale)`` of float32 ``x [..., K]`` (the same torch ops the eager pattern uses; with
    ``recip`` the scale is ``max(amax, amin) * (1 / fmax)``, which rounds differently from the quotient on the
    CPU; on a CUDA tensor torch computes the quotient as that product, as the CUDA executor does)."""
    xg = x.unflatten(-1, (-1, group))
    a = xg.abs().amax(-1, keepdim=True).clamp(min=amin)
    s = a * (1.0 / fmax) if recip else a / fmax
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xg / s).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


@register
class Fp8Quant(OpDef):
    """``fp8_quant``: FP8 (e4m3) quantization in groups of G along the last dim (DeepSeek-V3's
    ``act_quant``; :func:`quantize`): per group ``s = max(amax|x|, amin) / 448`` (attr ``recip``:
    ``* (1 / 448)``, the source's product with the reciprocal; a power of two, rounded up, with
    ``pow2``), ``q = clamp(x / s, -448, 448)`` cast to float8_e4m3fn.

    Operands: x [..., K], q [..., K] float8_e4m3fn, scale [..., K/G] float32. Params: G, pow2,
    amin (float32 bits), FP8 max 448 (float32 bits), recip. Tiles: ``tile_rows`` rows x the whole last
    dim (a row's groups and scales in one tile).
    """

    kind, opcode = "fp8_quant", 20

    def tiles(self, op, opts):
        (x,) = op.inputs
        q, s = op.outputs
        ng = s.shape[-1]
        return [Tile(box, reads=((0, box),), writes=((1, box, "write"), (2, box[:-1] + ((0, ng),), "write")))
                for box in out_tiles(q.shape, opts.tile_rows)]

    def params(self, op):
        return [op.attr("group"), int(op.attr("pow2")), f32_bits(op.attr("amin")), f32_bits(FP8_MAX),
                int(op.attr("recip", False))]

    def run_tile(self, t: TileArgs):
        x, q, s = t.operands
        group, pow2, amin, fmax = t.params[0], t.params[1], bits_f32(t.params[2]), bits_f32(t.params[3])
        box = t.coords
        qv, sv = quantize(sub(x, box).float(), group, bool(pow2), amin, fmax, bool(t.params[4]))
        sub(q, box).copy_(qv)
        sub(s, box[:-1] + ((0, s.shape[-1]),)).copy_(sv)
