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
"""
from __future__ import annotations

import dataclasses

from ..ir import Op, OpGraph
from ..ops import leading_rows
from ..ops.linear_fused import staged_bytes

SMEM_LIMIT = 160 * 1024  # bytes of staged rows a fused tile may use (the CTA has 227 KiB)


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
            if p.outputs == (x,) and p.kind == "rmsnorm" and dtype(p.inputs[0]) == dtype(x) \
                    and dtype(p.inputs[1]) == dtype(x):
                inputs, attrs = [p.inputs[0], p.inputs[1]], {"prologue": "rmsnorm", "eps": p.attr("eps")}
            elif p.outputs == (x,) and p.kind == "silu_mul" and dtype(p.inputs[0]) == dtype(x) \
                    and dtype(p.inputs[1]) == dtype(x) and p.inputs[0].shape == x.shape:
                inputs, attrs = [p.inputs[0], p.inputs[1]], {"prologue": "silu_mul"}
        attrs.setdefault("epilogue", "none")
        inputs.append(w)
        final_out = out
        # epilogue: the linear's output read only by one elementwise add of the same shape
        r = readers(out.buffer)
        if out.buffer not in outputs and len(r) == 1 and writers(out.buffer) == [i]:
            a = ops[r[0]]
            if a.kind == "binary" and a.attr("fn") == "add" and out in a.inputs and a.outputs[0].shape == out.shape \
                    and dtype(a.outputs[0]) == dtype(out):
                resid = a.inputs[1] if a.inputs[0] == out else a.inputs[0]
                between = range(i + 1, r[0])
                clobbered = any(ops[j] is not None and any(v.buffer in (resid.buffer, a.outputs[0].buffer)
                                                           for v in ops[j].outputs + ops[j].inputs)
                                for j in between)
                # not y + y: the residual must be another buffer (the GEMV's own output is not written
                # until its epilogue)
                if resid.buffer != out.buffer and resid.shape == out.shape and dtype(resid) == dtype(out) \
                        and not clobbered:
                    inputs.append(resid)
                    attrs["epilogue"] = "add"
                    final_out = a.outputs[0]
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
        if p.outputs != (g,) or not (p.kind == "linear_fused" and p.attr("epilogue") == "none"
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
