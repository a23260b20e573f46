"""Mixed-dtype elementwise arithmetic and scalar encoding against eager PyTorch (the CPU reference
executor, bitwise): what a fresh user's numerics hunt found (fifty-third session)."""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import Fn
from tilec.api import compile_module
from tilec.ops import bits_f32, f32_bits
from tilec.ops.ewise import UNARY_FNS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_integer_tensor_is_rounded_to_the_16_bit_result_dtype_first(dtype):
    """Eager converts the integer operand to the result's dtype (bf16 / fp16) before the op; tilec's
    binary op reads operands as float32, so 257 + 0.5 gave 257.5 -> 258 where eager gives 256 + 0.5 ->
    256 (16 of 32 elements differed by up to 16)."""
    torch.manual_seed(0)
    x = (torch.randn(4, 96) * 3).to(dtype)
    i = torch.randint(-3000, 3000, (4, 96))
    c = torch.tensor(0.3, dtype=dtype)  # a 0-d tensor read at run time: the int tensor is still rounded
    m = Fn(lambda m, x, i, c: (x + i, x * i, i - x, i + c)).eval()
    got = compile_module(m, (x, i, c))(x, i, c)
    with torch.no_grad():
        want = m(x, i, c)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype and torch.equal(g, w), int((g != w).sum())


@pytest.mark.parametrize("c, fn", [(3.0, lambda m, i: i * m.c), (0.5, lambda m, i: m.c + i)], ids=["mul", "add"])
def test_an_integer_tensor_beside_a_constant_scalar_is_rounded_too(c, fn):
    """The same rounding where the other operand is a one-element constant (the scalar path: a reviewer's
    finding - 88 of 384 elements differed by up to 64 there)."""
    torch.manual_seed(0)
    i = torch.randint(-3000, 3000, (4, 96))
    m = Fn(fn).eval()
    m.register_buffer("c", torch.tensor(c, dtype=torch.bfloat16))
    got = compile_module(m, (i,))(i)
    with torch.no_grad():
        want = m(i)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), int((got != want).sum())


def test_a_scalar_past_float32s_range_is_infinite_as_in_eager():
    """x * 1e39 raised struct's OverflowError (exit 4 from the CLI); eager's float32 arithmetic takes the
    scalar as inf."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    m = Fn(lambda m, x: (x * 1e39, x + 1e39, x * -1e39)).eval()
    got = compile_module(m, (x,))(x)
    with torch.no_grad():
        want = m(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("value, want", [
    (0.1, float(torch.tensor(0.1, dtype=torch.float32))), (1e39, math.inf), (-1e39, -math.inf),
    (3.4028234663852886e38, 3.4028234663852886e38), (1e-50, 0.0), (math.inf, math.inf)])
def test_f32_bits_rounds_to_float32(value, want):
    assert bits_f32(f32_bits(value)) == want


class _Divide(torch.nn.Module):
    """Python numbers' divisors and a tensor made in forward (CPU scalars to eager: CUDA eager multiplies by the float
    reciprocal), a 0-dim buffer's (it moves with the module: the quotient on every device)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.tensor(3.7))

    def forward(self, x):
        return x / 448., x / 3.7, x / torch.tensor(448.), x / self.s


def test_a_scalar_divisor_keeps_eagers_rounding_per_device():
    """Eager divides by a CPU scalar (a Python number, a 0-dim CPU tensor made in forward) exactly on the CPU but, on
    CUDA, multiplies by the float reciprocal (seen on an H100: 558 938 of 2**20 quotients differ); by a parameter or
    buffer, which is on x's device wherever the module runs, it divides exactly on both. The lowering keeps which one
    the source wrote (``div_scalar`` / ``div_exact_scalar``), so each executor can match its device's eager
    (tests/gpu/test_cuda_ops.py: the CUDA executor); the reference executor here is bitwise the CPU's."""
    torch.manual_seed(0)
    x = torch.rand(4, 4096) * 10
    prog = compile_module(_Divide(), (x,))
    assert [op.attr("fn") for op in prog.graph.ops if op.kind == "unary"] == ["div_scalar"] * 3 + ["div_exact_scalar"]
    for got, want in zip(prog(x), _Divide()(x)):
        assert torch.equal(got, want)
    exact = UNARY_FNS["div_exact_scalar"](x, 3.7)
    assert torch.equal(exact, (x.double() / bits_f32(f32_bits(3.7))).float())
    assert not torch.equal(x / 448., x * (1 / 448.))  # the two roundings differ on these inputs


