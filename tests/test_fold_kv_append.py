"""KV-append folding (``tilec.passes.fold_kv_append``): the split-KV attention tile whose split holds
the step's cache rows writes them (the keys' RoPE and both cache writes) as it reads its split, with
bitwise the results of the plan with a rope and a cache_write op (reference executor), no events
among the attention's own tiles, and the pass refuses what it must not fold."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _helpers import (APPEND_CASES, SPLIT, append_fold_results, assert_fold_pair_matches, fold_pair,
                      gemv_groups_graph, kinds)
from tilec import ops as opreg
from tilec.errors import TilecError
from tilec.ir import Buffer, BufferKind, Op, OpGraph, View
from tilec.ops import DYNAMIC
from tilec.options import Options
from tilec.passes import fold_kv_append
from tilec.taskgraph import build_taskgraph

@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_appended_equals_unappended_and_eager(name, dtype):
    model, tok, on, off, want = fold_pair(name, dtype, SPLIT, dict(SPLIT, fold_kv_append=False))
    layers = model.config.num_hidden_layers
    g, gu = on[0].program.plan.graph, off[0].program.plan.graph
    # per layer the key rope and the value cache_write are gone, the partial writes both slots
    assert kinds(gu)["rope"] == kinds(gu)["cache_write"] == layers
    assert kinds(g)["rope"] == kinds(g)["cache_write"] == 0 and len(g.ops) == len(gu.ops) - 2 * layers
    parts = [op for op in g.ops if op.kind == "attention_partial"]
    assert len(parts) == layers and all(op.attr("append") and len(op.inputs) == 7 and len(op.outputs) == 5
                                        for op in parts)  # o_part, ml, the slots, the folded combine's out
    assert all(op.outputs[2].pos_stride and op.outputs[2].buffer == op.inputs[1].buffer for op in parts)
    assert_fold_pair_matches(tok, on, off, want, "appended and unappended", steps=5)


@pytest.mark.parametrize("case", APPEND_CASES, ids=lambda c: f"sq{c[3]}-d{c[5]}-dv{c[6]}-chunk{c[8]}")
def test_appended_rows_across_splits_bitwise(case):
    """Several new rows a step (Sq 2-3) that straddle two splits, D != Dv, fp16, 12 queries a head
    group: the folded plan's output and caches bitwise the unfolded plan's (reference executor),
    and the output finite (no NaN cache row read)."""
    for p, res in append_fold_results(case, "reference", "cpu"):
        for n in ("out", "k", "v"):
            assert torch.equal(res[True][n], res[False][n]), f"position {p}: {n} differs"
        assert res[True]["out"].float().isfinite().all()


@pytest.fixture(scope="module")
def llama_graph() -> OpGraph:
    """llama-tiny's OpGraph after the gemv_groups stage without the append and combine folds (2
    layers, float32, split-KV attention with the queries' RoPE folded)."""
    return gemv_groups_graph(fold_kv_append=False, fold_combine=False)


def appended(graph: OpGraph) -> int:
    return sum(bool(op.attr("append")) for op in graph.ops if op.kind == "attention_partial")


def test_pass_folds_each_layer_and_respects_the_options(llama_graph):
    g = fold_kv_append(llama_graph)
    assert appended(llama_graph) == 0 and appended(g) == 2 and len(g.ops) == len(llama_graph.ops) - 4
    assert g.buffers == llama_graph.buffers  # the slots are the caches': no buffer is dropped
    rope = next(op for op in llama_graph.ops if op.kind == "rope")
    cw = next(op for op in llama_graph.ops if op.kind == "cache_write")
    part = next(op for op in g.ops if op.kind == "attention_partial")
    old = next(op for op in llama_graph.ops if op.name == part.name)
    assert part.inputs == (*old.inputs, rope.inputs[0], cw.inputs[0])
    assert part.outputs == (*old.outputs, rope.outputs[0], cw.outputs[0]) and part.provenance == old.provenance
    assert fold_kv_append(llama_graph, Options(fold_kv_append=False)) is llama_graph
    assert fold_kv_append(g) is g  # nothing left to fold


def test_the_attention_tiles_never_wait_for_one_another(llama_graph):
    """Every tile declares the slots as dynamic writes (any split may hold the new rows); the
    task graph puts no event between tiles of one op over them, and the write check counts them once."""
    g = fold_kv_append(llama_graph)
    opts = Options(**SPLIT)
    part = next(op for op in g.ops if op.kind == "attention_partial")
    tiles = opreg.opdef(part.kind).tiles(part, opts)
    assert len(tiles) > 2 and all([w[2] for w in t.writes[2:]] == [DYNAMIC] * 2 for t in tiles)
    tg = build_taskgraph(g, opts)
    op_of = {t.id: t.op for t in tg.tasks}
    assert not [e for e in tg.events for p in e.preds for s in e.succs if op_of[p] == op_of[s]]
    from tilec.verify import verify_taskgraph
    verify_taskgraph(tg, "tasks", opts)


def _layer_ops(graph: OpGraph):
    rope = next(op for op in graph.ops if op.kind == "rope")
    return rope, graph.ops.index(rope)


