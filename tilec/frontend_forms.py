"""Layer forms written in torch ops, each recognized as one tilec op: RMSNorm and LayerNorm written
out (HF ``LlamaRMSNorm``, ``CohereLayerNorm``), SiLU-and-mul, and RoPE in its three layouts
(rotate-half, HF ``apply_rotary_pos_emb``; interleaved in and de-interleaved out, DeepSeek / GLM-5;
pairs rotated in place, GPT-J's ``rotate_every_two``).

A mixin of :class:`tilec.frontend.Lowering`: each pattern method takes the node being lowered and
returns the op's output view, or None when the node is not that form (then the next pattern, and
finally the node's own lowering, is tried).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .fxgraph import CASTS, RESHAPES, Static, aten, is_call, upcast_source, val_of
from .ir import View
from .ops.rope import INTERLEAVED, PAIRWISE, ROTATE_HALF


def _row_mean(n):
    """``mean(v, [-1], keepdim=True)`` -> v, or None (keepdim=False would scale columns, not rows)."""
    if not is_call(n, aten.mean.dim) or list(n.args[1]) not in ([-1], [len(val_of(n).shape) - 1]) \
            or not (n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)):
        return None
    return n.args[0]


def _rsqrt_plus_eps(r):
    """``rsqrt(add(v, eps))`` with a constant eps -> (v, eps), or None."""
    if not is_call(r, aten.rsqrt.default):
        return None
    add = r.args[0]
    if not is_call(add, aten.add.Tensor, aten.add.Scalar) or isinstance(add.args[1], fx.Node):
        return None
    return add.args[0], float(add.args[1])


def _same_value(a, b) -> bool:
    """Whether nodes ``a`` and ``b`` hold the same values: the same node, or float32 upcasts of one value
    (``x.float()`` written twice, as a hand-written RMSNorm may: two nodes unless something merged them)."""
    if a is b:
        return a is not None
    return isinstance(a, fx.Node) and isinstance(b, fx.Node) and is_call(a, *CASTS) and is_call(b, *CASTS) \
        and val_of(a) is not None and val_of(b) is not None and val_of(a).dtype == val_of(b).dtype == torch.float32 \
        and upcast_source(a) is upcast_source(b) and upcast_source(a) is not a


def _squared(n):
    """``pow(v, 2)``, ``square(v)`` or ``v * v`` -> v, or None."""
    if is_call(n, aten.pow.Tensor_Scalar) and n.args[1] == 2:
        return n.args[0]
    if is_call(n, aten.square.default):
        return n.args[0]
    if is_call(n, aten.mul.Tensor) and _same_value(n.args[0], n.args[1]):
        return n.args[0]
    return None


def _centered(n, x=None):
    """``sub(v, mean(v, [-1], keepdim=True))`` -> v, or None; with ``x`` given, only when v is x."""
    if not is_call(n, aten.sub.Tensor) or _row_mean(n.args[1]) is not n.args[0] or (x is not None and n.args[0] is not x):
        return None
    return n.args[0]


def _norm_core(n):
    """``mul(x, rsqrt(add(mean(pow(x, 2), [-1], keepdim=True), eps)))``, or that cast back to the dtype x
    was upcast from (HF ``LlamaRMSNorm``'s ``.to(input_dtype)``) -> (the rmsnorm op's x, eps), or None.

    The op rounds ``x * rsqrt(...)`` to its x's dtype before the weight (``tilec.ops.rmsnorm``): with
    the cast back, its x is the value before the float32 upcast (that rounding); without it, x as
    written (a float32 x: no rounding, as Gemma, OLMo-2 and ``F.rms_norm`` compute)."""
    back = None
    if is_call(n, *CASTS):
        back, n = val_of(n).dtype, n.args[0]
    if not is_call(n, aten.mul.Tensor):
        return None
    for x, r in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        m = _rsqrt_plus_eps(r)
        if m is None or not _same_value(_squared(_row_mean(m[0])), x):
            continue
        if back is None:  # the op rounds x * rsqrt(..) to x's dtype: eager's product must be of that dtype (a
            # float32 rsqrt of bf16 x - mean(.., dtype=torch.float32) - makes a float32 product, unrounded)
            return (x, m[1]) if val_of(n).dtype == val_of(x).dtype else None
        src = upcast_source(x)
        return (src, m[1]) if val_of(src).dtype == back else None
    return None


def _layernorm_core(n):
    """``mul(x - mean(x), rsqrt(add(mean(pow(x - mean(x), 2)), eps)))`` over the last dim (a LayerNorm
    without weight and bias written out, e.g. HF ``CohereLayerNorm``) -> (x, eps) or None. No cast may
    come between (a rounding there is not LayerNorm's)."""
    if not is_call(n, aten.mul.Tensor):
        return None
    for c, r in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        x = _centered(c) if isinstance(c, fx.Node) else None
        m = _rsqrt_plus_eps(r) if x is not None else None
        if m is not None and _centered(_squared(_row_mean(m[0])), x) is not None:
            return x, m[1]
    return None


def _weighted(node, core_of):
    """``mul(w, core)`` with ``core_of(core) -> (x, eps)`` and w a [D] weight of x's rows (a weight that
    broadcasts the rows wider is not the norm's) -> (x, eps, w), or None."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for w, core in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        m = core_of(core) if isinstance(core, fx.Node) and isinstance(w, fx.Node) else None
        wv = val_of(w) if m is not None else None
        if m is not None and wv is not None and wv.dim() == 1 and tuple(val_of(node).shape) == tuple(val_of(m[0]).shape) \
                and wv.shape[0] == val_of(m[0]).shape[-1]:
            return m[0], m[1], w
    return None


def _products(node):
    """For ``add(a * b, c * d)``: each (first product, a factor of the second, the other factor), the
    sum's and the second product's operands taken in both orders (RoPE's ``x*cos + rot(x)*sin``)."""
    if not is_call(node, aten.add.Tensor):
        return
    for m1, m2 in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if is_call(m1, aten.mul.Tensor) and is_call(m2, aten.mul.Tensor):
            yield m1, m2.args[0], m2.args[1]
            yield m1, m2.args[1], m2.args[0]


class FormsLowering:
    def _rmsnorm(self, node: fx.Node):
        """RMSNorm written out (:func:`_norm_core`) times a [D] weight, or alone."""
        found = _weighted(node, _norm_core)
        if found is not None:
            x, eps, w = found
            return self._emit(node, "rmsnorm", [self.view_of(x), self.view_of(w)], attrs=(("eps", eps),))
        m = _norm_core(node)
        if m is not None:
            x, eps = m
            ones = self.as_view(Static(torch.ones(val_of(node).shape[-1], dtype=val_of(x).dtype)), node)
            return self._emit(node, "rmsnorm", [self.view_of(x), ones], attrs=(("eps", eps),))
        return None

    def _layernorm_decomposed(self, node: fx.Node):
        """A LayerNorm written out in torch ops (:func:`_layernorm_core`) times a [D] weight, or alone;
        its x read before a float32 upcast (the op computes in float32: the same values)."""
        found = _weighted(node, _layernorm_core)
        if found is not None:
            x, eps, w = found
            return self._emit(node, "layernorm", [self.view_of(upcast_source(x)), self.view_of(w)], attrs=(("eps", eps),))
        m = _layernorm_core(node)
        if m is not None:
            x, eps = m
            ones = self.as_view(Static(torch.ones(val_of(node).shape[-1], dtype=val_of(node).dtype)), node)
            return self._emit(node, "layernorm", [self.view_of(upcast_source(x)), ones], attrs=(("eps", eps),))
        return None

    def _silu_mul(self, node: fx.Node):
        if not is_call(node, aten.mul.Tensor):
            return None
        a, b = node.args
        for g, u in ((a, b), (b, a)):
            if is_call(g, aten.silu.default) and isinstance(u, fx.Node) and self.cls[u] == "runtime" \
                    and tuple(val_of(g).shape) == tuple(val_of(u).shape) == tuple(val_of(node).shape):
                return self._emit(node, "silu_mul", [self.view_of(g.args[0]), self.view_of(u)])
        return None

    def _rope_args(self, node: fx.Node, x_node, cs, style: int):
        """The rope op of ``node`` over ``x_node`` with tables ``cs = (cos, sin)``, or None when the
        rope op would compute another thing: a result wider than x (cos / sin broadcasting x's rows),
        tables whose last dim is not the style's, a result of another dtype than x's but float32, tables of two dtypes.
        The op rounds each product to its x's dtype; with float32 tables on bf16 / fp16 x (OLMo:
        ``q * cos`` promotes to float32) eager's products are float32, so the op reads x upcast."""
        cos, sin = cs
        xval, want = val_of(x_node), val_of(node)
        d = xval.shape[-1] // 2 if style == INTERLEAVED else xval.shape[-1]
        if tuple(want.shape) != tuple(xval.shape) or not val_of(cos).shape[-1] == val_of(sin).shape[-1] == d:
            return None
        if want.dtype != xval.dtype and not (want.dtype == torch.float32 and xval.dtype in (torch.bfloat16, torch.float16)):
            return None
        if val_of(cos).dtype != val_of(sin).dtype:  # one product rounded to bf16, the other float32 (a fuzzer's case):
            return None                             # the elementwise ops keep eager's rounding points
        x = self.view_of(x_node)
        if len(x.shape) > 4:
            return None
        if want.dtype != xval.dtype:
            x = self._upcast(node, x)
        shape = tuple(val_of(node).shape)
        lead = shape[:-1]
        def table(arg):
            v = self.as_view(self.value(arg), arg)
            k = len(lead) + 1 - len(v.shape)
            strides = [0] * k + [0 if s == 1 and o != 1 else st for s, o, st in zip(v.shape[:-1], lead[k:], v.strides[:-1])]
            return View(v.buffer, lead + (v.shape[-1],), tuple(strides) + (v.strides[-1],), v.offset, v.pos_stride)
        return self._emit(node, "rope", [x, table(cos), table(sin)], attrs=(("style", style),))

    def _rope_rotate_half(self, node: fx.Node):
        """``x * cos + cat([-x[..., h:], x[..., :h]]) * sin`` (HF ``apply_rotary_pos_emb``)."""
        for m1, cat, sin in _products(node):
            if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2:
                continue
            neg, lo = cat.args[0]
            if not (is_call(neg, aten.neg.default) and is_call(neg.args[0], aten.slice.Tensor) and is_call(lo, aten.slice.Tensor)):
                continue
            hi = neg.args[0]
            x = hi.args[0]
            if lo.args[0] is not x or not self._is_halves(x, cat, hi, lo):
                continue
            for xx, cos in ((m1.args[0], m1.args[1]), (m1.args[1], m1.args[0])):
                if xx is x and val_of(cos).shape[-1] == val_of(x).shape[-1]:
                    return self._rope_args(node, x, (cos, sin), ROTATE_HALF)
        return None

    @staticmethod
    def _is_halves(x, cat, hi, lo) -> bool:
        """Whether ``cat`` joins, along x's last dim, ``hi = x[..., D/2:]`` (negated by the caller's
        pattern) then ``lo = x[..., :D/2]``: any other slices or order is not rotate-half RoPE."""
        shape = val_of(x).shape
        if not shape or shape[-1] % 2:
            return False
        ndim, size = len(shape), shape[-1]
        cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if cat_dim % ndim != ndim - 1:
            return False
        def bounds(s):
            a = list(s.args[1:]) + [None] * (5 - len(s.args))
            dim = a[0] if a[0] is not None else s.kwargs.get("dim", 0)
            start = a[1] if a[1] is not None else s.kwargs.get("start")
            end = a[2] if a[2] is not None else s.kwargs.get("end")
            step = a[3] if a[3] is not None else s.kwargs.get("step", 1)
            if not all(isinstance(v, int) for v in (dim, step)) or dim % ndim != ndim - 1 or step != 1:
                return None
            start, end = (0 if start is None else start), (size if end is None else end)
            if not (isinstance(start, int) and isinstance(end, int)):
                return None
            start, end = (v + size if v < 0 else v for v in (start, end))
            return max(0, min(start, size)), max(0, min(end, size))
        return bounds(hi) == (size // 2, size) and bounds(lo) == (0, size // 2)

    def _rope_interleaved(self, node: fx.Node):
        """``cat([x1*c - x2*s, x2*c + x1*s])`` with ``x1, x2 = x[..., 0::2], x[..., 1::2]``
        (HF ``apply_rotary_pos_emb_interleave``, DeepSeek-V3 / GLM-5; HF's GLM and GLM-4 rotate pairs in
        place instead: :meth:`_rope_pairwise`)."""
        if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
            return None
        first, second = node.args[0]
        if not (is_call(first, aten.sub.Tensor) and is_call(second, aten.add.Tensor)):
            return None
        def prod(m):
            return (m.args[0], m.args[1]) if is_call(m, aten.mul.Tensor) else None
        a, b, c, d = prod(first.args[0]), prod(first.args[1]), prod(second.args[0]), prod(second.args[1])
        if None in (a, b, c, d):
            return None
        x1, cos = a
        x2, sin = b
        if not (is_call(x1, aten.slice.Tensor) and is_call(x2, aten.slice.Tensor)):
            return None
        last = len(val_of(x1).shape) - 1
        if x1.args[0] is not x2.args[0] or len(x1.args) != 5 or len(x2.args) != 5 \
                or x1.args[1] % (last + 1) != last or x1.args[1:] != (x1.args[1], 0, x1.args[3], 2) \
                or x2.args[1:] != (x1.args[1], 1, x2.args[3], 2):
            return None
        if set(c) != {x2, cos} or set(d) != {x1, sin}:
            return None
        return self._rope_args(node, x1.args[0], (cos, sin), INTERLEAVED)

    @staticmethod
    def _every_other(s, x, start: int) -> bool:
        """Whether ``s`` is ``x[..., start::2]`` (an ``aten.slice`` of x's last dim, step 2, to the end)."""
        if not is_call(s, aten.slice.Tensor) or s.args[0] is not x:
            return False
        _, dim, begin, end, step = (list(s.args) + [0, None, None, 1][len(s.args) - 1:])[:5]
        shape = val_of(x).shape
        return dim % len(shape) == len(shape) - 1 and begin == start and step == 2 \
            and (end is None or end >= shape[-1])

    def _rope_pairwise(self, node: fx.Node):
        """``x*cos + flatten(stack([-x[..., 1::2], x[..., 0::2]], -1)) * sin``: each pair (2i, 2i+1)
        rotated in place (GPT-J's ``rotate_every_two``; HF GLM / GLM-4, Cohere, Helium, ERNIE-4.5)."""
        for m1, flat, sin in _products(node):
            upcast = is_call(flat, *CASTS) and val_of(flat).dtype == torch.float32  # ERNIE-4.5: rot(q).float()
            if upcast:
                flat = flat.args[0]
            if not (is_call(flat, *RESHAPES) and is_call(flat.args[0], aten.stack.default)):
                continue
            stack = flat.args[0]
            parts = stack.args[0]
            dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
            if len(parts) != 2 or not is_call(parts[0], aten.neg.default):
                continue
            odd, even = parts[0].args[0], parts[1]
            x = even.args[0] if is_call(even, aten.slice.Tensor) else None
            if x is None or not (self._every_other(even, x, 0) and self._every_other(odd, x, 1)):
                continue
            shape = tuple(val_of(x).shape)
            if shape[-1] % 2 or dim % (len(shape) + 1) != len(shape) or tuple(val_of(flat).shape) != shape:
                continue
            for xx, cos in ((m1.args[0], m1.args[1]), (m1.args[1], m1.args[0])):
                # the product's x: x itself, or (when the rotated half is upcast too) x upcast to float32,
                # the op's x then (its products rounded to float32, as eager's are)
                same = xx is x if not upcast else (is_call(xx, *CASTS) and xx.args[0] is x and val_of(xx).dtype
                                                   == torch.float32 and val_of(x).dtype in (torch.bfloat16,
                                                                                            torch.float16))
                if same and val_of(cos).shape[-1] == val_of(sin).shape[-1] == shape[-1]:
                    return self._rope_args(node, xx, (cos, sin), PAIRWISE)
        return None
