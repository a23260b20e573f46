"""Split-KV (flash-decoding) attention: the ``split_kv`` pass and the ``attention_partial`` /
``attention_combine`` ops on the CPU reference executor.

Attention graphs are built by hand (q input, k/v caches, one ``attention`` op), compiled
through the whole pipeline and run on the reference executor at a decode position; results
are compared with ``F.scaled_dot_product_attention`` (float32) and with the single-pass
``attention`` op. An HF Llama step with a longer cache and a forced split is compared with eager.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _helpers import StageRecorder, assert_close, attention_graph

from tilec.errors import TilecError
from tilec.hf import cache_kwargs, compile_decode_step
from tilec.ir import Buffer, BufferKind
from tilec.ops import opdef
from tilec.options import Options
from tilec.passes.split_kv import kv_chunk, split_kv
from tilec.pipeline import compile_opgraph
from tilec.refexec import ReferenceExecutor


def run_graph(graph, opts, q, k, v, p):
    """Compiles ``graph`` and runs it on the reference executor at position ``p``: (out, compiled)."""
    compiled = compile_opgraph(graph, opts)
    plan = compiled.plan
    tensors = {"q": q, "k": k, "v": v}
    for name, buf in plan.graph.buffers.items():
        if name not in tensors:  # intermediates and the output: poisoned, so a missed write shows
            tensors[name] = torch.full(buf.shape, float("nan"), dtype=buf.dtype)
    ReferenceExecutor(plan).run(tensors, plan.bind(tensors, p))
    return tensors["out"], compiled


def sdpa_reference(q, k, v, valid, causal, scale):
    g = q.shape[1] // k.shape[1]
    sq, s = q.shape[2], k.shape[2]
    mask = None
    if causal:
        mask = torch.arange(s).view(1, s) < (valid + torch.arange(sq)).view(sq, 1)
    return F.scaled_dot_product_attention(q.double(), k.repeat_interleave(g, 1).double(),
                                          v.repeat_interleave(g, 1).double(), attn_mask=mask, scale=scale).float()


# (batch, Hq, Hkv, Sq, S, D, Dv, chunk, position p, causal)
CASES = [
    pytest.param(1, 4, 1, 1, 100, 64, 64, 32, 99, True, id="S-not-multiple-of-chunk"),
    pytest.param(1, 8, 2, 1, 128, 64, 64, 32, 40, True, id="causal-empty-splits"),
    pytest.param(2, 8, 2, 2, 100, 64, 32, 32, 70, True, id="gqa4-sq2-batch2-dv32"),
    pytest.param(2, 16, 4, 2, 96, 128, 96, 40, 9, True, id="d128-dv96-mostly-empty"),
    pytest.param(1, 6, 3, 1, 77, 128, 128, 16, 0, False, id="no-mask-d128"),
    pytest.param(2, 8, 8, 3, 50, 24, 40, 7, 30, True, id="mha-odd-dims"),
]


@pytest.mark.parametrize("b,hq,hkv,sq,s,d,dv,chunk,p,causal", CASES)
def test_partial_combine_matches_sdpa_and_single_pass(b, hq, hkv, sq, s, d, dv, chunk, p, causal):
    q, k, v = torch.randn(b, hq, sq, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, dv)
    graph = attention_graph(b, hq, hkv, sq, s, d, dv, causal)
    out, compiled = run_graph(graph, Options(workers=5, attn_kv_chunk=chunk, fold_combine=False), q, k, v, p)
    assert [op.kind for op in compiled.plan.graph.ops] == ["attention_partial", "attention_combine"]
    valid = p + 1 if causal else s
    assert_close(out, sdpa_reference(q, k, v, valid, causal, 0.125), 1e-5, "split-KV vs SDPA")
    single, c1 = run_graph(graph, Options(workers=5, attn_kv_chunk=s), q, k, v, p)
    assert [op.kind for op in c1.plan.graph.ops] == ["attention"]
    assert_close(out, single, 1e-5, "split-KV vs the single-pass attention op")
    # the combine folded into the partials (tilec.passes.fold_combine): bitwise the same
    folded, cf = run_graph(graph, Options(workers=5, attn_kv_chunk=chunk), q, k, v, p)
    assert [op.kind for op in cf.plan.graph.ops] == ["attention_partial"] and torch.equal(folded, out)


def test_bf16_rounding_matches_single_pass_when_one_split_sees_everything():
    """p is rounded to V's dtype relative to the split's max; with every visible position in
    split 0 (the rest empty) that is the global max, so partial + combine equals the
    single-pass op up to float32 summation order."""
    b, hq, hkv, sq, s, d = 1, 8, 2, 1, 96, 64
    q, k, v = (torch.randn(b, hq, sq, d).bfloat16(), torch.randn(b, hkv, s, d).bfloat16(),
               torch.randn(b, hkv, s, d).bfloat16())
    graph = attention_graph(b, hq, hkv, sq, s, d, d, dtype=torch.bfloat16)
    split, _ = run_graph(graph, Options(workers=4, attn_kv_chunk=32), q, k, v, 20)
    single, _ = run_graph(graph, Options(workers=4, attn_kv_chunk=s), q, k, v, 20)
    assert_close(split.float(), single.float(), 1e-2)
    assert (split.float() - single.float()).abs().max() <= 2 ** -7 * single.float().abs().max()


def test_empty_split_writes_neutral_partials():
    b, hq, hkv, sq, s, d = 1, 4, 1, 1, 96, 32
    q, k, v = torch.randn(b, hq, sq, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    graph = attention_graph(b, hq, hkv, sq, s, d, d)
    compiled = compile_opgraph(graph, Options(workers=4, attn_kv_chunk=32))
    plan = compiled.plan
    tensors = {"q": q, "k": k, "v": v}
    for name, buf in plan.graph.buffers.items():
        tensors.setdefault(name, torch.full(buf.shape, float("nan"), dtype=buf.dtype))
    ReferenceExecutor(plan).run(tensors, plan.bind(tensors, 10))  # valid = 11: splits 1, 2 see nothing
    o_part, ml = tensors["attn_opart"], tensors["attn_ml"]
    assert torch.isfinite(o_part).all()
    assert (ml[:, :, 1:, 0] == float("-inf")).all() and (ml[:, :, 1:, 1] == 0).all() and (o_part[:, :, 1:] == 0).all()
    assert torch.isfinite(ml[:, :, 0]).all() and (ml[:, :, 0, 1] >= 1).all()


# ---- the pass -----------------------------------------------------------------------------------

def test_split_kv_rewrites_attention_into_partial_and_combine():
    graph = attention_graph(2, 8, 2, 2, 100, 64, 32)
    rec = StageRecorder()
    compiled = compile_opgraph(graph, Options(workers=8, attn_kv_chunk=32, fold_combine=False), hook=rec)
    assert list(rec.stages)[:6] == ["opgraph", "split_kv", "fuse_gemv", "fold_cache", "gemv_groups", "tasks"]
    assert rec.stages["opgraph"] is graph
    g = rec.stages["split_kv"]
    assert compiled.plan.graph is g
    part, comb = g.ops
    assert (part.name, part.kind, comb.name, comb.kind) == ("attn_partial", "attention_partial",
                                                            "attn_combine", "attention_combine")
    assert part.attr("chunk") == 32 and part.attr("causal") is True and part.attr("scale") == 0.125
    assert part.inputs == graph.ops[0].inputs and comb.outputs == graph.ops[0].outputs
    assert comb.inputs == part.outputs and comb.attr("kv_heads") == 2
    # o_part [B, Hq * Sq, NS, Dv] and ml [B, Hq * Sq, NS, 2], float32 intermediates named after the op
    assert g.buffers["attn_opart"] == Buffer("attn_opart", (2, 16, 4, 32), torch.float32, BufferKind.TEMP)
    assert g.buffers["attn_ml"] == Buffer("attn_ml", (2, 16, 4, 2), torch.float32, BufferKind.TEMP)
    text = g.render()
    assert "attn_partial = attention_partial(q[2x8x2x64], k[2x2x100x64], v[2x2x100x32]) -> " \
           "attn_opart[2x16x4x32], attn_ml[2x16x4x2] causal=True chunk=32 scale=0.125" in text
    assert "attn_combine = attention_combine(attn_opart[2x16x4x32], attn_ml[2x16x4x2]) -> out[2x8x2x32] " \
           "kv_heads=2" in text
    # tiles: (batch, KV head, split) partials; one combine per (batch, KV head group) waiting on its splits
    tg = rec.stages["tasks"]
    labels = [t.label() for t in tg.tasks]
    assert sum(t.kind == "attention_partial" for t in tg.tasks) == 2 * 2 * 4
    assert sum(t.kind == "attention_combine" for t in tg.tasks) == 2 * 2
    assert "t3 attn_partial[0:1,0:1,3:4]" in labels and "t16 attn_combine[0:1,0:4]" in labels
    combine_waits = [e for e in tg.events if any(tg.tasks[s].kind == "attention_combine" for s in e.succs)]
    assert len(combine_waits) == 4
    assert all(e.strategy == "tile_cover" and len(e.preds) == 4 for e in combine_waits)


def test_no_split_below_two_splits_keeps_the_graph():
    graph = attention_graph(1, 8, 2, 1, 64, 32, 32)
    assert split_kv(graph, Options(attn_kv_chunk=64)) is graph
    assert split_kv(graph, Options(attn_kv_chunk=1000)) is graph
    assert split_kv(graph, Options(workers=132)) is graph  # auto: at least 64 positions per split
    assert [op.kind for op in split_kv(graph, Options(attn_kv_chunk=63)).ops] == ["attention_partial",
                                                                                  "attention_combine"]


def test_auto_chunk():
    o = Options()  # 132 workers
    assert kv_chunk(1, 8, 1032, o) == 96  # Llama-3.2-1B at context 1024: 11 splits, 88 tiles
    assert kv_chunk(1, 8, 1024, o) == 64  # 16 splits, 128 tiles
    assert kv_chunk(1, 8, 4096, o) == 256
    assert kv_chunk(1, 2, 16, Options(workers=8)) == 64  # short caches: no split
    assert kv_chunk(64, 8, 1 << 16, o) == 288  # more groups than workers: the cap still splits
    assert kv_chunk(16, 8, 1032, o) == 288  # Llama-3.2-1B at batch 16: 4 splits of each of 128 pairs
    # batch 4 at context 1024 (the benchmark's cache of 1088): 4 splits of 288 for each of the 32 (batch, KV
    # head) pairs, 128 tiles on 132 workers (5 splits of 256 made 160: 28 workers ran two, the step 6 % slower)
    assert kv_chunk(4, 8, 1088, o) == 288 and 32 * -(-1088 // 288) <= o.workers
    assert kv_chunk(1, 8, 4160, o) == 288  # batch 1 at context 4096: 15 splits, 120 tiles (256: 17, 136 tiles)
    # rounds x tile time (a reviewer's cases for a plain cap of 288): at batch 4 over 1536 positions 8 splits of 192
    # (256 tiles, two rounds of shorter tiles) rather than 6 of 256 or 5 of 288 and a remnant; at batch 1 over 8256,
    # 33 splits of 256 (264 tiles, two rounds) rather than 29 of 288 (two rounds of longer tiles)
    assert kv_chunk(4, 8, 1536, o) == 192
    assert kv_chunk(1, 8, 8256, o) == 256 and kv_chunk(1, 8, 8192, o) == 256
    assert kv_chunk(1, 8, 1088, o, pos_bytes=512) == 96  # Llama-3.1-8B (head dim 128) at context 1024


def test_auto_chunk_edge_cases():
    """A reviewer's cases: a measured rate of 0 (no size dependence, as tilec.cost allows) divided by zero, and
    so did an empty cache; heads a tile past the KV heads counted heads the tile does not hold."""
    from tilec.cost import measured_overrides

    with measured_overrides({"attention_partial": (13.0, 0.0)}):
        assert kv_chunk(1, 8, 1088, Options()) == 288  # no size cost: one round either way, the longest split
    assert kv_chunk(1, 8, 0, Options()) == 64 and kv_chunk(1, 8, 64, Options()) == 64
    assert kv_chunk(32, 1, 6176, Options(attn_heads_per_tile=8)) == kv_chunk(32, 1, 6176, Options())
    assert kv_chunk(1, 8, 4096, Options(attn_heads_per_tile=2)) == 128  # 4 groups of 2 heads: 33 splits each
    assert kv_chunk(1, 8, 1024, Options(attn_kv_chunk=100)) == 100


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True])
def test_attn_kv_chunk_option_is_validated(bad):
    with pytest.raises(ValueError, match="attn_kv_chunk"):
        Options(attn_kv_chunk=bad)


def test_head_dim_over_256_is_rejected_for_cuda():
    graph = split_kv(attention_graph(1, 2, 1, 1, 128, 320, 64), Options(attn_kv_chunk=32))
    with pytest.raises(TilecError, match="head dim 320/64 > 256"):
        opdef("attention_partial").smem_bytes(graph.ops[0])


@pytest.mark.parametrize("d,dv,chunk,want", [
    # queries 4 x 256 floats + 32 statistics, then the largest region (floats); a staged segment
    # of n positions: 4 x (39 + 19) floats of padding, then per position 4 scores, 2 words of
    # probabilities and a K and a V row 16 bytes longer than (d + dv) / 2 floats
    (64, 64, 128, 4 * 58 + (4 + 2 + 72) * 128),    # Llama-3.2-1B: staged scores + K/V rows of the split
    (128, 128, 96, 4 * 58 + (4 + 2 + 136) * 96),   # Qwen3-0.6B at the automatic 96-position splits
    (64, 64, 3000, 4 * 58 + (4 + 2 + 72) * 128),   # long splits: 128 staged rows (> 2048 scores)
    (16, 16, 3000, 4 * 2048),            # small heads: a 2048-score segment
    (256, 256, 128, 8 * 4 * 256),        # 256-dim heads reserve no staging (the ring keeps its room)
    (64, 32, 8, 8 * 4 * 32),             # short splits: the per-warp P.V partials
])
def test_partial_reserves_room_to_stage_its_rows(d, dv, chunk, want):
    """runtime/tilec/ops_attention.cuh stages a segment's 2-byte K / V rows in shared memory when
    they fit; the op reserves min(chunk, 128) positions of them (scores, probabilities, K rows, V
    rows, padded against bank conflicts)."""
    graph = split_kv(attention_graph(1, 8, 2, 1, 4096, d, dv), Options(attn_kv_chunk=chunk))
    assert opdef("attention_partial").smem_bytes(graph.ops[0]) == 4 * (4 * 256 + 32 + want)


# ---- a whole HF decoder with the split forced --------------------------------------------------

def test_llama_step_with_split_kv_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                                   max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=100)
    prefill = 40
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, prefill)), **cache_kwargs(model, cache),
              cache_position=torch.arange(prefill), use_cache=True)
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch_size=2, options=dict(workers=8, attn_kv_chunk=32))
    kinds = [op.kind for op in step.program.graph.ops]  # the combines folded into the partials (fold_combine)
    assert "attention" not in kinds and kinds.count("attention_partial") == 2 and "attention_combine" not in kinds
    part = next(op for op in step.program.graph.ops if op.kind == "attention_partial")
    assert step.program.graph.buffers[part.outputs[0].buffer].shape == (2, 8, 4, 32)  # 100 positions: 4 splits
    gen = torch.Generator().manual_seed(1)
    for pos in range(prefill, prefill + 3):
        tok = torch.randint(0, cfg.vocab_size, (2, 1), generator=gen)
        with torch.no_grad():
            ref = model(tok, **cache_kwargs(model, eager_cache), cache_position=torch.tensor([pos]), use_cache=True).logits
        assert_close(step(tok, pos), ref, 1e-4, f"logits at position {pos}")
