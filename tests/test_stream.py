"""The plan side of the GEMV weight stream (runtime/tilec/stream.cuh): which tiles the loader
warp streams (the descriptor's ``stream`` word), how the shared memory is split between the
ring and the ops' scratch (tilec/smem.py), and the phase marks a measured trace carries."""
from __future__ import annotations

import pytest
import torch

from _helpers import LlamaRMSNorm
from tilec import smem
from tilec.api import compile_module
from tilec.hf import compile_decode_step
from tilec.options import Options
from tilec.ir import BufferKind
from tilec.ops import EMPTY, GEMV_TILE_N_MAX, NOOP, gemv_tile_n, opdef
from tilec.plan import F, KernelPlan, decode_coords
from tilec.trace import measured_trace
from tilec.zoo import make_model, prefill


def decode_stream(d):
    """(weight operand, n range, k range) of a descriptor's stream word, or None."""
    s = d[F["stream"][0]]
    if s == 0:
        return None
    coords = decode_coords(d)
    return (s & 15) - 1, coords[(s >> 4) & 15], coords[(s >> 8) & 15]


def step_plan(name, dtype, batch=1, **opts):
    model = make_model(name, dtype)
    cache, _ = prefill(model, batch, 4, 16)
    return compile_decode_step(model, cache, batch, options=dict(workers=8, **opts)).program.plan


@pytest.fixture(scope="module")
def bf16_plan():
    return step_plan("llama-tiny", torch.bfloat16)


def test_every_bf16_decode_gemv_tile_is_streamed_with_its_own_ranges(bf16_plan):
    plan = bf16_plan
    assert 2 <= plan.ring_stages <= smem.MAX_STAGES
    streamed = 0
    for q in plan.queues.tolist():
        for d in q:
            if d[0] in (NOOP, EMPTY):
                assert d[F["stream"][0]] == 0
                continue
            op = plan.graph.ops[d[F["op"][0]]]
            got = decode_stream(d)
            if op.kind not in ("linear", "linear_fused"):
                assert got is None, op.name
                continue
            assert got is not None, f"{op.name}: a bf16 M = 1 GEMV tile is not streamed"
            operand, (n0, n1), (k0, k1) = got
            w = opdef(op.kind).operands(op)[operand]
            assert plan.graph.buffers[w.buffer].kind in (BufferKind.PARAM, BufferKind.CONST)
            assert tuple(w.shape) == (op.outputs[0].shape[-1], op.inputs[0].shape[-1])
            assert 0 <= n0 < n1 <= w.shape[0] and (k0, k1) == (0, w.shape[1])
            assert d[F["prefetch"][0]] == 0  # the loader streams it: no separate L2 prefetch
            streamed += 1
    assert streamed > 0


def test_float32_weights_and_wide_batches_are_not_streamed():
    plan = step_plan("llama-tiny", torch.float32)
    assert not (plan.queues[..., F["stream"][0]] != 0).any()
    assert plan.ring_stages == 0  # nothing streams: no ring, the shared memory stays L1 cache
    plan = step_plan("llama-tiny", torch.bfloat16, batch=17)  # 17 rows: the unstreamed tensor-core path
    assert not (plan.queues[..., F["stream"][0]] != 0).any()
    assert plan.ring_stages == 0


def test_bf16_batches_up_to_16_rows_stream_to_the_tensor_core_consumer():
    plan = step_plan("llama-tiny", torch.bfloat16, batch=9)
    words = plan.queues[..., F["stream"][0]]
    assert plan.ring_stages >= 2 and (words != 0).any()
    for q in plan.queues.tolist():
        for d in q:
            if d[F["stream"][0]]:
                rows = 1
                for lo, hi in decode_coords(d)[:-2]:
                    rows *= hi - lo
                assert 9 <= rows <= 16


def test_ring_and_scratch_fit_a_cta(bf16_plan):
    scratch = smem.scratch_bytes(bf16_plan.graph)
    assert scratch % 128 == 0
    assert bf16_plan.ring_stages == smem.ring_stages(scratch)
    assert bf16_plan.ring_stages * smem.STAGE_BYTES + scratch <= smem.MAX_DYNAMIC_SMEM
    assert smem.ring_stages(smem.MAX_DYNAMIC_SMEM - smem.STAGE_BYTES) == 0  # one stage is no ring


def test_ring_stages_survive_the_table_round_trip(bf16_plan):
    tensors, meta = bf16_plan.to_tables()
    back = KernelPlan.from_tables(bf16_plan.graph, tensors, meta)
    assert back.ring_stages == bf16_plan.ring_stages
    del meta["ring_stages"]  # tables written before the ring: nothing streamed
    assert KernelPlan.from_tables(bf16_plan.graph, tensors, meta).ring_stages == 0


class Absorb(torch.nn.Module):
    def __init__(self, heads, k, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(heads, k, n))

    def forward(self, q):
        return torch.einsum("thd,hdc->thc", q, self.w)


