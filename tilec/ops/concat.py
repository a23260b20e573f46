"""Concatenation along one dim into a new buffer. Tiles: per input (variant = input index);
along the last dim, each input is split into row chunks (``tile_rows``) so a large input is
copied by several workers.

Operands: inputs..., out. Params: dim. Coords: the output box of the tile (its ``dim`` range
is the whole slab of its input).
"""
from __future__ import annotations

from . import OpDef, Tile, TileArgs, full_box, out_tiles, register, sub


@register
class Concat(OpDef):
    """``concat``: ``out = cat(inputs, dim)`` into a new buffer, cast to out's dtype.

    Operands: the inputs (out's shape but along ``dim``; the CUDA codegen takes one dtype for all
    of them), out. Params: dim. Tiles: per input (variant = input index) its whole slab of out;
    when ``dim`` is the last dim, each input in row chunks (``tile_rows``). Coords: the out box.
    """

    kind, opcode = "concat", 10

    def tiles(self, op, opts):
        dim = op.attr("dim")
        (out,) = op.outputs
        tiles, start = [], 0
        for i, v in enumerate(op.inputs):
            last = dim == len(out.shape) - 1
            for box in out_tiles(v.shape, opts.tile_rows) if last else [full_box(v.shape)]:
                obox = list(box)
                obox[dim] = (start, start + v.shape[dim])
                tiles.append(Tile(tuple(obox), reads=((i, box),), writes=((len(op.inputs), tuple(obox), "write"),),
                                  variant=i))
            start += v.shape[dim]
        return tiles

    def params(self, op):
        return [op.attr("dim")]

    def run_tile(self, t: TileArgs):
        dim, x = t.params[0], t.operands[t.variant]
        ibox = list(t.coords)
        ibox[dim] = (0, x.shape[dim])
        sub(t.operands[-1], t.coords).copy_(sub(x, tuple(ibox)))
