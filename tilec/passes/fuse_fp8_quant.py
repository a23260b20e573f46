"""Op-level fusion: FP8 activation quantization into the ops that read it - the FP8 GEMMs
(:func:`fuse_fp8_quant`) and the lightning indexer's score (:func:`fuse_index_quant`).

``fp8_quant(x) -> (q, scale) -> fp8_linear(q, scale, wq, ws)`` becomes
``fp8_linear_quant(x, wq, ws)`` (``tilec.ops.fp8_linear.Fp8LinearQuant``): every GEMM tile
quantizes its (at most 16) bf16 rows while it stages them. On GLM-5's prelude the quantization
ops were whole dependent stages of 25-57 µs for 24-196 KiB of activations (H200 trace,
2026-12-01); a tile re-quantizing 16 rows costs a few round trips to L2 instead. The quantized
values are those of the unfused op for finite x (the same max, correctly rounded division and
saturating cast; on the reference executor the same torch code), so results do not change; for
non-finite x the GPU paths differ (runtime/tilec/ops_glm.cuh stage_quant_rows). A quantization
whose outputs have no other reader is dropped.

Fused when: x is bf16 with at most 16 rows, the group is a multiple of 64 dividing K, the scale
floor ``amin`` is at least :data:`MIN_AMIN`, the quantized values and scales are temporaries (or
program outputs) only the quantization writes, the GEMM reads them whole, and nothing writes x
between the two ops.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir import BufferKind, Op, OpGraph
from ..ops import leading_rows
from ..ops.fp8_linear import QUANT_ROWS
from ..ops.index_score import mma_shape


# The fused tiles divide by the group's scale as x * RN(1/s) plus a correction: correctly rounded
# wherever the quotient is not FP8 zero once s = max(amax, amin) / 448 >= 2^-100 (for smaller s a
# subnormal x's residual underflows and can flip an e4m3 rounding tie; the device takes its
# true-division path there too). GLM-5 / DeepSeek-V3 use amin 1e-4.
MIN_AMIN = 448.0 * 2.0 ** -100


def fuse_fp8_quant(graph: OpGraph, opts=None) -> OpGraph:
    """Returns ``graph`` with ``fp8_quant -> fp8_linear`` pairs rewritten into ``fp8_linear_quant``
    ops (or ``graph`` itself when nothing fuses, or ``opts.fuse_fp8_quant`` is off). The fused ops
    stream their weights through the worker's ring unless ``opts.fp8_stream`` is off."""
    if opts is not None and not getattr(opts, "fuse_fp8_quant", True):
        return graph
    stream = True if opts is None else bool(getattr(opts, "fp8_stream", True))
    ops = list(graph.ops)
    outputs = {v.buffer for v in graph.outputs}
    changed = False
    for i, q in enumerate(ops):
        if q.kind != "fp8_quant":
            continue
        (x,), (qv, sv) = q.inputs, q.outputs
        g, k = q.attr("group"), x.shape[-1]
        if graph.buffers[x.buffer].dtype != torch.bfloat16 or leading_rows(x.shape) > QUANT_ROWS \
                or g % 64 or k % g or q.attr("amin") < MIN_AMIN:
            continue
        # the quantization's outputs: temporaries or program outputs it alone writes (not state)
        if any(graph.buffers[v.buffer].kind not in (BufferKind.TEMP, BufferKind.OUTPUT) for v in (qv, sv)) \
                or any(o is not q and o is not None and any(v.buffer in (qv.buffer, sv.buffer) for v in o.outputs)
                       for o in ops):
            continue
        fused = others = False
        for j in range(i + 1, len(ops)):
            op = ops[j]
            if op is None or not any(v.buffer in (qv.buffer, sv.buffer) for v in op.inputs):
                continue
            clobbered = any(ops[m] is not None and any(v.buffer == x.buffer for v in ops[m].outputs)
                            for m in range(i + 1, j))
            if op.kind == "fp8_linear" and op.inputs[0] == qv and op.inputs[1] == sv and not clobbered:
                ops[j] = Op(op.name, "fp8_linear_quant", (x, op.inputs[2], op.inputs[3]), op.outputs,
                            tuple(sorted({"block_n": op.attr("block_n"), "group": g, "pow2": q.attr("pow2"),
                                          "amin": q.attr("amin"), "recip": q.attr("recip", False),
                                          "stream": stream}.items())), op.provenance)
                fused = changed = True
            else:
                others = True
        if not others and qv.buffer not in outputs and sv.buffer not in outputs and fused:
            ops[i] = None
    if not changed:
        return graph
    kept = [o for o in ops if o is not None]
    used = {v.buffer for o in kept for v in o.inputs + o.outputs} | outputs | set(graph.inputs)
    return dataclasses.replace(graph, ops=tuple(kept), buffers={n: b for n, b in graph.buffers.items() if n in used})


def _whole(graph: OpGraph, view) -> bool:
    """``view`` covers its buffer exactly, contiguously (so another whole buffer of the same size
    can stand in for it element for element)."""
    return view.offset == 0 and view.pos_stride == 0 and view.is_contiguous() \
        and view.numel == graph.buffers[view.buffer].numel


