"""fold_casts: a float32 op's output cast folded into the op (tilec/passes/fold_casts.py).

The folded program must give bitwise the results of the unfolded one (the same float32 value is
rounded once, to the cast's dtype); random bf16 inputs, the reference executor."""
from __future__ import annotations

import torch

from _helpers import Fn
from tilec.api import compile_module


def gemma_norm(m, x):
    """HF ``GemmaRMSNorm``: float32 statistics and weight, the input dtype back."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (y * (1.0 + m.w.float())).type_as(x)


def both(fn, args, **params):
    """The programs with fold_casts off and on and their outputs (bitwise equal, asserted)."""
    m = Fn(fn, **params).eval()
    progs = [compile_module(m, args, options={"workers": 3, "fold_casts": on}) for on in (False, True)]
    outs = [p(*args) for p in progs]
    outs = [o if isinstance(o, tuple) else (o,) for o in outs]
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with torch.no_grad():
        want = m(*args)
    for a, w in zip(outs[1], want if isinstance(want, tuple) else (want,)):
        assert a.dtype == w.dtype and ((a.float() - w.float()).norm() / w.float().norm()) < 1e-2
    return [[(op.kind, op.attr("fn") if op.kind == "unary" else None) for op in p.plan.graph.ops] for p in progs]


def test_a_norm_cast_back_folds_into_the_norm():
    """Gemma's norm, then a projection: the cast back to bf16 folds into the RMSNorm (which then
    writes the bf16 rows the GEMV reads): one dependent op fewer."""
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w, proj = torch.randn(64, dtype=torch.bfloat16) / 4, torch.randn(32, 64, dtype=torch.bfloat16) / 8
    off, on = both(lambda m, x: torch.nn.functional.linear(gemma_norm(m, x), m.proj), (x,), w=w, proj=proj)
    # x.float(), w.float(), 1 + w, the norm of float32 rows (no rounding before the weight, as Gemma's), the cast back
    assert off == [("unary", "cast"), ("unary", "cast"), ("unary", "add_scalar"), ("rmsnorm", None), ("unary", "cast"),
                   ("linear", None)]
    assert on == off[:4] + [("linear", None)]


def test_softmax_and_rope_casts_fold():
    x = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)

    def f(m, x, c, s):
        xf = x.float()
        rot = torch.stack((-xf[..., 1::2], xf[..., 0::2]), -1).flatten(-2)
        return (xf * c + rot * s).to(x.dtype), torch.softmax(xf * 2.0, -1).to(x.dtype)

    off, on = both(f, (x, cos, sin))
    assert off.count(("unary", "cast")) - on.count(("unary", "cast")) == 2


def test_no_fold_when_the_float32_value_is_also_used():
    """The float32 result is an output too: the cast stays (the op must still write float32)."""
    x = torch.randn(3, 32, dtype=torch.bfloat16)

    def f(m, x):
        s = torch.softmax(x.float(), -1)
        return s, s.to(x.dtype)

    off, on = both(f, (x,))
    assert on == off and ("unary", "cast") in on


def test_no_fold_into_an_integer_cast():
    """A cast to an integer dtype is left alone (an integer result is not a rounding of the float32
    value on store)."""
    x = torch.randn(3, 32)
    off, on = both(lambda m, x: (x * 10.0).to(torch.int32), (x,))
    assert on == off and ("unary", "cast") in on
