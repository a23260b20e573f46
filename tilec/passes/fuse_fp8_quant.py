"""Op-level fusion: FP8 activation quantization into the FP8 GEMMs that read it.

``fp8_quant(x) -> (q, scale) -> fp8_linear(q, scale, wq, ws)`` becomes
``fp8_linear_quant(x, wq, ws)`` (``tilec.ops.fp8_linear.Fp8LinearQuant``): every GEMM tile
quantizes its (at most 16) bf16 rows while it stages them. On GLM-5's prelude the quantization
ops were whole dependent stages of 25-57 µs for 24-196 KiB of activations (H200 trace,
2026-12-01); a tile re-quantizing 16 rows costs a few round trips to L2 instead. The quantized
values are those of the unfused op (the same max, correctly rounded division and saturating
cast; on the reference executor the same torch code), so results do not change. A quantization
whose outputs have no other reader is dropped.

Fused when: x is bf16 with at most 16 rows, the group is a multiple of 64 dividing K, the scale
floor ``amin`` is at least :data:`MIN_AMIN`, the quantized values and scales are temporaries (or
program outputs) only the quantization writes, the GEMM reads them whole, and nothing writes x between the two ops.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir import BufferKind, Op, OpGraph
from ..ops.fp8_linear import QUANT_ROWS


def _rows(view) -> int:
    n = 1
    for s in view.shape[:-1]:
        n *= s
    return n


# The fused tiles divide by the group's scale as x * RN(1/s) plus a correction, which needs 1/s
# finite: s = max(amax, amin) / 448 >= 2^-126 (GLM-5 / DeepSeek-V3 use amin 1e-4).
MIN_AMIN = 448.0 * 2.0 ** -126


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
        if graph.buffers[x.buffer].dtype != torch.bfloat16 or _rows(x) > QUANT_ROWS or g % 64 or k % g \
                or q.attr("amin") < MIN_AMIN:
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
                                          "amin": q.attr("amin"), "stream": stream}.items())), op.provenance)
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