def fuse_index_quant(graph: OpGraph, opts=None) -> OpGraph:
    """Returns ``graph`` with the lightning indexer's query quantization folded into its score
    (or ``graph`` itself when nothing matches, or ``opts.fuse_fp8_quant`` is off):

        q, s = fp8_quant(x)             (one group per query row: group = D)
        w' = (w * s) * c                (binary mul, then unary mul_scalar, float32)
        index_score(q, w', keys, ...)

    becomes ``index_score(x, w, keys, ...)`` with attrs ``quant`` and ``w_scale = c``: each score
    tile quantizes its request's query rows and scales the head weights itself (the same float32
    operations in the same order, so the same scores), and three dependent stages are gone. Only
    when the intermediates have no other reader, every view involved covers its whole buffer and
    the queries fit the device's tensor-core path (``tilec.ops.index_score.mma_shape``: its
    fallback quantizes staged float rows, for which the plan reserves no room then).
    """
    if opts is not None and not getattr(opts, "fuse_fp8_quant", True):
        return graph
    ops = list(graph.ops)
    outputs = {v.buffer for v in graph.outputs}

    def writer(buf: str) -> int | None:
        w = [i for i, o in enumerate(ops) if o is not None and any(v.buffer == buf for v in o.outputs)]
        return w[0] if len(w) == 1 else None

    def readers(buf: str) -> list[int]:
        return [i for i, o in enumerate(ops) if o is not None and any(v.buffer == buf for v in o.inputs)]

    def dtype(view):
        return graph.buffers[view.buffer].dtype

    changed = False
    for i, sc in enumerate(ops):
        if sc is None or sc.kind != "index_score" or sc.attr("quant") is not None:
            continue
        qv, wv = sc.inputs[0], sc.inputs[1]
        iq, im2 = writer(qv.buffer), writer(wv.buffer)
        if iq is None or im2 is None or ops[iq].kind != "fp8_quant" or ops[im2].kind != "unary" \
                or ops[im2].attr("fn") != "mul_scalar":
            continue
        quant, m2 = ops[iq], ops[im2]
        (x,), (q_out, s_out) = quant.inputs, quant.outputs
        im1 = writer(m2.inputs[0].buffer)
        if im1 is None or ops[im1].kind != "binary" or ops[im1].attr("fn") != "mul":
            continue
        m1 = ops[im1]
        scale_side = [k for k, v in enumerate(m1.inputs) if v.buffer == s_out.buffer]
        if len(scale_side) != 1:
            continue
        w_pre = m1.inputs[1 - scale_side[0]]
        views = (qv, wv, x, q_out, s_out, w_pre, m1.inputs[scale_side[0]], m1.outputs[0], m2.inputs[0], m2.outputs[0])
        inter = (q_out.buffer, s_out.buffer, m1.outputs[0].buffer, m2.outputs[0].buffer)
        if quant.attr("group") != x.shape[-1] or quant.attr("group") != qv.shape[3] \
                or not mma_shape(qv.shape[2], qv.shape[3]) \
                or any(graph.buffers[b].kind != BufferKind.TEMP for b in (q_out.buffer, s_out.buffer,
                                                                         m1.outputs[0].buffer, wv.buffer)) \
                or dtype(x) != torch.bfloat16 or dtype(w_pre) != torch.float32 \
                or dtype(m1.outputs[0]) != torch.float32 or dtype(m2.outputs[0]) != torch.float32 \
                or not all(_whole(graph, v) for v in views) or any(b in outputs for b in inter) \
                or graph.buffers[x.buffer].numel != graph.buffers[q_out.buffer].numel \
                or graph.buffers[w_pre.buffer].numel != graph.buffers[wv.buffer].numel \
                or readers(q_out.buffer) != [i] or readers(s_out.buffer) != [im1] \
                or readers(m1.outputs[0].buffer) != [im2] or readers(wv.buffer) != [i]:
            continue
        # nothing may write x after the quantization read it, or w after the multiply did
        def written(buf: str, lo: int) -> bool:
            return any(ops[m] is not None and any(v.buffer == buf for v in ops[m].outputs) for m in range(lo + 1, i))

        if written(x.buffer, iq) or written(w_pre.buffer, im1):
            continue
        new_q = dataclasses.replace(qv, buffer=x.buffer)
        new_w = dataclasses.replace(wv, buffer=w_pre.buffer)
        attrs = dict(sc.attrs)
        attrs.update(quant=(quant.attr("group"), quant.attr("pow2"), quant.attr("amin"), quant.attr("recip", False)),
                     w_scale=m2.attr("scalar"))
        ops[i] = Op(sc.name, sc.kind, (new_q, new_w) + sc.inputs[2:], sc.outputs, tuple(sorted(attrs.items())),
                    sc.provenance)
        ops[iq] = ops[im1] = ops[im2] = None
        changed = True
    if not changed:
        return graph
    kept = [o for o in ops if o is not None]
    used = {v.buffer for o in kept for v in o.inputs + o.outputs} | outputs | set(graph.inputs)
    return dataclasses.replace(graph, ops=tuple(kept), buffers={n: b for n, b in graph.buffers.items() if n in used})