def test_pass_refuses_another_reader_a_writer_between_a_dtype_change_and_moving_cos(llama_graph):
    rope, i = _layer_ops(llama_graph)
    kslot = rope.outputs[0]
    k_whole = View.whole(llama_graph.buffers[kslot.buffer])
    peek_buf = Buffer("peek", k_whole.shape, torch.float32, BufferKind.TEMP)
    ops = list(llama_graph.ops)  # another op reads the key cache
    ops.append(Op("peek", "unary", (k_whole,), (View.whole(peek_buf),), (("fn", "neg"),)))
    read = dataclasses.replace(llama_graph, ops=tuple(ops), buffers={**llama_graph.buffers, "peek": peek_buf})
    assert appended(fold_kv_append(read)) == 1  # the other layer still folds
    x = rope.inputs[0]
    ops = list(llama_graph.ops)  # an op between the rope and the attention overwrites the rope's input
    ops.insert(i + 1, Op("clobber", "unary", (x,), (x,), (("fn", "neg"),)))
    assert appended(fold_kv_append(dataclasses.replace(llama_graph, ops=tuple(ops)))) == 1
    cw = next(op for op in llama_graph.ops if op.kind == "cache_write")
    b = llama_graph.buffers[cw.inputs[0].buffer]  # the values' dtype differs from the cache's
    bf16 = dataclasses.replace(llama_graph, buffers={**llama_graph.buffers,
                                                     b.name: dataclasses.replace(b, dtype=torch.bfloat16)})
    assert appended(fold_kv_append(bf16)) == 1
    cos = rope.inputs[1]  # the keys' cos rows are not the queries' (another offset)
    moved = dataclasses.replace(rope, inputs=(x, dataclasses.replace(cos, offset=cos.offset + 1), rope.inputs[2]))
    ops = list(llama_graph.ops)
    ops[i] = moved
    assert appended(fold_kv_append(dataclasses.replace(llama_graph, ops=tuple(ops)))) == 1
    ops[i] = dataclasses.replace(rope, outputs=(dataclasses.replace(kslot, pos_stride=2 * kslot.pos_stride),))
    assert appended(fold_kv_append(dataclasses.replace(llama_graph, ops=tuple(ops)))) == 1  # not row p


def test_append_needs_the_folded_rope_and_a_causal_attention(llama_graph):
    part = next(op for op in fold_kv_append(llama_graph).ops if op.kind == "attention_partial")
    d = opreg.opdef(part.kind)
    assert d.params(part)[3:] == [1, 1, -1] and len(d.operands(part)) == 12
    for attr in ("rope", "causal"):
        attrs = dict(part.attrs, **{attr: None if attr == "rope" else False})
        bad = dataclasses.replace(part, attrs=tuple(sorted(attrs.items())))
        with pytest.raises(TilecError, match=f"op {part.name}: appending the new KV rows needs"):
            d.params(bad)
    no_rope = [dataclasses.replace(op, attrs=tuple(a for a in op.attrs if a[0] != "rope"))
               if op.kind == "attention_partial" else op for op in llama_graph.ops]
    assert appended(fold_kv_append(dataclasses.replace(llama_graph, ops=tuple(no_rope)))) == 0


