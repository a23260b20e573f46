"""Query-RoPE folding (``tilec.passes.fold_rope``): the split-KV attention tiles apply the queries'
RoPE themselves, with bitwise the results of the plan with a rope op (reference executor), and
the pass refuses what it must not fold."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from _helpers import SPLIT, StageRecorder, assert_fold_pair_matches, fold_pair, gemv_groups_graph, kinds
from tilec.ir import Buffer, BufferKind, Op, OpGraph, View
from tilec.options import Options
from tilec.passes import fold_rope

@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_folded_equals_unfolded_and_eager(name, dtype):
    rec = StageRecorder()
    # the append fold (on by default, tests/test_fold_kv_append.py) would take the key rope too
    model, tok, on, off, want = fold_pair(name, dtype, dict(SPLIT, fold_kv_append=False), dict(SPLIT, fold_rope=False),
                                   hook=rec)
    layers = model.config.num_hidden_layers
    g, gu = on[0].program.plan.graph, off[0].program.plan.graph
    # per layer: the q rope is gone (the k rope stays, writing the cache slot)
    assert kinds(gu)["rope"] == 2 * layers and kinds(g)["rope"] == layers
    parts = [op for op in g.ops if op.kind == "attention_partial"]
    assert len(parts) == layers and all(op.attr("rope") == 0 and len(op.inputs) == 5 for op in parts)
    assert not any(op.attr("rope") is not None for op in gu.ops)
    assert "fold_cache" in rec.stages and len(g.ops) == len(gu.ops) - layers
    # folded after the GEMV sizing: the q projection keeps the tiles sized before the fold
    splits = [[op.attr("col_split") for op in gr.ops if op.kind.startswith("linear")] for gr in (g, gu)]
    assert splits[0] == splits[1] and any(s is not None for s in splits[0])
    assert_fold_pair_matches(tok, on, off, want, "folded and unfolded")


@pytest.fixture(scope="module")
def llama_graph() -> OpGraph:
    """llama-tiny's OpGraph just before fold_rope (2 layers, float32, split-KV attention)."""
    return gemv_groups_graph(fold_rope=False)


def query_ropes(graph: OpGraph) -> list[Op]:
    """The rope ops whose output an attention_partial reads as its queries."""
    qs = {op.inputs[0].buffer for op in graph.ops if op.kind == "attention_partial"}
    return [op for op in graph.ops if op.kind == "rope" and op.outputs[0].buffer in qs]


def test_pass_folds_each_query_rope_and_respects_the_option(llama_graph):
    ropes = query_ropes(llama_graph)
    assert len(ropes) == 2
    g = fold_rope(llama_graph)
    assert not query_ropes(g) and len(g.ops) == len(llama_graph.ops) - 2
    for rope in ropes:
        assert rope.outputs[0].buffer not in g.buffers and rope.name not in {op.name for op in g.ops}
    part = next(op for op in g.ops if op.kind == "attention_partial")
    old = next(op for op in llama_graph.ops if op.name == part.name)
    x, cos, sin = ropes[0].inputs
    assert part.inputs == (x, *old.inputs[1:], cos, sin) and part.provenance == old.provenance
    assert fold_rope(llama_graph, Options(fold_rope=False)) is llama_graph
    assert fold_rope(g) is g  # nothing left to fold


def test_pass_refuses_a_second_reader_a_writer_between_and_a_dtype_change(llama_graph):
    rope = query_ropes(llama_graph)[0]
    i = llama_graph.ops.index(rope)
    q = rope.outputs[0]
    peek_buf = Buffer("peek", q.shape, torch.float32, BufferKind.TEMP)
    ops = list(llama_graph.ops)
    ops.insert(i + 1, Op("peek", "unary", (q,), (View.whole(peek_buf),), (("fn", "neg"),)))
    shared = dataclasses.replace(llama_graph, ops=tuple(ops), buffers={**llama_graph.buffers, "peek": peek_buf})
    assert len(query_ropes(fold_rope(shared))) == 1  # the other layer still folds
    x = rope.inputs[0]
    ops = list(llama_graph.ops)  # an op between the rope and the attention overwrites the rope's input
    ops.insert(i + 1, Op("clobber", "unary", (x,), (x,), (("fn", "neg"),)))
    clobbered = dataclasses.replace(llama_graph, ops=tuple(ops))
    assert len(query_ropes(fold_rope(clobbered))) == 1
    b = llama_graph.buffers[q.buffer]
    bf16 = dataclasses.replace(llama_graph, buffers={**llama_graph.buffers,
                                                     b.name: dataclasses.replace(b, dtype=torch.bfloat16)})
    assert len(query_ropes(fold_rope(bf16))) == 1
    returned = dataclasses.replace(llama_graph, outputs=llama_graph.outputs + (q,))
    assert len(query_ropes(fold_rope(returned))) == 1


