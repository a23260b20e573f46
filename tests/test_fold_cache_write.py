"""Cache-write folding (``tilec.passes.fold_cache_write``): a RoPE op writes the KV-cache slot
itself, with bitwise the results of the unfolded plan (reference executor), and the pass
refuses what it must not fold."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from _helpers import StageRecorder, assert_steps_bitwise_equal, step_pair
from tilec.api import compile_module
from tilec.hf import compile_decode_step
from tilec.ir import Buffer, BufferKind, Op, OpGraph, View
from tilec.options import Options
from tilec.passes import fold_cache_writes
from tilec.zoo import make_model, prefill


def kinds(graph: OpGraph) -> dict[str, int]:
    return dict(collections.Counter(op.kind for op in graph.ops))


def cache_ropes(graph: OpGraph) -> list[Op]:
    """The rope ops writing a STATE buffer (folded cache writes)."""
    return [op for op in graph.ops if op.kind == "rope" and graph.buffers[op.outputs[0].buffer].kind is BufferKind.STATE]


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_folded_equals_unfolded(name, dtype):
    model, tok, folded, unfolded = step_pair(name, dtype, dict(fold_cache_writes=False))
    g, gu = folded[0].program.plan.graph, unfolded[0].program.plan.graph
    layers = model.config.num_hidden_layers
    # per layer: the K cache_write became the k rope's output; the V one (after a linear) stays
    assert kinds(gu)["cache_write"] == 2 * layers and not cache_ropes(gu)
    assert kinds(g)["cache_write"] == layers and kinds(g)["rope"] == 2 * layers
    assert len(cache_ropes(g)) == layers and len(g.ops) == len(gu.ops) - layers
    ropes_out = {op.outputs[0].buffer for op in g.ops if op.kind == "rope"}
    assert not any(op.inputs[0].buffer in ropes_out for op in g.ops if op.kind == "cache_write")
    assert_steps_bitwise_equal(folded, unfolded, tok, "folded and unfolded")


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RopeIntoCache(torch.nn.Module):
    """k = rope(proj(x)) written into ``cache`` at ``pos``; returns ``k * 2`` (``share``: the rope
    output has a second reader, so the cache write must stay) or ``x * 2``."""

    def __init__(self, share: bool, heads=2, dim=16):
        super().__init__()
        self.share, self.heads, self.dim = share, heads, dim
        self.k_proj = torch.nn.Linear(heads * dim, heads * dim, bias=False)

    def forward(self, x, cos, sin, pos, cache):
        b = x.shape[0]
        k = self.k_proj(x).view(b, 1, self.heads, self.dim).transpose(1, 2)
        k = k * cos + rotate_half(k) * sin
        cache.index_copy_(2, pos, k)
        return k * 2 if self.share else x * 2


@pytest.mark.parametrize("share", [False, True])
def test_rope_output_with_another_reader_is_not_folded(share):
    torch.manual_seed(0)
    m = RopeIntoCache(share).eval()
    x, cache = torch.randn(2, 1, 32), torch.randn(2, 2, 8, 16)
    ang = torch.randn(2, 1, 1, 8)
    cos, sin = torch.cos(ang).repeat(1, 1, 1, 2), torch.sin(ang).repeat(1, 1, 1, 2)
    rec = StageRecorder()
    prog = compile_module(m, (x, cos, sin, torch.tensor([0]), cache.clone()), positions=[3], max_positions=8,
                          options=dict(workers=3), hook=rec)
    assert kinds(rec.stages["fuse_gemv"])["cache_write"] == 1
    folded = rec.stages["fold_cache"]
    assert kinds(folded).get("cache_write", 0) == (1 if share else 0)
    assert len(cache_ropes(folded)) == (0 if share else 1)
    if share:
        assert folded is rec.stages["fuse_gemv"]
    for p in (0, 5, 7):
        mine, ref = cache.clone(), cache.clone()
        with torch.no_grad():
            want = m(x, cos, sin, torch.tensor([p]), ref)
        got = prog(x, cos, sin, torch.tensor([p]), mine)
        assert torch.equal(got, want), f"position {p}: output differs from eager"
        assert torch.equal(mine, ref), f"position {p}: cache differs from eager"


@pytest.fixture(scope="module")
def llama_graph() -> OpGraph:
    """llama-tiny's OpGraph just before fold_cache (2 layers, float32)."""
    model = make_model("llama-tiny", torch.float32, "cpu")
    cache, _ = prefill(model, 1, 4, 12, "cpu")
    rec = StageRecorder()
    compile_decode_step(model, cache, 1, options=dict(workers=4, fold_cache_writes=False), hook=rec)
    return rec.stages["fuse_gemv"]


def first_fold(graph: OpGraph) -> tuple[int, int]:
    """Indices of the first ``rope -> cache_write`` pair of ``graph``."""
    j = next(j for j, op in enumerate(graph.ops) if op.kind == "cache_write"
             and any(r.kind == "rope" and r.outputs == op.inputs for r in graph.ops))
    i = next(i for i, op in enumerate(graph.ops) if op.kind == "rope" and op.outputs == graph.ops[j].inputs)
    return i, j


def test_pass_folds_each_k_write_and_respects_the_option(llama_graph):
    g = fold_cache_writes(llama_graph)
    assert len(g.ops) == len(llama_graph.ops) - 2 and len(cache_ropes(g)) == 2
    i, j = first_fold(llama_graph)
    rope, write = llama_graph.ops[i], llama_graph.ops[j]
    new = next(op for op in g.ops if op.name == rope.name)
    assert new.outputs == write.outputs and new.inputs == rope.inputs and new.provenance == rope.provenance
    assert rope.outputs[0].buffer not in g.buffers and write.name not in {op.name for op in g.ops}
    assert fold_cache_writes(llama_graph, Options(fold_cache_writes=False)) is llama_graph
    assert fold_cache_writes(g) is g  # nothing left to fold


def test_pass_refuses_a_reader_between_rope_and_write(llama_graph):
    _, j = first_fold(llama_graph)
    slot = llama_graph.ops[j].outputs[0]
    peek_buf = Buffer("peek", slot.shape, torch.float32, BufferKind.TEMP)
    peek = Op("peek", "unary", (slot,), (View.whole(peek_buf),), (("fn", "neg"),))
    ops = list(llama_graph.ops)
    ops.insert(j, peek)  # between the rope and its cache_write, reading the cache
    g = dataclasses.replace(llama_graph, ops=tuple(ops), buffers={**llama_graph.buffers, "peek": peek_buf})
    out = fold_cache_writes(g)
    assert len(cache_ropes(out)) == 1 and llama_graph.ops[j] in out.ops  # the other layer still folds


def test_pass_refuses_a_dtype_change_and_a_graph_output(llama_graph):
    i, _ = first_fold(llama_graph)
    temp = llama_graph.ops[i].outputs[0]
    b = llama_graph.buffers[temp.buffer]
    bf16 = dataclasses.replace(llama_graph, buffers={**llama_graph.buffers,
                                                     b.name: dataclasses.replace(b, dtype=torch.bfloat16)})
    assert len(cache_ropes(fold_cache_writes(bf16))) == 1
    returned = dataclasses.replace(llama_graph, outputs=llama_graph.outputs + (temp,))
    assert len(cache_ropes(fold_cache_writes(returned))) == 1
