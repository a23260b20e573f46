"""Combine folding (``tilec.passes.fold_combine``): the last split-KV partial tile of each (batch, KV
head group) to finish runs the combine, with bitwise the results of the plan with an
``attention_combine`` op (reference executor, several worker counts and so arrival orders), no events
among the partial's own tiles, consumers waiting on every partial tile, arrival counters that are
monotonic across steps and rolled back with the events when a step fails, and the pass refusing
what it must not fold."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _helpers import SPLIT, assert_fold_pair_matches, attention_graph, fold_pair, gemv_groups_graph, kinds
from tilec import ops as opreg
from tilec.errors import TilecError, VerificationError
from tilec.ir import Buffer, BufferKind, Op, OpGraph, View
from tilec.ops import DYNAMIC
from tilec.options import Options
from tilec.passes import fold_combine
from tilec.pipeline import compile_opgraph
from tilec.plan import F
from tilec.refexec import ReferenceExecutor
from tilec.taskgraph import build_taskgraph
from tilec.verify import verify_plan, verify_taskgraph


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_combined_equals_uncombined_and_eager(name, dtype):
    model, tok, on, off, want = fold_pair(name, dtype, SPLIT, dict(SPLIT, fold_combine=False))
    config = model.config
    layers = config.num_hidden_layers
    g, gu = on[0].program.plan.graph, off[0].program.plan.graph
    assert kinds(gu)["attention_combine"] == layers and kinds(g)["attention_combine"] == 0
    assert len(g.ops) == len(gu.ops) - layers
    combines = [op for op in gu.ops if op.kind == "attention_combine"]
    parts = [op for op in g.ops if op.kind == "attention_partial"]
    assert all(p.attr("combine") and p.outputs[-1] == c.outputs[0] for p, c in zip(parts, combines))
    hkv = config.num_key_value_heads
    assert on[0].program.plan.arrivals == layers * 2 * hkv and off[0].program.plan.arrivals == 0
    assert_fold_pair_matches(tok, on, off, want, "combined and uncombined", steps=5)


@pytest.fixture(scope="module")
def llama_graph() -> OpGraph:
    """llama-tiny's OpGraph after the gemv_groups stage without the combine fold (2 layers, float32,
    split-KV attention with the RoPE and KV-append folds)."""
    return gemv_groups_graph(fold_combine=False)


def combined(graph: OpGraph) -> int:
    return sum(bool(op.attr("combine")) for op in graph.ops if op.kind == "attention_partial")


def test_pass_folds_each_layer_and_respects_the_options(llama_graph):
    g = fold_combine(llama_graph)
    assert combined(llama_graph) == 0 and combined(g) == 2 and len(g.ops) == len(llama_graph.ops) - 2
    assert g.buffers == llama_graph.buffers  # o_part and ml stay: the partials write and read them
    comb = next(op for op in llama_graph.ops if op.kind == "attention_combine")
    part = next(op for op in g.ops if op.kind == "attention_partial")
    old = next(op for op in llama_graph.ops if op.name == part.name)
    assert part.inputs == old.inputs and part.outputs == (*old.outputs, comb.outputs[0])
    assert part.provenance == old.provenance and dict(part.attrs) == dict(old.attrs, combine=True)
    d = opreg.opdef(part.kind)
    assert len(d.operands(part)) == 13 and d.params(part)[5] == -1  # the plan sets the counter
    assert fold_combine(llama_graph, Options(fold_combine=False)) is llama_graph
    assert fold_combine(g) is g  # nothing left to fold


def test_consumers_wait_for_every_partial_tile_and_the_partials_for_none(llama_graph):
    """Every partial tile declares its group's out rows as dynamic writes (any split may arrive last):
    no event between tiles of the op, and each o_proj tile waits on all of the layer's partial tiles."""
    g = fold_combine(llama_graph)
    opts = Options(**SPLIT)
    part = next(op for op in g.ops if op.kind == "attention_partial")
    tiles = opreg.opdef(part.kind).tiles(part, opts)
    assert len(tiles) > 2 and all(t.writes[-1][0] == 12 and t.writes[-1][2] == DYNAMIC for t in tiles)
    tg = build_taskgraph(g, opts)
    verify_taskgraph(tg, "tasks", opts)
    op_of = {t.id: t.op for t in tg.tasks}
    assert not [e for e in tg.events for p in e.preds for s in e.succs if op_of[p] == op_of[s]]
    part_tasks = {t.id for t in tg.tasks if t.op == part.name}
    consumer = next(op for op in g.ops if any(v.buffer == part.outputs[-1].buffer for v in op.inputs))
    waits = [e for e in tg.events if any(op_of[s] == consumer.name for s in e.succs)
             and any(op_of[p] == part.name for p in e.preds)]
    assert waits and all(part_tasks <= set(e.preds) for e in waits)