def _rope_attention_graph(b, hq, hkv, sq, s, d, dtype) -> OpGraph:
    """rope(x, cos, sin) -> q -> causal attention over a static cache, with x stored [B, Sq, Hq, D]
    and read as [B, Hq, Sq, D] (HF's layout before its transpose) and cos / sin [B, Sq, D]
    broadcast over the heads with zero strides."""
    xb = Buffer("x", (b, sq, hq, d), dtype, BufferKind.INPUT)
    xv = View("x", (b, hq, sq, d), (sq * hq * d, d, hq * d, 1), 0, 0)
    bufs = {"x": xb, "cos": Buffer("cos", (b, sq, d), dtype, BufferKind.INPUT),
            "sin": Buffer("sin", (b, sq, d), dtype, BufferKind.INPUT),
            "q": Buffer("q", (b, hq, sq, d), dtype, BufferKind.TEMP),
            "k": Buffer("k", (b, hkv, s, d), dtype, BufferKind.STATE),
            "v": Buffer("v", (b, hkv, s, d), dtype, BufferKind.STATE),
            "out": Buffer("out", (b, hq, sq, d), dtype, BufferKind.OUTPUT)}
    cs = {n: View(n, (b, hq, sq, d), (sq * d, 0, d, 1), 0, 0) for n in ("cos", "sin")}
    w = {n: View.whole(buf) for n, buf in bufs.items()}
    rope = Op("rope", "rope", (xv, cs["cos"], cs["sin"]), (w["q"],), (("style", 0),))
    att = Op("attn", "attention", (w["q"], w["k"], w["v"]), (w["out"],), (("causal", True), ("scale", d ** -0.5)))
    return OpGraph((rope, att), bufs, ("x", "cos", "sin", "k", "v", "<position>"), (w["out"],),
                   max_positions=s - sq + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_queries_over_several_tokens_fold_bitwise(dtype):
    """Batch 2, 8 query heads over 2 KV heads, Sq = 2 tokens, queries read through a transposed
    view: the folded plan's reference run is bitwise the unfolded one's (float32 once differed in
    the last bit: the folded tile kept x's strided layout for its matmul)."""
    from tilec.pipeline import compile_opgraph
    from tilec.refexec import ReferenceExecutor

    b, hq, hkv, sq, s, d = 2, 8, 2, 2, 37, 32
    torch.manual_seed(0)
    ang = torch.randn(b, sq, d // 2) * 3
    emb = torch.cat([ang, ang], -1)
    inputs = {"x": torch.randn(b, sq, hq, d).to(dtype), "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype),
              "k": torch.randn(b, hkv, s, d).to(dtype), "v": torch.randn(b, hkv, s, d).to(dtype)}
    outs = {}
    for fold in (True, False):
        plan = compile_opgraph(_rope_attention_graph(b, hq, hkv, sq, s, d, dtype),
                               Options(workers=5, attn_kv_chunk=8, fold_rope=fold)).plan
        assert ("rope" in [op.kind for op in plan.graph.ops]) != fold
        t = {k: v.clone() for k, v in inputs.items()}
        for name, buf in plan.graph.buffers.items():
            t.setdefault(name, torch.full(buf.shape, float("nan"), dtype=buf.dtype))
        ReferenceExecutor(plan).run(t, plan.bind(t, s - sq - 3))
        outs[fold] = t["out"]
    assert torch.isfinite(outs[True].float()).all() and torch.equal(outs[True], outs[False])


def test_a_folded_rope_other_than_rotate_half_is_refused(llama_graph):
    """The device applies rotate-half only: an attention_partial carrying another style is an
    error naming the op, not a silently wrong rotation."""
    from tilec import ops as opreg
    from tilec.errors import TilecError

    part = next(op for op in fold_rope(llama_graph).ops if op.kind == "attention_partial")
    assert opreg.opdef(part.kind).params(part)[3] == 1  # rotate-half + 1
    bad = dataclasses.replace(part, attrs=tuple(sorted(dict(part.attrs, rope=1).items())))
    with pytest.raises(TilecError, match=f"op {part.name}: folded RoPE style 1"):
        opreg.opdef(bad.kind).params(bad)
