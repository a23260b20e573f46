"""Op-level fusion into GEMVs: RMSNorm / SiLU-mul prologues and residual-add epilogues.

A decode step is a chain of ~10 dependent stages per layer, and every stage boundary costs
an event hop between CTAs (~0.8 us on an H200) plus a tail. Three boundaries carry only a few
KiB per row and can be recomputed or applied inside the GEMV tiles instead:

* ``rmsnorm -> linear``: every column tile recomputes the norm of its (whole) input rows;
* ``silu_mul -> linear``: the down projection applies SwiGLU to its input rows;
* ``linear -> add``: the residual add becomes the GEMV's epilogue;

and SwiGLU's SiLU then moves into the gate projection's epilogue (the down projection's
prologue keeps the product only).

The rewrite keeps every rounding point of the unfused ops (``tilec.ops.linear_fused``), so
results are bitwise those of the unfused plan. A producer whose output has no other reader
is dropped. Only bias-free linears whose staged rows fit in shared memory are fused.

The chain's views may differ in their leading dims: under ``torch.compile`` AOTAutograd hands
a linear over as ``mm`` on a ``[rows, K]`` view of the norm's ``[batch, seq, K]`` output, and the
residual add reads the ``mm`` result as ``[batch, seq, N]``. Such views cover the same
contiguous elements with the same last dim (:func:`_same_rows`), and the fused op takes the
producer's operands reshaped to the linear's own shapes.
"""
from __future__ import annotations

import dataclasses
import math

from ..ir import Op, OpGraph, View, contiguous_strides
from ..ops import leading_rows
from ..ops.linear_fused import staged_bytes

SMEM_LIMIT = 160 * 1024  # bytes of staged rows a fused tile may use (the CTA has 227 KiB)


def _same_rows(a: View, b: View) -> bool:
    """True when ``a`` and ``b`` are the same contiguous elements of one buffer, laid out as rows
    of the same length (their leading dims may differ: ``[1, 1, K]`` and ``[1, K]``)."""
    return (a.buffer == b.buffer and a.offset == b.offset and a.pos_stride == b.pos_stride
            and a.numel == b.numel and a.shape[-1:] == b.shape[-1:] and a.is_contiguous() and b.is_contiguous())


def _as_shape(v: View, shape: tuple[int, ...]) -> View | None:
    """``v`` with ``shape`` (as many elements): ``v`` itself when the shapes are equal, a
    reshaped view when ``v`` is contiguous, else None."""
    if v.shape == tuple(shape):
        return v
    return dataclasses.replace(v, shape=tuple(shape), strides=contiguous_strides(tuple(shape))) \
        if v.is_contiguous() and v.numel == math.prod(shape) else None