class _Reciprocal(torch.nn.Module):
    def forward(self, x):
        return 3.7 / x, torch.reciprocal(x) + 1, 1 / (x * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reversed_division_lowers_as_eagers_reciprocal(dtype):
    """``3.7 / x`` is ``reciprocal(x) * 3.7`` to torch.export (Tensor.__rtruediv__); reciprocal was refused as an op no
    tilec op computes. It is a unary op now, rounded to x's dtype before the product as eager rounds it: bitwise eager
    on random inputs (tests/gpu/test_cuda_ops.py: the CUDA executor)."""
    torch.manual_seed(0)
    x = torch.randn(4, 256) * 10
    x[0, :4] = torch.tensor([0., -0., float("inf"), torch.finfo(dtype).max / 4])
    x = x.to(dtype)
    prog = compile_module(_Reciprocal(), (x,))
    assert [op.attr("fn") for op in prog.graph.ops if op.kind == "unary"].count("reciprocal") == 3
    for got, want in zip(prog(x), _Reciprocal()(x)):
        assert got.dtype == want.dtype and torch.equal(got.nan_to_num(), want.nan_to_num())


class _TimesOneElement(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.tensor([1001]))

    def forward(self, x):
        return x * self.n, x / self.n


def test_a_one_element_buffer_in_bf16_arithmetic_on_the_cpu_is_read_unrounded():
    """CPU eager's mul and div read a one-element operand unrounded (1001, not bf16's 1000); rounding it to the result
    dtype, as CUDA eager does, is for tensors on a GPU only (a reviewer's case against this session's first form)."""
    torch.manual_seed(0)
    x = (torch.rand(4, 4096) * 10).to(torch.bfloat16)
    m = _TimesOneElement()
    for got, want in zip(compile_module(m, (x,))(x), m(x)):
        assert torch.equal(got, want)


class _ItemScalars(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.tensor(3.7))

    def forward(self, x):
        return x / self.s.item(), x * self.s.item(), self.s.item() - x


def test_a_buffers_item_as_a_scalar_compiles_as_a_python_number():
    """``x / buffer.item()``: the static value is a Python float, not a tensor - the lowering raised an internal
    AttributeError ('float' object has no attribute 'numel'; a reviewer's finding). It is a Python number's scalar
    (a CPU scalar to CUDA eager), bitwise eager here."""
    torch.manual_seed(0)
    x = torch.rand(4, 4096) * 10
    prog = compile_module(_ItemScalars(), (x,))
    assert [op.attr("fn") for op in prog.graph.ops if op.kind == "unary"] == ["div_scalar", "mul_scalar", "rsub_scalar"]
    for got, want in zip(prog(x), _ItemScalars()(x)):
        assert torch.equal(got, want)


class _TrueDivide(torch.nn.Module):
    def forward(self, x, y):
        return torch.true_divide(x, 3.7), torch.true_divide(x, y)


def test_true_divide_is_div():
    """``torch.true_divide``, div's alias, kept its own name through export and was refused as an op no tilec op
    computes (a fresh user's finding); it lowers as ``div``, bitwise eager."""
    torch.manual_seed(0)
    x, y = torch.rand(4, 256) * 10, torch.rand(4, 256) + 0.5
    prog = compile_module(_TrueDivide(), (x, y))
    for got, want in zip(prog(x, y), _TrueDivide()(x, y)):
        assert torch.equal(got, want)
