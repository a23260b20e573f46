"""Fork coarsening (``Options.coarsen_forks``, ``tilec.passes.fusion.coarsen_forks``): a task's
fan-out into one op's tiles becomes one event instead of a relay through empty tasks; every
ordering of the uncoarsened graph still holds, and the results are those of the uncoarsened plan."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from _helpers import StageRecorder, assert_close, step_pair
from test_golden_ir import OPTS, compile_block
from tilec.hf import compile_decode_step
from tilec.zoo import make_model, prefill


def reaches(tg) -> dict[int, set[int]]:
    """Task -> the tasks that must finish before it (transitively), from ``tg``'s events."""
    preds: dict[int, set[int]] = collections.defaultdict(set)
    for e in tg.events:
        for s in e.succs:
            preds[s] |= e.preds
    memo: dict[int, set[int]] = {}

    def anc(t: int) -> set[int]:
        if t not in memo:
            out, stack = set(), list(preds[t])
            while stack:
                p = stack.pop()
                if p not in out:
                    out.add(p)
                    stack.extend(preds[p])
            memo[t] = out
        return memo[t]
    return {t.id: anc(t.id) for t in tg.tasks}


def llama_1b_b4_step(coarsen: bool):
    """Llama-3.2-1B shapes, one layer, batch 4, context 1024 (planned only): q/k/v tiles there
    straddle the split-KV attention tiles' head groups."""
    model = make_model("llama-3.2-1b", torch.bfloat16, "cpu", layers=1)
    cache, _ = prefill(model, 4, 8, 1024 + 64, "cpu")
    rec = StageRecorder()
    step = compile_decode_step(model, cache, 4, options=dict(executor="reference", check=False,
                                                                          coarsen_forks=coarsen), hook=rec)
    return step, rec


def test_batch_4_relays_become_one_event():
    (on, _), (off, _) = llama_1b_b4_step(True), llama_1b_b4_step(False)
    s_on, s_off = on.program.stats, off.program.stats
    assert s_off["empty_tasks_added"] > 0 and s_off["forks_coarsened"] == 0
    assert s_on["empty_tasks_added"] == 0 and s_on["forks_coarsened"] > 0
    assert s_on["tasks"] < s_off["tasks"]


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


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_coarsened_equals_uncoarsened(name):
    """Reference executor, float32: within 1e-6 (gemv_groups sizes q/k/v by their total columns when
    coarsening, and a CPU tile is one matmul whose summation order may depend on its width)."""
    model, tok, on, off = step_pair(name, torch.float32, dict(coarsen_forks=False))
    (sa, ca), (sb, cb) = on, off
    assert sa.program.stats["forks_coarsened"] >= 0 and sb.program.stats["forks_coarsened"] == 0
    for i in range(3):  # greedy steps from position 6
        x, y = sa(tok, 6 + i), sb(tok, 6 + i)
        assert_close(x, y, 1e-6, f"step {i} logits")
        tok = y.argmax(-1)
    for la, lb in zip(ca.layers, cb.layers):
        assert_close(la.keys, lb.keys, 1e-6, "keys")
        assert_close(la.values, lb.values, 1e-6, "values")
