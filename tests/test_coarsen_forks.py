"""Fork coarsening (``Options.coarsen_forks``, ``tilec.passes.fusion.coarsen_forks``): a task's
fan-out into one op's tiles becomes one event instead of a relay through empty tasks; every
ordering of the uncoarsened graph still holds, and the results are those of the uncoarsened plan."""
from __future__ import annotations

import dataclasses
import functools

import networkx as nx
import pytest
import torch

from _helpers import StageRecorder, assert_close, fold_pair
from test_golden_ir import OPTS, compile_block
from tilec.api import compile_module
from tilec.hf import compile_decode_step
from tilec.zoo import make_model, prefill


def reaches(tg) -> dict[int, set[int]]:
    """Task -> the tasks that must finish before it (transitively), from ``tg``'s events."""
    dag = nx.DiGraph()
    dag.add_nodes_from(t.id for t in tg.tasks)
    dag.add_edges_from((p, s) for e in tg.events for p in e.preds for s in e.succs)
    return {t.id: nx.ancestors(dag, t.id) for t in tg.tasks}


@functools.lru_cache(maxsize=1)
def llama_1b_b4():
    """Llama-3.2-1B shapes, one layer, 4 sequences prefilled to 8 of 1088 positions (built once)."""
    model = make_model("llama-3.2-1b", torch.bfloat16, "cpu", layers=1)
    cache, _ = prefill(model, 4, 8, 1024 + 64, "cpu")
    return model, cache


def llama_1b_b4_step(coarsen: bool):
    """Llama-3.2-1B shapes, one layer, batch 4, context 1024 (planned only): q/k/v tiles there
    straddle the split-KV attention tiles' head groups."""
    model, cache = llama_1b_b4()
    rec = StageRecorder()
    step = compile_decode_step(model, cache, 4, options=dict(executor="reference", check=False,
                                                                          coarsen_forks=coarsen), hook=rec)
    return step, rec


def test_batch_4_relays_become_one_event():
    (on, rec), (off, _) = llama_1b_b4_step(True), llama_1b_b4_step(False)
    s_on, s_off = on.program.stats, off.program.stats
    assert s_off["empty_tasks_added"] > 0 and s_off["forks_coarsened"] == 0
    assert s_on["empty_tasks_added"] == 0 and s_on["forks_coarsened"] > 0
    assert s_on["tasks"] < s_off["tasks"]
    a_tasks, a_fused = reaches(rec.stages["tasks"]), reaches(rec.stages["fused"])
    assert all(a_tasks[t] <= a_fused[t] for t in a_tasks), "an ordering of the unfused graph was lost"


def test_coarsened_fused_graph_keeps_every_ordering():
    """The MLP block of the golden tests (same tiles either way): with coarsening, every pair of
    tasks the fused graph without it orders is still ordered, and each merged event wakes one op."""
    graphs = {}
    for coarsen in (True, False):
        _, _, _, rec = compile_block(dataclasses.replace(OPTS, coarsen_forks=coarsen))
        graphs[coarsen] = rec.stages["fused"]
    assert [t.label() for t in graphs[True].tasks] == [t.label() for t in graphs[False].tasks]
    assert graphs[True].stats["forks_coarsened"] == 1
    a_on, a_off = reaches(graphs[True]), reaches(graphs[False])
    assert all(a_off[t] <= a_on[t] for t in a_off)
    op_of = {t.id: t.op for t in graphs[True].tasks}
    merged = [e for e in graphs[True].events if len(e.succs) == 2 and 14 in e.succs]
    assert len(merged) == 1 and {op_of[s] for s in merged[0].succs} == {"binary_add_2"}


@pytest.mark.parametrize("name,opts", [("llama-tiny", dict(workers=6, attn_kv_chunk=4)),
                                       ("qwen3-tiny", dict(workers=8, attn_kv_chunk=8))])
def test_coarsened_split_kv_folds_equal_uncoarsened(name, opts):
    """Split-KV attention with the RoPE / KV-append / combine folds (q/k/v tiles straddle the
    partials' head groups): forks are coarsened, no empty task is left, no ordering of the
    unfused task graph is lost, and the results equal eager's and the uncoarsened plan's
    (reference executor, float32; 1e-6: a CPU tile is one matmul whose summation order may
    depend on its width)."""
    rec = StageRecorder()
    model, tok, on, off, want = fold_pair(name, torch.float32, dict(opts), dict(opts, coarsen_forks=False), hook=rec)
    s_on, s_off = on[0].program.stats, off[0].program.stats
    assert s_on["forks_coarsened"] > 0 and s_on["empty_tasks_added"] == 0 < s_off["empty_tasks_added"]
    a_tasks, a_fused = reaches(rec.stages["tasks"]), reaches(rec.stages["fused"])
    assert all(a_tasks[t] <= a_fused[t] for t in a_tasks)
    x = on[0](tok, 6)
    assert_close(x, want, 1e-5, "logits vs eager")
    assert_close(x, off[0](tok, 6), 1e-6, "logits vs uncoarsened")
    for la, lb in zip(on[1].layers, off[1].layers):
        assert_close(la.keys, lb.keys, 1e-6, "keys")
        assert_close(la.values, lb.values, 1e-6, "values")


class ComputedBias(torch.nn.Module):
    """A split-K linear whose bias is a row of its own input: its init tiles wait on a producer
    that its partial tiles wait on too (merging those events would order an init tile after itself)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        h = x * 2.0
        return torch.nn.functional.linear(h, self.w, h[0])


def test_split_k_init_tile_with_a_producer_stays_acyclic():
    torch.manual_seed(0)
    m, x = ComputedBias().eval(), torch.randn(2, 64)
    prog = compile_module(m, (x,), options=dict(workers=4, tile_n=32, tile_rows=1, split_k=2, fuse_gemv=False,
                                                executor="reference"))
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-5)