def test_pass_refuses_another_reader_a_dtype_change_and_a_toucher_between(llama_graph):
    comb = next(op for op in llama_graph.ops if op.kind == "attention_combine")
    j = llama_graph.ops.index(comb)
    o_part = comb.inputs[0]
    peek_buf = Buffer("peek", o_part.shape, torch.float32, BufferKind.TEMP)
    ops = list(llama_graph.ops)  # another op reads the partials
    ops.append(Op("peek", "unary", (o_part,), (View.whole(peek_buf),), (("fn", "neg"),)))
    read = dataclasses.replace(llama_graph, ops=tuple(ops), buffers={**llama_graph.buffers, "peek": peek_buf})
    assert combined(fold_combine(read)) == 1  # the other layer still folds
    out = comb.outputs[0]  # the first combine's out is not the queries' dtype
    b = llama_graph.buffers[out.buffer]
    bf16 = dataclasses.replace(llama_graph, buffers={**llama_graph.buffers,
                                                     b.name: dataclasses.replace(b, dtype=torch.bfloat16)})
    assert combined(fold_combine(bf16)) == 1
    ops = list(llama_graph.ops)  # an op between the partial and the combine reads out's buffer
    peek_out = Buffer("peek_out", out.shape, torch.float32, BufferKind.TEMP)
    ops.insert(j, Op("peek_out", "unary", (View.whole(llama_graph.buffers[out.buffer]),),
                     (View.whole(peek_out),), (("fn", "neg"),)))
    between = dataclasses.replace(llama_graph, ops=tuple(ops), buffers={**llama_graph.buffers, "peek_out": peek_out})
    assert combined(fold_combine(between)) == 1


def test_an_attention_writing_the_buffer_it_reads_is_not_folded():
    """q and out are views of one state buffer, out one head further on (found by review): folded,
    a group's last tile would overwrite queries other groups have not read yet, so the pass keeps
    the combine op - and the results are the unfolded plan's."""
    b, hq, hkv, s, d = 1, 4, 2, 24, 16
    buf = Buffer("qo", (b, hq + 1, 1, d), torch.float32, BufferKind.STATE)
    k = Buffer("k", (b, hkv, s, d), torch.float32, BufferKind.STATE)
    v = Buffer("v", (b, hkv, s, d), torch.float32, BufferKind.STATE)
    strides = (((hq + 1) * d, d, d, 1))
    qv, ov = View("qo", (b, hq, 1, d), strides, 0, 0), View("qo", (b, hq, 1, d), strides, d, 0)
    op = Op("attn", "attention", (qv, View.whole(k), View.whole(v)), (ov,), (("causal", True), ("scale", 0.25)))
    g = OpGraph((op,), {"qo": buf, "k": k, "v": v}, ("qo", "k", "v", "<position>"), (), max_positions=s)
    plan = compile_opgraph(g, Options(workers=3, attn_kv_chunk=8)).plan
    assert [o.kind for o in plan.graph.ops] == ["attention_partial", "attention_combine"] and plan.arrivals == 0


