"""Sibling-GEMV tile sizing (``tilec.passes.gemv_groups``): q/k/v and gate/up are sized by their
total columns, so together they make about ``workers`` tiles (with ``coarsen_forks`` off, cut in
blocks no consumer tile straddles); the results are those of per-op sizing (reference executor: within float32 rounding,
since a tile is one CPU matmul whose summation order may depend on its width)."""
from __future__ import annotations

import collections
import dataclasses
import functools

import pytest
import torch

from _helpers import StageRecorder, assert_close, step_pair
from tilec.api import compile_module
from tilec.hf import compile_decode_step
from tilec.ir import Buffer, BufferKind, Op, View
from tilec.ops import gemv_col_ranges
from tilec.options import Options
from tilec.passes import size_gemv_groups
from tilec.zoo import make_model, prefill


def gemv_tiles(step) -> dict[str, int]:
    """Tasks per GEMV op (by op name) in the step's linearized task graph."""
    tg = step.program.compiled.stages["linearized"]
    return dict(collections.Counter(t.op for t in tg.tasks if t.kind == "linear_fused"))


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_grouped_equals_ungrouped(name):
    model, tok, grouped, ungrouped = step_pair(name, torch.float32, dict(gemv_groups=False))
    g, gu = grouped[0].program.plan.graph, ungrouped[0].program.plan.graph
    layers = model.config.num_hidden_layers
    sized = [op for op in g.ops if op.attr("col_split") is not None]
    # per layer: q, k, v (one group) and gate, up (another); o, down and the LM head stay alone
    assert len(sized) == 5 * layers and not any(op.attr("col_split") for op in gu.ops)
    assert all(op.outputs[0].shape[-1] % op.attr("col_split")[0] == 0 for op in sized)
    (sa, ca), (sb, cb) = grouped, ungrouped
    for i in range(3):  # greedy steps from position 6
        x, y = sa(tok, 6 + i), sb(tok, 6 + i)
        assert_close(x, y, 1e-6, f"step {i} logits")
        tok = y.argmax(-1)
    for la, lb in zip(ca.layers, cb.layers):
        assert_close(la.keys, lb.keys, 1e-6, "keys")
        assert_close(la.values, lb.values, 1e-6, "values")


@functools.lru_cache(maxsize=1)
def llama_1b_one_layer():
    """Llama-3.2-1B shapes, one layer, batch 1 prefilled to 4 of 64 positions (built once: planning
    does not change the model or the cache)."""
    model = make_model("llama-3.2-1b", torch.bfloat16, "cpu", layers=1)
    cache, _ = prefill(model, 1, 4, 64, "cpu")
    return model, cache


@pytest.mark.parametrize("coarsen,tile_rows,qkv,empties", [(False, 4, (88, 22, 22), 8), (False, 1, (64, 32, 32), 0),
                                                          (True, 1, (88, 22, 22), 0)])
def test_llama_1b_qkv_and_gate_up_fill_the_workers_once(coarsen, tile_rows, qkv, empties):
    """Llama-3.2-1B shapes, 132 workers: gate/up make 66 + 66 tiles of 120-128 columns; q/k/v, with
    coarsen_forks (the default), 132 tiles of 16-24 columns sized by their total columns alone; without
    it 132 tiles in 256-column blocks (RoPE / cache-write tiles of 4 heads) or 128 in 64-column blocks
    (1 head), so that no tile straddles a consumer's; one instruction per worker each (per-op sizing
    made 128 + 128 and 128 + 64 + 64). No empty task beyond those of per-op sizing (with coarsening
    none at all)."""
    model, cache = llama_1b_one_layer()
    counts, empty = {}, {}
    for groups in (True, False):
        step = compile_decode_step(model, cache, 1, options=dict(executor="reference", gemv_groups=groups,
                                                                 tile_rows=tile_rows, coarsen_forks=coarsen))
        g = step.program.plan.graph
        tiles = gemv_tiles(step)
        counts[groups] = [tiles[op.name] for op in g.ops if op.kind == "linear_fused"]
        empty[groups] = step.program.stats["empty_tasks_added"]
    # graph order: k, v, q, o, gate, up, down, LM head
    assert counts[True] == [qkv[1], qkv[2], qkv[0], 128, 66, 66, 128, 132]
    assert counts[False] == [64, 64, 128, 128, 128, 128, 128, 132]
    assert empty[True] == empty[False] == empties