def test_bmm_tiles_spread_all_heads_over_the_workers():
    """Per-head column slices sized from one head alone made GLM-5's absorption 4096 tiles."""
    mod, q = Absorb(64, 24, 512), torch.randn(16, 64, 24)
    prog = compile_module(mod, (q,), options=dict(workers=132))
    tiles = [t for t in prog.compiled.stages["tasks"].tasks if t.kind == "bmm"]
    assert 132 <= len(tiles) <= 2 * 2 * 132
    torch.testing.assert_close(prog(q), mod(q), rtol=1e-4, atol=1e-4)


def test_measured_trace_carries_op_marks(bf16_plan):
    plan = bf16_plan
    w_n, l_n = plan.queues.shape[:2]
    stamps = torch.zeros(w_n, l_n, 4, dtype=torch.int64)
    live = (plan.queues[:, :, 0] != NOOP).nonzero().tolist()
    for i, (w, j) in enumerate(live):
        start = 10_000 + 1_000 * i
        stamps[w, j] = torch.tensor([start, start + 900, start + 300 if i % 2 else 0, start + 500 if i % 2 else 0])
    slices = [e for e in measured_trace(plan, stamps)["traceEvents"] if e.get("ph") == "X"]
    marked = [s for s in slices if "mark1_us" in s["args"]]
    assert len(marked) == len(live) // 2
    assert all((s["args"]["mark1_us"], s["args"]["mark2_us"]) == (0.3, 0.5) for s in marked)


