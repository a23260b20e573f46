"""Elementwise ops: unary (with an optional float scalar) and binary (broadcast views).

The lowering expands every input view to the output shape (stride 0 on broadcast dims),
so a tile reads the same box from every operand. Params: function code (and for unary ops
the scalar's float32 bits). float32 math, cast on store.
"""
from __future__ import annotations

import torch

from . import OpDef, Tile, TileArgs, bits_f32, f32_bits, out_tiles, register, sub

UNARY_FNS = {
    "neg": lambda x, a: -x,
    "silu": lambda x, a: torch.nn.functional.silu(x),
    "relu": lambda x, a: torch.relu(x),
    "gelu": lambda x, a: torch.nn.functional.gelu(x),
    "gelu_tanh": lambda x, a: torch.nn.functional.gelu(x, approximate="tanh"),
    "sigmoid": lambda x, a: torch.sigmoid(x),
    "tanh": lambda x, a: torch.tanh(x),
    "exp": lambda x, a: torch.exp(x),
    "rsqrt": lambda x, a: torch.rsqrt(x),
    "sqrt": lambda x, a: torch.sqrt(x),
    "cos": lambda x, a: torch.cos(x),
    "sin": lambda x, a: torch.sin(x),
    "cast": lambda x, a: x,
    "mul_scalar": lambda x, a: x * a,
    "add_scalar": lambda x, a: x + a,
    "rsub_scalar": lambda x, a: a - x,
    # x / a as eager computes it with a CPU scalar divisor (a Python number): CUDA multiplies by the float
    # reciprocal RN(1 / a), the CPU divides (ATen's div_true_kernel_cuda; torch's own `x / a` here does the same
    # on either device); the CUDA executor multiplies by 1.f / a
    "div_scalar": lambda x, a: x / a,
    "pow_scalar": lambda x, a: x.pow(a),
    "abs": lambda x, a: x.abs(),
    # x / a rounded once on every device: eager's division by a tensor on x's device (a 0-dim buffer)
    "div_exact_scalar": lambda x, a: x / torch.tensor(a, dtype=x.dtype, device=x.device),
    # 1 / x (torch.reciprocal; what export makes of a reversed division `3.7 / x`, then times 3.7)
    "reciprocal": lambda x, a: torch.reciprocal(x),
}
BINARY_FNS = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}
UNARY_CODES = {name: i for i, name in enumerate(UNARY_FNS)}
BINARY_CODES = {name: i for i, name in enumerate(BINARY_FNS)}


def _tiles(op, opts):
    (out,) = op.outputs
    n = len(op.inputs)
    return [Tile(box, reads=tuple((i, box) for i in range(n)), writes=((n, box, "write"),))
            for box in out_tiles(out.shape, opts.tile_rows, opts.tile_cols)]


@register
class Unary(OpDef):
    """``unary``: ``out = fn(x, a)`` elementwise with ``fn`` one of :data:`UNARY_FNS` (neg, SiLU,
    ReLU, GELU (erf / tanh), sigmoid, tanh, exp, rsqrt, sqrt, cos, sin, abs, reciprocal, a dtype cast, and
    ``x * a``, ``x + a``, ``a - x``, ``x / a``, ``x ** a`` with the float scalar a); float32
    math, cast to out's dtype on store. ``x / a`` comes in eager's two roundings: ``div_scalar`` (a Python
    number's divisor: CUDA eager multiplies by the float reciprocal, the CPU divides - each executor matches
    its device's eager) and ``div_exact_scalar`` (a divisor tensor on x's device: one rounding everywhere).

    Operands: x (expanded to out's shape), out. Params: function code (index in UNARY_FNS), scalar
    (float32 bits). Tiles: :func:`~tilec.ops.out_tiles` of out, ``tile_rows`` x ``tile_cols``.
    """

    kind, opcode = "unary", 12

    def tiles(self, op, opts):
        return _tiles(op, opts)

    def params(self, op):
        return [UNARY_CODES[op.attr("fn")], f32_bits(op.attr("scalar", 0.0))]

    def run_tile(self, t: TileArgs):
        x, out = t.operands
        fn = list(UNARY_FNS.values())[t.params[0]]
        sub(out, t.coords).copy_(fn(sub(x, t.coords).float(), bits_f32(t.params[1])))


@register
class Binary(OpDef):
    """``binary``: ``out = fn(a, b)`` elementwise with ``fn`` one of :data:`BINARY_FNS` (add, sub,
    mul, div, maximum, minimum); float32 math, cast to out's dtype on store.

    Operands: a, b (expanded to out's shape: stride 0 on broadcast dims), out. Params: function
    code (index in BINARY_FNS). Tiles: :func:`~tilec.ops.out_tiles` of out, ``tile_rows`` x
    ``tile_cols``.
    """

    kind, opcode = "binary", 13

    def tiles(self, op, opts):
        return _tiles(op, opts)

    def params(self, op):
        return [BINARY_CODES[op.attr("fn")]]

    def run_tile(self, t: TileArgs):
        a, b, out = t.operands
        fn = list(BINARY_FNS.values())[t.params[0]]
        sub(out, t.coords).copy_(fn(sub(a, t.coords).float(), sub(b, t.coords).float()))
