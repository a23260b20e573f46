"""The task-graph verifier and the event derivation on graphs whose ops write dynamically
(``tilec.verify``, ``tilec.taskgraph.build_taskgraph``): a cycle is named by its tasks and events, a
linearized order that puts a waiter before its trigger is refused, and the write check allocates
one count per written buffer - not one per tile write (it built a zero tensor of the KV cache's
size for every split-KV partial tile: 45 s of a 4-layer batch-16 Llama-3.2-1B step's 94 s compile
on 2 CPU cores, under cProfile)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from _helpers import SPLIT, StageRecorder, gemv_groups_graph
from tilec.errors import VerificationError
from tilec.ops import DYNAMIC
from tilec.options import Options
from tilec.taskgraph import Event, build_taskgraph
from tilec.verify import verify_taskgraph


@pytest.fixture(scope="module")
def tasks():
    """llama-tiny's task graph (2 layers, split-KV attention whose partial tiles write the KV
    cache slots and the combined output dynamically) and its options."""
    opts = Options(**SPLIT)
    return build_taskgraph(gemv_groups_graph(), opts), opts


def test_write_check_allocates_per_buffer_not_per_write(tasks, monkeypatch):
    tg, opts = tasks
    dynamic = {}  # buffer -> tiles writing it dynamically
    for t in tg.tasks:
        for buf, _, mode in t.writes:
            if mode == DYNAMIC:
                dynamic[buf] = dynamic.get(buf, 0) + 1
    assert dynamic and max(dynamic.values()) >= 4, dynamic  # several dynamic writers of one buffer
    written = {buf for t in tg.tasks for buf, _, _ in t.writes}
    calls = []
    zeros = torch.zeros

    def counting(*a, **k):
        calls.append(a)
        return zeros(*a, **k)

    monkeypatch.setattr(torch, "zeros", counting)
    verify_taskgraph(tg, "tasks", opts)
    # one count per written buffer, and one mask per (op, dynamically written buffer)
    dynamic_ops = {(t.op, buf) for t in tg.tasks for buf, _, mode in t.writes if mode == DYNAMIC}
    assert len(calls) <= len(written) + len(dynamic_ops), (len(calls), len(written), len(dynamic_ops))


def test_cycle_is_named_by_its_tasks_and_events(tasks):
    tg, opts = tasks
    e = next(e for e in tg.events if e.preds and e.succs)
    p, s = min(e.preds), min(e.succs)
    back = Event(len(tg.events), frozenset({s}), frozenset({p}))  # the waiter triggers its producer
    broken = dataclasses.replace(tg, events=tg.events + (back,))
    with pytest.raises(VerificationError, match="cycle") as info:
        verify_taskgraph(broken, "tasks", opts)
    toks = re.findall(r"[te]\d+", str(info.value))  # the cycle, closed: its first node again at the end
    assert {f"t{p}", f"t{s}", f"e{back.id}"} <= set(toks) and toks[0] == toks[-1], info.value


def test_linearized_order_with_a_waiter_before_its_trigger_is_refused():
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny", torch.float32, "cpu")
    cache, _ = prefill(model, 1, 4, 12, "cpu")
    rec = StageRecorder()
    compile_decode_step(model, cache, 1, options=dict(SPLIT, executor="reference"), hook=rec)
    tg, opts = rec.stages["linearized"], Options(**SPLIT)
    verify_taskgraph(tg, "linearized", opts)
    e = next(e for e in tg.events if e.preds and e.succs)
    p, s = min(e.preds), min(e.succs)
    order = list(tg.order)
    i, j = order.index(p), order.index(s)
    order[i], order[j] = s, p
    with pytest.raises(VerificationError, match="before its predecessor"):
        verify_taskgraph(dataclasses.replace(tg, order=tuple(order)), "linearized", opts)


def test_a_view_of_a_missing_buffer_is_a_verification_error():
    """verify_opgraph raised a bare KeyError for an op whose output names no buffer."""
    from tilec.verify import verify_opgraph

    g = gemv_groups_graph()
    op = g.ops[-1]
    ghost = dataclasses.replace(op, outputs=(dataclasses.replace(op.outputs[0], buffer="ghost"),))
    g = dataclasses.replace(g, ops=(*g.ops[:-1], ghost))
    with pytest.raises(VerificationError, match=rf"op {op.name}: view .*ghost.* names no buffer of the graph"):
        verify_opgraph(g)


def test_render_stats_of_nothing_is_empty():
    from tilec.stats import render_stats

    assert render_stats({}) == "" and render_stats({"ops": 3, "events": 12}) == "ops     3\nevents  12"