class _NormLinear(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.norm = LlamaRMSNorm(k)
        self.lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.lin(self.norm(x))


def test_bf16_copy_of_ring_rows_is_reserved_but_does_not_limit_fusion():
    """The CUDA-core ring consumer's bf16 copy of x (at most GEMV_RING_ROWS = 4 rows) is part of
    the scratch the plan reserves, but the fusion limit counts the float rows only: 4 rows x 8192
    still fuse."""
    from tilec.ops import GEMV_RING_ROWS
    from tilec.ops.linear_fused import ring_staged_bytes, staged_bytes
    from tilec.passes.fuse_gemv import SMEM_LIMIT

    assert GEMV_RING_ROWS == 4
    assert staged_bytes(4, 8192) <= SMEM_LIMIT < ring_staged_bytes(4, 8192)
    assert ring_staged_bytes(5, 4096) == staged_bytes(5, 4096) + 4096  # 5..16 rows: the cross-warp sums
    assert ring_staged_bytes(17, 4096) == staged_bytes(17, 4096)  # no ring
    x = torch.randn(4, 8192, dtype=torch.bfloat16)
    prog = compile_module(_NormLinear(8192, 64), (x,), options=dict(workers=8))
    assert [op.kind for op in prog.plan.graph.ops] == ["linear_fused"]
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    plan = compile_module(_NormLinear(2048, 64), (x,), options=dict(workers=8)).plan
    assert smem.scratch_bytes(plan.graph) >= ring_staged_bytes(1, 2048)
    assert (plan.queues[..., F["stream"][0]] != 0).any()


class _Proj(torch.nn.Module):
    """x [rows, K] -> linear(K -> n) (optionally after an RMSNorm, which fuses as a prologue)."""

    def __init__(self, k, n, norm):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        self.norm_w = torch.nn.Parameter(torch.randn(k, dtype=torch.bfloat16)) if norm else None

    def forward(self, x):
        if self.norm_w is not None:  # HF's Llama RMSNorm
            h = x.float()
            x = self.norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        return self.lin(x)


@pytest.mark.parametrize("rows,k,n,norm,kouter", [
    (16, 6144, 96, False, True),   # GLM-5's QKV-A shape class: 16 rows, K 6144, <= 32 columns a tile
    (12, 5000, 40, False, True),   # a ragged last K block
    (12, 1024, 96, False, False),  # K fits whole: the ordinary tensor-core ring consumer
    (16, 6144, 384, False, None),  # 64 columns a tile (tile_n 64): not streamed
    (8, 8192, 96, False, True),    # a batch-8 down projection (Llama-3.2-1B): tensor cores, K-outer
    (5, 8192, 96, False, True),    # the fewest rows the tensor-core consumer takes
    (4, 4096, 96, False, False),   # <= GEMV_RING_ROWS rows: the CUDA-core consumer, x staged whole
    (4, 14336, 96, False, True),   # a batch-4 down projection (Llama-3.1-8B, too wide to fuse)
    (3, 8192, 96, False, True),    # 3 float rows of 8192 exceed 96 KiB
    (2, 8192, 96, False, False),   # 2 fit: staged whole
])
def test_long_k_batches_stream_k_block_outer(rows, k, n, norm, kouter):
    """5..16 bf16 rows over K > 4096: the stream word's K-outer flag, and scratch for one K block.
    Before, 5..8 rows went to the CUDA-core consumer, which stages x whole: Llama-3.2-1B's batch-8
    down projection (8 x 8192, too wide to fuse) did not fit beside the ring and streamed nothing.
    The same for 2..4 rows whose float rows exceed 96 KiB (Llama-3.1-8B's batch-4 down projection:
    its weights were read at ~0.05 TB/s on an H200)."""
    from tilec.ops import STREAM_KOUTER, kouter_bytes

    x = torch.randn(rows, k, dtype=torch.bfloat16)
    opts = dict(workers=8, executor="reference", check=False) | ({"tile_n": 64} if n == 384 else {})
    plan = compile_module(_Proj(k, n, norm), (x,), options=opts).plan
    words = [d[F["stream"][0]] for q in plan.queues.tolist() for d in q if d[F["opcode"][0]] not in (NOOP, EMPTY)]
    if kouter is None:
        assert not any(words)
        return
    assert words and all(words), "every GEMV tile streams"
    assert all(bool(w & STREAM_KOUTER) == kouter for w in words)
    if kouter:
        assert smem.scratch_bytes(plan.graph) >= kouter_bytes(rows)


def test_a_split_k_slice_of_a_few_long_rows_streams_k_block_outer():
    """Llama-3.1-8B's batch-3 down projection (3 x 14336) with split_k=2: its 7168-K slices' float
    rows (86 KiB) fit the 96 KiB a plan stages but not the plan's scratch, so they were neither staged
    whole nor K-outer and streamed nothing (a reviewer's find). They stream K block outer now."""
    from tilec.ops import STREAM_KOUTER

    x = torch.randn(3, 14336, dtype=torch.bfloat16)
    plan = compile_module(_Proj(14336, 96, False), (x,), options=dict(workers=8, split_k=2, executor="reference",
                                                                       check=False)).plan
    words = [d[F["stream"][0]] for q in plan.queues.tolist() for d in q
             if d[F["opcode"][0]] not in (NOOP, EMPTY) and d[F["stream"][0]]]
    assert len(words) >= 8 and all(w & STREAM_KOUTER for w in words)


def test_long_k_with_a_fused_prologue_is_not_streamed():
    """A prologue needs whole rows (the RMSNorm of x): K-outer tiles take none."""
    from tilec.ops import Tile, gemv_stream_word

    x = torch.randn(9, 4200, dtype=torch.bfloat16)  # 9 float rows of 4200 fit the fusion limit
    plan = compile_module(_Proj(4200, 64, True), (x,), options=dict(workers=8, executor="reference",
                                                                    check=False)).plan
    (op,) = [o for o in plan.graph.ops if o.kind == "linear_fused"]
    assert not (plan.queues[..., F["stream"][0]] != 0).any()
    tile = Tile(((0, 9), (0, 8), (0, 4200)), reads=(), writes=())
    assert gemv_stream_word(plan.graph, op.inputs[0], op.inputs[2], 2, tile, 200_000, prologue=True) == 0
    assert gemv_stream_word(plan.graph, op.inputs[0], op.inputs[2], 2, tile, 200_000) != 0


@pytest.mark.parametrize("groups", [True, False])
def test_a_tile_reuses_the_x_rows_its_predecessor_staged(bf16_plan, groups):
    """The plan flags (linear_fused param 4) a streamed tile whose worker's previous instruction
    staged the same x rows - same x and prologue inputs, prologue, rows and K range (Q / K / V of
    one layer, gate then up) - and no other. Sibling GEMVs sized together (``gemv_groups``, the
    default) take one instruction per worker, so only per-op sizing leaves tiles to flag here."""
    plan = bf16_plan if groups else step_plan("llama-tiny", torch.bfloat16, gemv_groups=False)
    p4 = F["params"][0] + 4
    flagged = 0
    for q in plan.queues.tolist():
        prev = None
        for d in q:
            op = plan.graph.ops[d[F["op"][0]]] if d[0] not in (NOOP, EMPTY) else None
            if op is not None and op.kind == "linear_fused" and d[p4]:
                assert prev is not None, op.name
                pop, pd = prev
                npro = 2 if op.attr("prologue") != "none" else 1
                assert pop.kind == "linear_fused" and decode_stream(pd) and decode_stream(d)
                assert pop.inputs[:npro] == op.inputs[:npro] and pop.attr("prologue") == op.attr("prologue")
                assert decode_coords(pd)[:-2] == decode_coords(d)[:-2] and decode_coords(pd)[-1] == decode_coords(d)[-1]
                flagged += 1
            elif op is not None and op.kind == "linear_fused":
                assert not (prev and prev[0].kind == "linear_fused" and prev[0].inputs[:2] == op.inputs[:2]
                            and prev[0].attr("prologue") == op.attr("prologue") == "rmsnorm"
                            and decode_stream(prev[1]) and decode_stream(d)), f"{op.name}: reuse missed"
            prev = (op, d) if op is not None else None
    assert flagged > 0 or groups


def test_linears_take_one_tile_per_worker_up_to_the_cap():
    opts = Options(workers=132)
    assert gemv_tile_n(128256, opts, GEMV_TILE_N_MAX) == 976  # a Llama LM head: 132 tiles
    assert gemv_tile_n(128256, opts) == 128  # ops sizing shared memory by the tile keep 128
    assert gemv_tile_n(8192, opts, GEMV_TILE_N_MAX) == 64
    assert gemv_tile_n(304128, opts, GEMV_TILE_N_MAX) == 768  # 2304 a worker: three rounds of 768
    assert gemv_tile_n(100, Options(workers=132, tile_n=32), GEMV_TILE_N_MAX) == 32