def fuse_gemv_chains(graph: OpGraph, opts=None) -> OpGraph:
    """Returns ``graph`` with fusable chains rewritten into ``linear_fused`` ops (or ``graph``
    itself when nothing fuses, or ``opts.fuse_gemv`` is off)."""
    if opts is not None and not getattr(opts, "fuse_gemv", True):
        return graph
    ops = list(graph.ops)
    outputs = {v.buffer for v in graph.outputs}

    def readers(buf: str, skip=()) -> list[int]:
        return [i for i, o in enumerate(ops) if o is not None and i not in skip and any(v.buffer == buf for v in o.inputs)]

    def writers(buf: str) -> list[int]:
        return [i for i, o in enumerate(ops) if o is not None and any(v.buffer == buf for v in o.outputs)]

    def dtype(view):
        return graph.buffers[view.buffer].dtype

    changed = False
    for i, op in enumerate(ops):
        if op is None or op.kind != "linear" or len(op.inputs) != 2:
            continue
        x, w = op.inputs
        (out,) = op.outputs
        if staged_bytes(leading_rows(out.shape), x.shape[-1]) > SMEM_LIMIT:
            continue
        inputs, attrs = [x], {"prologue": "none", "epilogue": "none"}
        # prologue: the sole producer of x, read whole
        pw = writers(x.buffer)
        if len(pw) == 1 and pw[0] < i:
            p = ops[pw[0]]
            sole = p.kind in ("rmsnorm", "silu_mul") and (
                p.outputs == (x,) or len(p.outputs) == 1 and _same_rows(p.outputs[0], x))
            a0, a1 = p.inputs[:2] if sole else (None, None)
            if sole and p.kind == "rmsnorm" and dtype(a0) == dtype(x) and dtype(a1) == dtype(x) \
                    and _as_shape(a0, x.shape) is not None:
                inputs, attrs = [_as_shape(a0, x.shape), a1], {"prologue": "rmsnorm", "eps": p.attr("eps")}
            elif sole and p.kind == "silu_mul" and dtype(a0) == dtype(x) and dtype(a1) == dtype(x):
                if a0.shape == x.shape:  # (the up projection's rows may broadcast)
                    inputs, attrs = [a0, a1], {"prologue": "silu_mul"}
                elif a0.shape == a1.shape == p.outputs[0].shape and None not in (_as_shape(a0, x.shape),
                                                                                 _as_shape(a1, x.shape)):
                    inputs, attrs = [_as_shape(a0, x.shape), _as_shape(a1, x.shape)], {"prologue": "silu_mul"}
        attrs.setdefault("epilogue", "none")
        inputs.append(w)
        final_out = out
        # epilogue: the linear's output read only by one elementwise add of the same shape
        r = readers(out.buffer)
        if out.buffer not in outputs and len(r) == 1 and writers(out.buffer) == [i]:
            a = ops[r[0]]
            mine = [k for k, v in enumerate(a.inputs) if v == out or _same_rows(v, out)] if a.kind == "binary" else []
            y = a.outputs[0] if mine else None
            if a.attr("fn") == "add" and len(mine) == 1 and y.shape == a.inputs[mine[0]].shape \
                    and _as_shape(y, out.shape) is not None and dtype(y) == dtype(out):
                resid = a.inputs[1 - mine[0]]
                between = range(i + 1, r[0])
                clobbered = any(ops[j] is not None and any(v.buffer in (resid.buffer, y.buffer)
                                                           for v in ops[j].outputs + ops[j].inputs)
                                for j in between)
                # not y + y: the residual must be another buffer (the GEMV's own output is not written
                # until its epilogue)
                if resid.buffer != out.buffer and resid.shape == y.shape and _as_shape(resid, out.shape) is not None \
                        and dtype(resid) == dtype(out) and not clobbered:
                    inputs.append(_as_shape(resid, out.shape))
                    attrs["epilogue"] = "add"
                    final_out = _as_shape(y, out.shape)
                    ops[r[0]] = None
        if attrs["prologue"] == "none" and attrs["epilogue"] == "none":
            continue
        ops[i] = Op(op.name, "linear_fused", tuple(inputs), (final_out,), tuple(sorted(attrs.items())),
                    op.provenance)
        changed = True
    if not changed:
        return graph
    # drop producers nobody reads any more
    for i, op in enumerate(ops):
        if op is not None and op.kind in ("rmsnorm", "silu_mul"):
            if op.outputs[0].buffer not in outputs and not readers(op.outputs[0].buffer, skip=(i,)):
                ops[i] = None
    # SwiGLU split: a down projection whose prologue is silu_mul(g, u), g written by one GEMV and
    # read by nothing else - that GEMV applies the SiLU as its epilogue (a few columns per
    # tile) and the down projection only multiplies. Its tiles then stage s * u instead of
    # computing silu(g) over all K elements of every tile (same rounding points).
    for i, op in enumerate(ops if getattr(opts, "swiglu_split", True) else ()):
        if op is None or op.kind != "linear_fused" or op.attr("prologue") != "silu_mul":
            continue
        g = op.inputs[0]
        pw = writers(g.buffer)
        if g.buffer in outputs or len(pw) != 1 or readers(g.buffer) != [i] \
                or any(v.buffer == g.buffer for v in op.inputs[1:]):  # u reads g too: silu(h) * h
            continue
        p = ops[pw[0]]
        same = p.outputs == (g,) or len(p.outputs) == 1 and _same_rows(p.outputs[0], g)
        if not same or not (p.kind == "linear_fused" and p.attr("epilogue") == "none"
                            or p.kind == "linear" and len(p.inputs) == 2
                            and staged_bytes(leading_rows(g.shape), p.inputs[0].shape[-1]) <= SMEM_LIMIT):
            continue
        pattrs = dict(p.attrs) if p.kind == "linear_fused" else {"prologue": "none"}
        pattrs["epilogue"] = "silu"
        ops[pw[0]] = Op(p.name, "linear_fused", p.inputs, p.outputs, tuple(sorted(pattrs.items())), p.provenance)
        ops[i] = dataclasses.replace(op, attrs=tuple(sorted({**dict(op.attrs), "prologue": "mul"}.items())))
    kept = [o for o in ops if o is not None]
    used = {v.buffer for o in kept for v in o.inputs + o.outputs} | outputs | {n for n in graph.inputs}
    buffers = {n: b for n, b in graph.buffers.items() if n in used}
    return dataclasses.replace(graph, ops=tuple(kept), buffers=buffers)
