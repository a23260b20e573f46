"""Concatenation along one dim into a new buffer. One tile per input (variant = input index).

Operands: inputs..., out. Params: dim. Coords: the output box of the tile's input.
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, full_box, register, sub


@register
class Concat(OpDef):
    kind, opcode = "concat", 10

    def tiles(self, op, opts):
        dim = op.attr("dim")
        (out,) = op.outputs
        tiles, start = [], 0
        for i, v in enumerate(op.inputs):
            box = list(full_box(out.shape))
            box[dim] = (start, start + v.shape[dim])
            start += v.shape[dim]
            tiles.append(Tile(tuple(box), reads=((i, full_box(v.shape)),), writes=((len(op.inputs), tuple(box), "write"),),
                              variant=i))
        return tiles

    def params(self, op):
        return [op.attr("dim")]

    def run_tile(self, t: TileArgs):
        sub(t.operands[-1], t.coords).copy_(t.operands[t.variant])