def _decode_graph(b, hq, hkv, sq, s, d, dtype, extra_rows=0) -> OpGraph:
    """One decode attention over Sq tokens as the frontend lowers it: the queries' and keys' RoPE
    (cos / sin [B, Sq, D] broadcast over the heads), the rotated keys into the key cache slot and the
    values copied into the value slot (rows p .. p + Sq - 1), then causal attention over the caches
    (with ``extra_rows``: over their first S rows only, while the steps write up to S + extra_rows)."""
    bufs = {"x": Buffer("x", (b, hq, sq, d), dtype, BufferKind.INPUT),
            "kx": Buffer("kx", (b, hkv, sq, d), dtype, BufferKind.INPUT),
            "vx": Buffer("vx", (b, hkv, sq, d), dtype, BufferKind.INPUT),
            "cos": Buffer("cos", (b, sq, d), dtype, BufferKind.INPUT),
            "sin": Buffer("sin", (b, sq, d), dtype, BufferKind.INPUT),
            "q": Buffer("q", (b, hq, sq, d), dtype, BufferKind.TEMP),
            "k": Buffer("k", (b, hkv, s + extra_rows, d), dtype, BufferKind.STATE),
            "v": Buffer("v", (b, hkv, s + extra_rows, d), dtype, BufferKind.STATE),
            "out": Buffer("out", (b, hq, sq, d), dtype, BufferKind.OUTPUT)}
    w = {n: View.whole(buf) for n, buf in bufs.items()}
    cs = {(n, h): View(n, (b, h, sq, d), (sq * d, 0, d, 1), 0, 0) for n in ("cos", "sin") for h in (hq, hkv)}
    rows = s + extra_rows
    cache = {n: View(n, (b, hkv, s, d), (hkv * rows * d, rows * d, d, 1), 0, 0) for n in ("k", "v")}
    slot = {n: View(n, (b, hkv, sq, d), (hkv * rows * d, rows * d, d, 1), 0, d) for n in ("k", "v")}
    ops = (Op("rope_q", "rope", (w["x"], cs["cos", hq], cs["sin", hq]), (w["q"],), (("style", 0),)),
           Op("rope_k", "rope", (w["kx"], cs["cos", hkv], cs["sin", hkv]), (slot["k"],), (("style", 0),)),
           Op("write_v", "cache_write", (w["vx"],), (slot["v"],)),
           Op("attn", "attention", (w["q"], cache["k"], cache["v"]), (w["out"],),
              (("causal", True), ("scale", d ** -0.5))))
    return OpGraph(ops, bufs, ("x", "kx", "vx", "cos", "sin", "k", "v", "<position>"), (w["out"],),
                   max_positions=rows - sq + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("position", [7, 12, 35])
def test_new_rows_across_a_split_boundary_append_bitwise(dtype, position):
    """Batch 2, 8 query heads over 2 KV heads, Sq = 3 tokens, 8-position splits: at position 7 the
    new rows 7..9 fall in two splits, each tile writing its own; the caches and the output are
    bitwise the unfolded plan's, and rows outside p .. p + 2 are untouched."""
    from tilec.pipeline import compile_opgraph
    from tilec.refexec import ReferenceExecutor

    b, hq, hkv, sq, s, d = 2, 8, 2, 3, 38, 32
    torch.manual_seed(0)
    ang = torch.randn(b, sq, d // 2) * 3
    emb = torch.cat([ang, ang], -1)
    inputs = {"x": torch.randn(b, hq, sq, d).to(dtype), "kx": torch.randn(b, hkv, sq, d).to(dtype),
              "vx": torch.randn(b, hkv, sq, d).to(dtype), "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype),
              "k": torch.randn(b, hkv, s, d).to(dtype), "v": torch.randn(b, hkv, s, d).to(dtype)}
    outs = {}
    for fold in (True, False):
        plan = compile_opgraph(_decode_graph(b, hq, hkv, sq, s, d, dtype),
                               Options(workers=5, attn_kv_chunk=8, fold_kv_append=fold, fold_combine=False)).plan
        assert [op.kind for op in plan.graph.ops] == (["attention_partial", "attention_combine"] if fold else
                                                      ["rope", "cache_write", "attention_partial", "attention_combine"])
        t = {k: v.clone() for k, v in inputs.items()}
        for name, buf in plan.graph.buffers.items():
            t.setdefault(name, torch.full(buf.shape, float("nan"), dtype=buf.dtype))
        ReferenceExecutor(plan).run(t, plan.bind(t, position))
        outs[fold] = t
    on, off = outs[True], outs[False]
    assert torch.isfinite(on["out"].float()).all() and torch.equal(on["out"], off["out"])
    assert torch.equal(on["k"], off["k"]) and torch.equal(on["v"], off["v"])
    rows = torch.ones(s, dtype=torch.bool)
    rows[position:position + sq] = False
    assert torch.equal(on["k"][:, :, rows], inputs["k"][:, :, rows]) and not torch.equal(on["k"], inputs["k"])
    assert torch.equal(on["v"][:, :, position:position + sq], inputs["vx"])


def test_an_attention_over_a_prefix_of_the_cache_is_not_folded():
    """The steps write rows up to S + 4 of a cache the attention reads only the first S rows of:
    folded, no tile would hold (and write) the rows past S, so the pass keeps the rope and the
    cache_write (found by review: the cache then differed from the unfolded plan's at p >= S)."""
    from tilec.pipeline import compile_opgraph

    plan = compile_opgraph(_decode_graph(1, 2, 1, 1, 16, 8, torch.float32, extra_rows=4),
                           Options(workers=4, attn_kv_chunk=4)).plan
    kinds = [op.kind for op in plan.graph.ops]
    assert "rope" in kinds and "cache_write" in kinds and not any(op.attr("append") for op in plan.graph.ops)


def test_an_appending_op_the_device_would_misread_is_an_error(llama_graph):
    """The device reads k_new as the queries' dtype, v_new and the slots as the caches', and the
    slots as the caches at the position's rows: an op built otherwise (by hand, or a future pass) is
    refused when its dtypes or slots are encoded, naming the op."""
    g = fold_kv_append(llama_graph)
    part = next(op for op in g.ops if op.kind == "attention_partial")
    d = opreg.opdef(part.kind)
    f32 = [torch.float32] * 11
    assert d.device_dtypes(part, f32) == f32[:5]
    want = f"op {part.name}: v_new is torch.bfloat16, the device reads it as torch.float32"
    with pytest.raises(TilecError, match=want):
        d.device_dtypes(part, f32[:8] + [torch.bfloat16] + f32[9:])
    k_slot = part.outputs[2]
    moved = dataclasses.replace(part, outputs=(*part.outputs[:2], dataclasses.replace(k_slot, offset=k_slot.offset + 1),
                                               part.outputs[3]))
    with pytest.raises(TilecError, match=f"op {part.name}: slot .* is not .* at the position's rows"):
        d.params(moved)
