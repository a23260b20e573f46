"""Shared memory of a worker CTA: the GEMV weight ring, then the ops' scratch.

The CUDA executor gives every worker one dynamic shared-memory block (at most
:data:`MAX_DYNAMIC_SMEM` bytes on Hopper). Its front holds the weight ring that the loader
warp fills (``runtime/tilec/stream.cuh``): ``ring_stages`` stages of :data:`STAGE_BYTES`.
The rest is the scratch every op's tiles share, sized for the hungriest op of the plan.
A plan with too little room left for two stages streams no weights through the ring.
"""
from __future__ import annotations

from . import ops as opreg
from .errors import TilecError
from .ir import OpGraph
from .ops import GEMV_STAGE_MAX, kouter_bytes, kouter_rows
from .ops.linear_fused import ring_staged_bytes, staged_bytes

# Hopper's 227 KiB per CTA less room for the executor's static shared memory (4064 bytes with 13-operand
# rows and the controller warp's second operand slot and GEMV setups, nvcc 13: tests/test_codegen.py
# checks it fits; the 1 KiB the system reserves is outside the 227)
MAX_DYNAMIC_SMEM = 227 * 1024 - 4096
STAGE_BYTES = 8 * (2048 * 2 + 64)  # stream.cuh: kWarps rows of kStreamK bf16, 64 bytes of padding each
# Three stages (96 KiB in flight per SM). Measured on an H200 on 2026-11-29 (session 6, call 3,
# benchmarks/decode.py --ring-stages): a Llama-3.2-1B step (batch 1, context 1024) took 1.769 /
# 1.721 / 1.728 / 1.879 ms with 2 / 3 / 4 / 5 stages, and 8 independent M = 1 GEMVs streamed
# 2.44 / 2.77 / 2.81 / 2.53 TB/s (2048 x 8192), 3.31 / 3.61 / 3.53 (4096 x 14336) and
# 3.39 / 3.66 / 3.73 / 3.74 (128256 x 2048). Deeper rings leave less of the SM's 256 KiB to the
# L1 cache, which serves the ops' register spills and stack (5 stages lost).
MAX_STAGES = 3


def scratch_bytes(graph: OpGraph) -> int:
    """Scratch (bytes, a multiple of 128) for the largest tile of ``graph``: attention scores and
    P.V partials (``op_attention``), staged GEMV x rows (up to 96 KiB, :data:`~tilec.ops.GEMV_STAGE_MAX`; fused GEMVs always stage;
    tensor-core rows over a long K: one K block of them), and what ops state themselves (``OpDef.smem_bytes``).

    Raises:
        TilecError: an op needs more than a CTA has (naming the op), or an attention head dim
            above 256.
    """
    need, who = 4096, None
    for op in graph.ops:
        own = opreg.opdef(op.kind).smem_bytes(op)
        if op.kind == "attention":
            q, k, v = op.inputs
            if q.shape[3] > 256 or v.shape[3] > 256:
                raise TilecError(f"op {op.name}: attention head dim {q.shape[3]}/{v.shape[3]} > 256")
            own = max(own, 4 * (4 * 256 + 4 + 8 * 4 * 256 + 4 * k.shape[2]) + 256)
        elif op.kind == "linear":
            rows = 1
            for s in op.outputs[0].shape[:-1]:
                rows *= s
            k = op.inputs[0].shape[-1]
            for staged in (ring_staged_bytes(rows, k), staged_bytes(rows, k)):  # with the bf16 copy if it fits
                if staged <= GEMV_STAGE_MAX:
                    own = max(own, staged)
                    break
            else:
                if kouter_rows(graph, op.inputs[0], rows, k):  # streamed K block by K block
                    own = max(own, kouter_bytes(rows))
        if own > need:
            need, who = own, op.name
    if need > MAX_DYNAMIC_SMEM:
        raise TilecError(f"op {who} needs {need} bytes of shared memory per CTA (max {MAX_DYNAMIC_SMEM}); "
                         f"a smaller attn_kv_chunk splits long attention caches")
    return (need + 127) // 128 * 128


def ring_stages(scratch: int) -> int:
    """Weight-ring stages that fit beside ``scratch`` bytes (0 when fewer than 2 would)."""
    n = min(MAX_STAGES, (MAX_DYNAMIC_SMEM - scratch) // STAGE_BYTES)
    return n if n >= 2 else 0
