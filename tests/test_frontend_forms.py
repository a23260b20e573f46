"""Forms other HF decoder families write their layers in (tests/test_hf_architectures.py runs the
families whole), each lowered here alone and compared with eager PyTorch (relative L2 1e-4,
float32 unless said; random inputs): 5-d elementwise intermediates, ``torch.square``, indexing
with a constant index list, ``repeat_interleave``, a LayerNorm written out in torch ops."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import assert_close
from tilec.api import compile_module
from tilec.errors import UnsupportedNodeError
from tilec.frontend import fold_dims
from tilec.ir import View, contiguous_strides


class Fn(torch.nn.Module):
    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            setattr(self, k, torch.nn.Parameter(v))

    def forward(self, *args):
        return self.fn(self, *args)


def run(fn, args, tol=1e-4, **params):
    """Compiles ``fn`` (options: 3 workers), checks every output against eager; the program's ops."""
    m = Fn(fn, **params).eval()
    prog = compile_module(m, args, options={"workers": 3})
    with torch.no_grad():
        want = m(*args)
    got = prog(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close(g, w, tol)
    return prog.plan.graph.ops


def test_five_dim_grouped_qkv_lowers_as_copies_of_fewer_dims():
    """Falcon's new-architecture split: q / k / v read from a [B, S, KV, group + 2, D] view of the
    fused projection; the clones of those 5-d views are 2- to 4-d copies on the same memory."""
    w = torch.randn(4 * 2 * 16, 32) / 6

    def f(m, x):
        qkv = torch.nn.functional.linear(x, m.w).view(1, 1, 2, 4, 16)  # 2 KV groups of 2 queries + k + v
        q = qkv[:, :, :, :-2].flatten(2, 3)
        k = torch.broadcast_to(qkv[:, :, :, -2:-1], (1, 1, 2, 2, 16)).flatten(2, 3)
        return q.transpose(1, 2).contiguous() * 2.0, k.transpose(1, 2).contiguous()

    ops = run(f, (torch.randn(1, 1, 32),), w=w)
    assert all(len(v.shape) <= 4 for op in ops for v in op.inputs + op.outputs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_fold_dims_addresses_the_same_elements(shape, rnd):
    """Every element of the folded views lives where it did unfolded (a random permutation of a
    contiguous buffer, some dims broadcast), and the folded shape has as many elements."""
    shape = tuple(shape)
    order = list(range(len(shape)))
    rnd.shuffle(order)
    base = contiguous_strides(tuple(shape[d] for d in order))
    perm = [0] * len(shape)
    for i, d in enumerate(order):
        perm[d] = base[i]
    bcast = tuple(0 if rnd.random() < 0.3 else s for s in perm)
    views = [View("a", shape, tuple(perm), 3), View("b", shape, bcast, 0), View("c", shape, contiguous_strides(shape))]
    folded = fold_dims(shape, views)
    if folded is None:
        assert sum(n != 1 for n in shape) > 4
        return
    new_shape, new_views = folded
    assert len(new_shape) <= 4 and torch.Size(new_shape).numel() == torch.Size(shape).numel()

    def addresses(v):
        return [v.offset + sum(i * s for i, s in zip(idx, v.strides)) for idx in itertools.product(*map(range, v.shape))]

    for old, new in zip(views, new_views):
        assert addresses(old) == addresses(new)


def test_square_is_a_power():
    """``torch.square`` (ReLU^2 MLPs: Nemotron, Arcee) is the unary pow op with exponent 2."""
    ops = run(lambda m, x: torch.square(torch.relu(x)) * 0.5, (torch.randn(2, 40),))
    assert [(op.kind, op.attr("fn"), op.attr("scalar")) for op in ops if op.kind == "unary"][:2] == \
        [("unary", "relu", 0.0), ("unary", "pow_scalar", 2.0)]


@pytest.mark.parametrize("index", [[-2], [0, 2, 4], [5]])
def test_constant_index_list_in_progression_is_a_view(index):
    """``x[..., [i, i + k, ...], :]`` reads the strided view it equals: no op of its own."""
    ops = run(lambda m, x: x[:, :, index, :] + 1.0, (torch.randn(1, 2, 6, 8),))
    assert [op.kind for op in ops] == ["unary"]


def test_constant_index_list_out_of_progression_is_named():
    with pytest.raises(UnsupportedNodeError, match=r"index \(aten\.index\.Tensor\)"):
        compile_module(Fn(lambda m, x: x[:, [0, 2, 3]] * 2.0).eval(), (torch.randn(2, 5, 4),))


def test_repeat_interleave_of_a_run_time_tensor():
    ops = run(lambda m, x, y: x.repeat_interleave(2, -1) * y, (torch.randn(1, 3, 4), torch.randn(1, 3, 8)))
    assert [op.kind for op in ops] == ["copy", "binary"]


def layernorm_written_out(x, w=None, eps=1e-5):
    """HF ``CohereLayerNorm``: float32 statistics, the weight after, the input dtype back."""
    dtype = x.dtype
    x = x.to(torch.float32)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    return (y if w is None else w.to(torch.float32) * y).to(dtype)


@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_written_out_is_one_layernorm_op(weight, dtype):
    """One layernorm op, read from the bf16 input itself (the op computes in float32); bf16 within
    1e-2 of eager (the rounding of the output)."""
    x = torch.randn(3, 64, dtype=dtype) * 3 + 1
    params = {"w": torch.randn(64, dtype=dtype)} if weight else {}
    ops = run(lambda m, x: layernorm_written_out(x, getattr(m, "w", None)), (x,),
              tol=1e-4 if dtype == torch.float32 else 1e-2, **params)
    kinds = [op.kind for op in ops]
    assert kinds.count("layernorm") == 1 and "binary" not in kinds
    norm = next(op for op in ops if op.kind == "layernorm")
    assert norm.inputs[0].buffer not in {v.buffer for op in ops for v in op.outputs}  # x itself, no cast op