def test_tile_n_and_option_off_leave_the_graph_alone():
    model = make_model("llama-tiny", torch.float32, "cpu")
    cache, _ = prefill(model, 1, 4, 12, "cpu")
    rec = StageRecorder()
    compile_decode_step(model, cache, 1, options=dict(workers=4), hook=rec)
    g = rec.stages["fold_cache"]
    assert size_gemv_groups(g, Options(tile_n=16)) is g
    assert size_gemv_groups(g, Options(gemv_groups=False)) is g
    assert [op.attr("col_split") for op in size_gemv_groups(g, Options(workers=4)).ops] == [
        op.attr("col_split") for op in rec.stages["gemv_groups"].ops]


class Head(torch.nn.Module):
    """A lone GEMV whose output an elementwise op reads in ``tile_cols`` chunks (a temperature)."""

    def __init__(self, n, k=32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, k) / 6)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w) / 0.7


@pytest.mark.parametrize("n", [2600, 32064])
def test_fine_blocks_are_not_used(n):
    """An elementwise consumer's 1024-column tiles would cut an LM head into gcd(N, 1024)-column
    blocks: many more tiles than workers. The pass leaves such a GEMV to per-op sizing."""
    m, x = Head(n).eval(), torch.randn(1, 1, 32)
    progs = {g: compile_module(m, (x,), options=dict(executor="reference", workers=132, gemv_groups=g,
                                                     coarsen_forks=False))  # the cuts only matter without it
             for g in (True, False)}
    tiles = {g: sum(t.kind == "linear" for t in p.compiled.stages["linearized"].tasks) for g, p in progs.items()}
    assert tiles[True] == tiles[False] <= 132
    assert next(o for o in progs[True].plan.graph.ops if o.kind == "linear").attr("col_split") is None
    with torch.no_grad():
        assert_close(progs[True](x), m(x), 1e-5)


@pytest.mark.parametrize("block,k,n,want", [
    (64, 2, 128, [(0, 32), (32, 64), (64, 96), (96, 128)]),
    (256, 11, 256, [(0, 24)] + [(24 * i, 24 * i + 24) for i in range(1, 10)] + [(240, 256)]),
    (20, 2, 20, [(0, 8), (8, 20)]),  # a whole N that is not a multiple of 8: the last tile takes the rest
    (4, 3, 4, [(0, 4)]),  # fewer than 8 columns: one tile
])
def test_col_ranges(block, k, n, want):
    op = dataclasses.replace(Op("g", "linear", (), (View.whole(Buffer("o", (1, n), torch.float32, BufferKind.TEMP)),)),
                             attrs=(("col_split", (block, k)),))
    got = gemv_col_ranges(op, Options())
    assert got == want and got[-1][1] == n and all(b == c for (_, b), (c, _) in zip(got, got[1:]))


def test_siblings_that_stream_k_block_outer_get_tiles_of_at_most_32_columns():
    """Sibling GEMVs of one x over a long K (8 x 8192, streamed K block outer) were sized 120-256
    columns a tile, too wide for the K-outer stream (at most 32 columns): nothing streamed, and 8 such
    GEMVs ran at ~0.03 TB/s on an H200. Their tiles are at most 32 columns now, and all stream."""
    from tilec.ops import GEMV_KOUTER_COLS, STREAM_KOUTER, gemv_col_ranges
    from tilec.options import Options
    from tilec.plan import F

    class Gemvs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = torch.nn.ModuleList(torch.nn.Linear(8192, 512, bias=False) for _ in range(4))

        def forward(self, x):
            return tuple(w(x) for w in self.ws)

    x = torch.randn(8, 8192, dtype=torch.bfloat16)
    plan = compile_module(Gemvs().to(torch.bfloat16), (x,), options=dict(workers=16, executor="reference")).plan
    assert all(op.attr("col_split") for op in plan.graph.ops if op.kind == "linear")
    q = plan.queues.reshape(-1, plan.queues.shape[-1]).tolist()
    tiles = [d for d in q if d[F["op"][0]] >= 0]
    assert tiles and all(d[F["stream"][0]] & STREAM_KOUTER for d in tiles)
    for op in plan.graph.ops:
        assert max(hi - lo for lo, hi in gemv_col_ranges(op, Options(workers=16))) <= GEMV_KOUTER_COLS