def test_a_combining_op_the_device_would_misread_is_an_error(llama_graph):
    g = fold_combine(llama_graph)
    part = next(op for op in g.ops if op.kind == "attention_partial")
    d = opreg.opdef(part.kind)
    f32 = [torch.float32] * 12  # the tensor operands (valid is a scalar)
    assert d.device_dtypes(part, f32) == f32[:5]
    want = f"op {part.name}: out is torch.bfloat16, the device reads it as torch.float32"
    with pytest.raises(TilecError, match=want):
        d.device_dtypes(part, f32[:11] + [torch.bfloat16])


def _run(plan, inputs, position, executor=None):
    t = {k: v.clone() for k, v in inputs.items()}
    for name, buf in plan.graph.buffers.items():
        t.setdefault(name, torch.full(buf.shape, float("nan"), dtype=buf.dtype))
    (executor or ReferenceExecutor(plan)).run(t, plan.bind(t, position))
    return t


@pytest.mark.parametrize("workers", [1, 3, 7])
@pytest.mark.parametrize("heads_per_tile", [1, 2])
def test_any_arrival_order_combines_bitwise(workers, heads_per_tile):
    """Batch 2, 6 query heads over 3 KV heads (2 per tile leaves a group of 1), Sq = 2, 8-position
    splits: whichever tile arrives last (the worker count changes the order), out is bitwise the
    unfolded plan's, over three steps of one executor (monotonic counters)."""
    b, hq, hkv, sq, s, d, dv = 2, 6, 3, 2, 30, 16, 24
    torch.manual_seed(0)
    inputs = {"q": torch.randn(b, hq, sq, d), "k": torch.randn(b, hkv, s, d), "v": torch.randn(b, hkv, s, dv)}
    plans = {fold: compile_opgraph(attention_graph(b, hq, hkv, sq, s, d, dv),
                                   Options(workers=workers, attn_kv_chunk=8, attn_heads_per_tile=heads_per_tile,
                                           fold_combine=fold)).plan for fold in (True, False)}
    assert [op.kind for op in plans[True].graph.ops] == ["attention_partial"] and plans[True].arrivals == b * hkv
    ex = ReferenceExecutor(plans[True])
    for position in (5, 17, 27):
        on, off = _run(plans[True], inputs, position, ex), _run(plans[False], inputs, position)
        assert torch.isfinite(on["out"]).all() and torch.equal(on["out"], off["out"])
    ns = plans[True].graph.buffers["attn_opart"].shape[2]
    e = plans[True].events.shape[0]
    groups = b * -(-hkv // heads_per_tile)
    assert sorted(ex.counters[e:].tolist()) == [0] * (b * hkv - groups) + [3 * ns] * groups


def test_a_failed_step_rolls_the_arrival_counters_back(monkeypatch):
    """A step that fails midway leaves no arrivals behind: the next step combines at the right
    tile and gives the unfolded plan's out."""
    import tilec.ops.attention_split as asplit

    b, hq, hkv, sq, s, d, dv = 1, 4, 2, 1, 40, 16, 16
    torch.manual_seed(1)
    inputs = {"q": torch.randn(b, hq, sq, d), "k": torch.randn(b, hkv, s, d), "v": torch.randn(b, hkv, s, dv)}
    plan = compile_opgraph(attention_graph(b, hq, hkv, sq, s, d, dv), Options(workers=3, attn_kv_chunk=8)).plan
    ex = ReferenceExecutor(plan)
    _run(plan, inputs, 30, ex)
    before = ex.counters.clone()
    real = asplit._combine_rows

    def fail(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(asplit, "_combine_rows", fail)
    with pytest.raises(TilecError, match="injected"):
        _run(plan, inputs, 31, ex)
    assert torch.equal(ex.counters, before) and ex.epoch == 1
    monkeypatch.setattr(asplit, "_combine_rows", real)
    want = _run(compile_opgraph(attention_graph(b, hq, hkv, sq, s, d, dv),
                                Options(workers=3, attn_kv_chunk=8, fold_combine=False)).plan, inputs, 31)
    assert torch.equal(_run(plan, inputs, 31, ex)["out"], want["out"])


def test_the_plan_places_the_counters_after_the_events_and_the_verifier_checks_them():
    """Two attention ops: each owns its range of counters after the events; a plan whose tiles
    count elsewhere (another op's range, outside the plan's, inconsistently within an op, or
    arriving too often at one counter) is a verification error, as is a partial without the fold
    that counts arrivals."""
    b, hq, hkv, s, d = 2, 4, 2, 40, 16
    g = attention_graph(b, hq, hkv, 1, s, d, d)
    bufs = {**g.buffers, "q2": dataclasses.replace(g.buffers["q"], name="q2"),
            "out2": dataclasses.replace(g.buffers["out"], name="out2")}
    (op,) = g.ops
    op2 = dataclasses.replace(op, name="attn2", inputs=(View.whole(bufs["q2"]), *op.inputs[1:]),
                              outputs=(View.whole(bufs["out2"]),))
    g2 = dataclasses.replace(g, ops=(op, op2), buffers=bufs, inputs=(*g.inputs[:-1], "q2", "<position>"),
                             outputs=(*g.outputs, View.whole(bufs["out2"])))
    compiled = compile_opgraph(g2, Options(workers=4, attn_kv_chunk=8))
    tg, plan = compiled.stages["linearized"], compiled.plan
    e, p5, oc = plan.events.shape[0], F["params"][0] + 5, F["opcode"][0]
    q = plan.queues
    part = q[..., oc] == opreg.opdef("attention_partial").opcode
    ops_of = q[..., F["op"][0]]
    assert plan.arrivals == 2 * b * hkv
    assert {int(x) for x in q[..., p5][part & (ops_of == 0)]} == {e}
    assert {int(x) for x in q[..., p5][part & (ops_of == 1)]} == {e + b * hkv}
    verify_plan(plan, tg)

    def broken(edit):
        bad = dataclasses.replace(plan, queues=q.clone())
        edit(bad)
        return bad

    def shift(op_index, by):
        def edit(bad):
            sel = part & (ops_of == op_index)
            bad.queues[..., p5][sel] += by
        return edit

    with pytest.raises(VerificationError, match="overlapping another op's or outside"):
        verify_plan(broken(shift(0, 1)), tg)  # into op 1's range
    with pytest.raises(VerificationError, match="overlapping another op's or outside"):
        verify_plan(broken(shift(1, 1)), tg)  # past the plan's counters
    w, i = part.nonzero()[0].tolist()

    def one(bad):
        bad.queues[w, i, p5] += 1
    with pytest.raises(VerificationError, match="other tiles of its op"):
        verify_plan(broken(one), tg)
    c0 = F["coords"][0]

    def other_batch(bad):  # a tile of batch 0 encoded as batch 1: its group's counters miscount
        bad.queues[w, i, c0:c0 + 2] = torch.tensor([1, 2]) if int(q[w, i, c0]) == 0 else torch.tensor([0, 1])
    with pytest.raises(VerificationError, match="tiles arrive a step"):
        verify_plan(broken(other_batch), tg)
    with pytest.raises(VerificationError, match="the plan has"):
        verify_plan(dataclasses.replace(plan, arrivals=plan.arrivals + 1), tg)
    unfolded = compile_opgraph(g2, Options(workers=4, attn_kv_chunk=8, fold_combine=False))
    uq = unfolded.plan.queues
    upart = uq[..., oc] == opreg.opdef("attention_partial").opcode
    assert {int(x) for x in uq[..., p5][upart]} == {-1} and unfolded.plan.arrivals == 0
    bad = dataclasses.replace(unfolded.plan, queues=uq.clone())
    w, i = upart.nonzero()[0].tolist()
    bad.queues[w, i, p5] = 0
    with pytest.raises(VerificationError, match="but its op has no counters"):
        verify_plan(bad, unfolded.stages["linearized"])
    tables, meta = plan.to_tables()
    assert type(plan).from_tables(plan.graph, tables, meta).arrivals == plan.arrivals
    assert f"arrivals={plan.arrivals} {{" in plan.render().splitlines()[0]
