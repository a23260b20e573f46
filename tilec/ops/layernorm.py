"""LayerNorm over the last dim: ``out = (x - mean) * rsqrt(var + eps) * weight (+ bias)``.

Operands: x [..., D], weight [D], bias [D] (optional), out [..., D]. Params: eps bits,
has_bias. Tiles: whole rows. Computed in float32.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, bits_f32, f32_bits, out_tiles, register, sub


@register
class LayerNorm(OpDef):
    """``layernorm``: LayerNorm (Ba, Kiros, Hinton 2016, arXiv 1607.06450) over the last dim,
    ``(x - mean) * rsqrt(var + eps) * weight (+ bias)`` in float32
    (``torch.nn.functional.layer_norm``), cast to out's dtype.

    Operands: x [..., D], weight [D], bias [D] (optional), out [..., D]. Params: eps (float32
    bits), has_bias. Tiles: about ``tile_rows`` whole rows.
    """

    kind, opcode = "layernorm", 4

    def tiles(self, op, opts):
        (out,) = op.outputs
        d = out.shape[-1]
        n_in = len(op.inputs)
        reads = lambda box: ((0, box),) + tuple((i, ((0, d),)) for i in range(1, n_in))  # noqa: E731
        return [Tile(box, reads=reads(box), writes=((n_in, box, "write"),)) for box in out_tiles(out.shape, opts.tile_rows)]

    def params(self, op):
        return [f32_bits(op.attr("eps")), int(len(op.inputs) == 3)]

    def run_tile(self, t: TileArgs):
        has_bias = t.params[1]
        x, w = t.operands[0], t.operands[1]
        b = t.operands[2] if has_bias else None
        out = t.operands[-1]
        xs = sub(x, t.coords).float()
        y = torch.nn.functional.layer_norm(xs, (xs.shape[-1],), w.float(), None if b is None else b.float(),
                                           bits_f32(t.params[0]))
        sub(out, t.coords).copy_(y)
