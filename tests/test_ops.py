"""Per-op tests through :func:`tilec.api.compile_module`: the op is recognized (checked in the
OpGraph / TaskGraph) and the compiled program matches eager PyTorch on random inputs.

GQA decode attention through ``F.scaled_dot_product_attention`` is covered end to end by
``test_hf_models.py``; a direct GQA test without a cache is here too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _helpers import Fn, StageRecorder, assert_close
from tilec.api import compile_module
from tilec.ops.rope import INTERLEAVED, PAIRWISE, ROTATE_HALF
from tilec.options import Options


def run(module, args, **opts):
    """Compiles, checks against eager (1e-4 relative L2, float32) and returns (program, stages)."""
    module = module.eval()
    rec = StageRecorder()
    prog = compile_module(module, args, options=Options(**opts) if opts else None, hook=rec)
    with torch.no_grad():
        want = module(*args)
    got = prog(*args)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype
        if w.dtype.is_floating_point:
            assert_close(g, w, 1e-4, f"output {i}")
        else:
            assert torch.equal(g, w)
    return prog, rec.stages


def kinds(prog) -> list[str]:
    return [op.kind for op in prog.compiled.stages['opgraph'].ops]


# ---- rotary embeddings -------------------------------------------------------------------

def rope_interleave(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rotary_tables(shape, d):
    ang = torch.rand(*shape, d) * 6.28
    return torch.cos(ang), torch.sin(ang)


@pytest.mark.parametrize("tile_rows", [1, 3, 8])
def test_interleaved_rope(tile_rows):
    b, h, s, d = 2, 4, 1, 16
    x = torch.randn(b, h, s, d)
    cos, sin = rotary_tables((b, 1, s), d // 2)  # broadcast over the heads, last dim D/2
    prog, stages = run(Fn(lambda m, x, c, s_: rope_interleave(x, c, s_)), (x, cos, sin), tile_rows=tile_rows, workers=3)
    assert kinds(prog) == ["rope"]
    rope = prog.compiled.stages['opgraph'].ops[0]
    assert rope.attr("style") == INTERLEAVED
    assert "rope(" in stages["opgraph"].render() and "style=1" in stages["opgraph"].render()


def test_interleaved_rope_of_projection_with_hf_function():
    """HF's own ``apply_rotary_pos_emb_interleave`` (DeepSeek-V3 / GLM) on q and k projections."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    b, s, h, d = 2, 1, 2, 8

    def f(m, x, cos, sin):
        q = F.linear(x, m.wq).view(b, s, h, d).transpose(1, 2)
        k = F.linear(x, m.wk).view(b, s, 1, d).transpose(1, 2)
        return apply_rotary_pos_emb_interleave(q, k, cos, sin)

    x = torch.randn(b, s, 32)
    cos, sin = rotary_tables((b, s), d)  # HF passes cat(freqs, freqs); the function halves them
    prog, _ = run(Fn(f, wq=torch.randn(h * d, 32) / 6, wk=torch.randn(d, 32) / 6), (x, cos, sin), workers=4, tile_n=8)
    ropes = [op for op in prog.compiled.stages['opgraph'].ops if op.kind == "rope"]
    assert len(ropes) == 2 and all(op.attr("style") == INTERLEAVED for op in ropes)
    assert kinds(prog).count("concat") == 0


def rotate_every_two(x):
    """GPT-J's: each pair (2i, 2i+1) -> (-x[2i+1], x[2i]), kept interleaved."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("tile_rows", [1, 3])
def test_pairwise_rope(tile_rows):
    """``x * cos + rotate_every_two(x) * sin`` (GPT-J, GLM-4, Cohere): one rope op, style 2, whose
    cos / sin are read per element (here not pair-repeated, which the op does not assume)."""
    b, h, s, d = 2, 4, 1, 16
    x = torch.randn(b, h, s, d)
    cos, sin = rotary_tables((b, 1, s), d)
    prog, stages = run(Fn(lambda m, x, c, s_: x * c + rotate_every_two(x) * s_), (x, cos, sin),
                       tile_rows=tile_rows, workers=3)
    assert kinds(prog) == ["rope"]
    assert prog.compiled.stages['opgraph'].ops[0].attr("style") == PAIRWISE
    assert "style=2" in stages["opgraph"].render()


def test_pairwise_rope_with_hf_function_on_a_partial_rotary_slice():
    """HF GLM-4's ``apply_rotary_pos_emb``: cos / sin halved and ``repeat_interleave``d, RoPE on the
    first half of the head dim, the rest passed through (a concat)."""
    pytest.importorskip("transformers")
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    b, h, s, d = 1, 2, 1, 16
    q, k = torch.randn(b, h, s, d), torch.randn(b, 1, s, d)
    cos, sin = rotary_tables((b, s), d // 2)  # HF's rotary_dim = d / 2 here
    prog, _ = run(Fn(lambda m, q, k, c, s_: apply_rotary_pos_emb(q, k, c, s_)), (q, k, cos, sin), workers=2)
    ropes = [op for op in prog.compiled.stages['opgraph'].ops if op.kind == "rope"]
    assert len(ropes) == 2 and all(op.attr("style") == PAIRWISE for op in ropes)


def test_stack_that_is_not_pairwise_rope_is_refused_by_name():
    """Swapped pair order (``stack([x[0::2], -x[1::2]])``) is not RoPE: no rope op, and the stack
    is named as unsupported (not silently planned as style 2)."""
    from tilec.errors import UnsupportedNodeError

    x = torch.randn(1, 2, 1, 8)
    cos, sin = rotary_tables((1, 1, 1), 8)
    f = Fn(lambda m, x, c, s_: x * c + torch.stack((x[..., 0::2], -x[..., 1::2]), -1).flatten(-2) * s_)
    with pytest.raises(UnsupportedNodeError, match=r"stack \(aten\.stack\.default\)"):
        compile_module(f.eval(), (x, cos, sin))


def test_rotate_half_rope_hf_layout():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, h, s, d = 2, 4, 1, 16
    q, k = torch.randn(b, h, s, d), torch.randn(b, 2, s, d)
    cos, sin = rotary_tables((b, s), d)
    prog, _ = run(Fn(lambda m, q, k, c, s_: apply_rotary_pos_emb(q, k, c, s_)), (q, k, cos, sin), workers=2)
    assert kinds(prog) == ["rope", "rope"]
    assert all(op.attr("style") == ROTATE_HALF for op in prog.compiled.stages['opgraph'].ops)


def test_rope_with_tables_of_two_dtypes_keeps_eagers_rounding():
    """bf16 x and cos with a float32 sin: eager rounds x * cos to bf16 and adds the float32 rot(x) * sin; the rope
    op computed both products in float32 (1.2e-3 relative L2 from eager; a fuzzer's finding). Such a form is left
    to the elementwise ops, which round where eager does: bitwise eager's."""
    def rot(x):
        return torch.cat((-x[..., 8:], x[..., :8]), -1)

    x, cos, sin = torch.randn(4, 16).bfloat16(), torch.randn(4, 16).bfloat16(), torch.randn(4, 16)
    m = Fn(lambda m, x, c, s_: x * c + rot(x) * s_).eval()
    prog = compile_module(m, (x, cos, sin))
    assert "rope" not in kinds(prog)
    assert torch.equal(prog(x, cos, sin), m(x, cos, sin))


# ---- linear ------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_split_k_linear_is_a_tile_reduce(bias):
    lin = torch.nn.Linear(64, 40, bias=bias)
    if bias:
        torch.nn.init.normal_(lin.bias)
    module = Fn(lambda m, x: m.lin(x) * 2.0)
    module.lin = lin
    prog, stages = run(module, (torch.randn(3, 64),), split_k=4, tile_n=16, tile_cols=16, workers=5, tile_rows=4)
    assert kinds(prog) == ["linear", "unary"]
    tg = stages["tasks"]
    lin_tasks = [t for t in tg.tasks if t.kind == "linear"]
    # per 16-column tile (3 of them): one init tile (bias or zeros, variant 1) + 4 K-partials (variant 2)
    variants = [t.tile.variant for t in lin_tasks]
    assert variants.count(1) == 3 and variants.count(2) == 12
    assert sorted({t.tile.coords[-1] for t in lin_tasks if t.tile.variant == 2}) == [(0, 16), (16, 32), (32, 48),
                                                                                     (48, 64)]
    # the consumer tile of each column block waits for the init tile and the 4 partials
    reduce_events = [e for e in tg.events if e.strategy == "tile_reduce"]
    assert len(reduce_events) == 3, [e.strategy for e in tg.events]
    assert all(len(e.preds) == 5 and len(e.succs) == 1 for e in reduce_events)
    assert all(tg.tasks[next(iter(e.succs))].kind == "unary" for e in reduce_events)
    assert "tile_reduce" in tg.render()
    # the partials wait for their column's init tile (the accumulation needs the initial write)
    partial_waits = [e for e in tg.events if any(tg.tasks[s].tile.variant == 2 for s in e.succs
                                                 if tg.tasks[s].kind == "linear")]
    assert len(partial_waits) == 12 and all(tg.tasks[next(iter(e.preds))].tile.variant == 1 for e in partial_waits)


def test_split_k_partials_feed_a_consumer():
    """A consumer tile covering several split-K column blocks waits for every contribution."""
    def f(m, x):
        return torch.relu(F.linear(x, m.w, m.b)) * 2.0

    prog, stages = run(Fn(f, w=torch.randn(24, 48) / 7, b=torch.randn(24)), (torch.randn(2, 48),),
                       split_k=3, tile_n=8, workers=4, tile_rows=4)
    tg = stages["tasks"]
    (ev,) = [e for e in tg.events if e.strategy == "tile_reduce"]
    assert len(ev.preds) == 3 * (1 + 3)  # 3 column tiles x (init + 3 partials), one whole-row relu tile
    assert len(tg.tasks) == 12 + 2  # + one whole-rows tile each for relu and the scale


@pytest.mark.parametrize("split_k", [1, 2])
def test_linear_on_transposed_activation_and_matmul_forms(split_k):
    def f(m, x):
        a = F.linear(x.transpose(0, 1), m.w)  # strided activation
        b = x.transpose(0, 1) @ m.w2.t()  # matmul with a transposed weight
        return a + b

    prog, _ = run(Fn(f, w=torch.randn(8, 16), w2=torch.randn(8, 16)), (torch.randn(3, 2, 16),), split_k=split_k,
                  tile_n=4, workers=3)
    assert kinds(prog).count("linear") == 2


# ---- embedding ---------------------------------------------------------------------------

@pytest.mark.parametrize("tile_cols", [None, 8])
def test_embedding(tile_cols):
    emb = torch.nn.Embedding(50, 32)
    ids = torch.tensor([[3, 17, 3], [49, 0, 21]])
    prog, _ = run(emb, (ids,), tile_cols=tile_cols, tile_rows=1, workers=3)
    assert kinds(prog) == ["embedding"]
    # new ids, same plan
    ids2 = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert_close(prog(ids2), emb(ids2).detach(), 0.0)


def test_embedding_then_projection():
    def f(m, ids):
        return F.linear(F.embedding(ids, m.table), m.w)

    run(Fn(f, table=torch.randn(40, 16), w=torch.randn(24, 16)), (torch.randint(0, 40, (2, 1)),), tile_n=8, workers=4)


# ---- normalization -----------------------------------------------------------------------

@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_layernorm(affine, bias):
    d = 48
    ln = torch.nn.LayerNorm(d, eps=1e-5, elementwise_affine=affine, bias=bias)
    if affine:
        torch.nn.init.normal_(ln.weight, 1.0, 0.2)
    if affine and bias:
        torch.nn.init.normal_(ln.bias)
    prog, _ = run(ln, (3.0 + 2.0 * torch.randn(2, 3, d),), tile_rows=2, workers=3)
    assert kinds(prog) == ["layernorm"]
    assert len(prog.compiled.stages['opgraph'].ops[0].inputs) == (3 if bias else 2)


def test_layernorm_functional_with_bias_only():
    f = Fn(lambda m, x: F.layer_norm(x, (16,), None, m.b, 1e-6), b=torch.randn(16))
    prog, _ = run(f, (torch.randn(4, 16),))
    assert kinds(prog) == ["layernorm"]


def test_rmsnorm_hf_module():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    prog, _ = run(norm, (torch.randn(2, 1, 32),), tile_rows=1)
    assert kinds(prog) == ["rmsnorm"]
    assert prog.compiled.stages['opgraph'].ops[0].attr("eps") == 1e-6


def test_hf_mlp_is_silu_mul_between_linears():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act="silu", mlp_bias=False)
    prog, _ = run(LlamaMLP(cfg), (torch.randn(2, 1, 32),), tile_n=16, tile_cols=16, workers=6)
    assert kinds(prog) == ["linear", "linear", "silu_mul", "linear"]


# ---- softmax and elementwise ---------------------------------------------------------------

@pytest.mark.parametrize("shape, tile_rows", [((5, 33), 2), ((2, 3, 4, 16), 3), ((1, 7), 4)])
def test_softmax(shape, tile_rows):
    prog, _ = run(Fn(lambda m, x: torch.softmax(x * 3.0, dim=-1)), (torch.randn(*shape),), tile_rows=tile_rows)
    assert "softmax" in kinds(prog)


def test_softmax_of_scores():
    def f(m, x):
        scores = F.linear(x, m.w) * 0.25
        return F.softmax(scores, dim=-1)

    prog, _ = run(Fn(f, w=torch.randn(20, 16)), (torch.randn(3, 16),), tile_n=8, workers=3)
    assert kinds(prog) == ["linear", "unary", "softmax"]


def test_elementwise_zoo():
    def f(m, x, y):
        a = torch.sigmoid(x) + torch.tanh(y) * 0.5
        b = torch.maximum(a, y) - torch.minimum(x, 0.5 * y)
        c = F.gelu(b) + F.gelu(a, approximate="tanh") - 1.0
        return c / 3.0, torch.exp(-x * x), (2.0 - x).to(torch.bfloat16).to(torch.float32) * m.s

    prog, _ = run(Fn(f, s=torch.randn(8)), (torch.randn(3, 8), torch.randn(3, 8)), tile_cols=4, tile_rows=2)
    assert set(kinds(prog)) <= {"unary", "binary"}


class _Clamps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("lo", torch.tensor(-0.2))

    def forward(self, x, y):
        return (x.clamp(min=0.3), x.clamp(-1, 2), torch.clamp(x, max=0.5), x.clamp_min(0.1), F.relu6(x * 4),
                F.hardtanh(x), torch.clamp(x, y), torch.clamp(x, self.lo, y), torch.rsub(x, y), torch.rsub(x, 2.5),
                torch.maximum(x, y), F.relu(x), torch.clip(x, -0.5, 0.7), torch.clip(x, max=y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_forms_and_rsub_are_eagers_bitwise_with_nans(dtype):
    """``torch.clamp`` with numbers, tensors and a 0-dim float32 buffer as bounds, ``clamp_min``, ``F.relu6``,
    ``F.hardtanh`` (maximum with the lower bound, then minimum with the upper) and ``torch.rsub`` of two tensors were
    refused as ops no tilec op computes (a fuzzer's list); bitwise eager now, NaNs in x and in a bound included
    (tests/gpu/test_cuda_ops.py: the CUDA executor, whose maximum / minimum / ReLU dropped NaNs)."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 64).to(dtype), torch.randn(4, 64).to(dtype)
    x[0, :3] = float("nan")
    y[1, :3] = float("nan")
    mod = _Clamps().to(dtype)
    prog = compile_module(mod, (x, y))
    assert {op.kind for op in prog.graph.ops} == {"binary", "unary"}
    for got, want in zip(prog(x, y), mod(x, y)):
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_two_clamps_keep_their_own_bounds():
    """Two clamps by numbers in one graph: the first clamp's second constant was named ``const_clamp_1``, the second
    clamp's first constant too, and overwrote it (every bound of one clamp read -2: a fresh user's silently wrong
    result); a bound's constant was also looked up by the id of a freed value, and a later clamp read another's."""
    def f(m, x):
        return (torch.clamp(x, 0., 6.) + torch.clamp(x, -2., 2.), F.relu6(x) - F.hardtanh(x, -2, 2),
                x.clamp(min=0.25).clamp_max(1.) + F.relu6(x * 3))

    torch.manual_seed(0)
    x = torch.randn(4, 64) * 5
    prog = compile_module(Fn(f).eval(), (x,))
    for got, want in zip(prog(x), f(None, x)):
        assert torch.equal(got, want)
    consts = [b for b in prog.graph.buffers.values() if b.name.startswith("const_")]
    assert len(consts) == len({b.name for b in consts}) == 12


@pytest.mark.parametrize("dtype, form", [(torch.float16, lambda x: x.clamp(max=1e6)),
                                         (torch.float16, lambda x: x.clamp(max=65510.)),  # (rounds to 65504)
                                         (torch.float16, lambda x: F.hardtanh(x, -1e6, 1e6)),
                                         (torch.bfloat16, lambda x: torch.clamp(x, min=-1e39))])
def test_a_clamp_bound_that_overflows_the_dtype_is_eagers_error(dtype, form):
    """A finite bound that overflows the tensor's dtype (``clamp(x16, max=1e6)``) compiled as a clamp to +-inf where
    eager raises ("value cannot be converted to type c10::Half without overflow"), as for any finite bound past the
    dtype's largest value (65510 too, which rounds to 65504: a reviewer's finding); an EagerFailsError naming the
    node now. An infinite bound stays a clamp."""
    from tilec.errors import EagerFailsError

    x = torch.randn(4, 64).to(dtype)
    with pytest.raises(RuntimeError, match="without overflow"):
        form(x)
    with pytest.raises(EagerFailsError, match=r"(?s)overflows float16.*(clamp|hardtanh) \(aten|overflows bfloat16.*clamp \(aten"):
        compile_module(Fn(lambda m, x: form(x) * 2), (x,))
    prog = compile_module(Fn(lambda m, x: x.clamp(max=float("inf")) * 2), (x,))
    assert torch.equal(prog(x), x * 2)


class _ArgumentsNamedLikeBuffers(torch.nn.Module):
    def forward(self, x, clamp_maximum, const_clamp):
        return torch.clamp(x, -0.5, 0.5) + clamp_maximum * const_clamp


def test_arguments_named_like_generated_buffers():
    """Arguments are buffers of their own names; one named like a buffer tilec generates (the clamp's intermediate
    ``clamp_maximum``, its bound's ``const_clamp``) shared it: a wrong result, and the caller's tensor overwritten
    with the clamp's intermediate (a QA helper's finding)."""
    torch.manual_seed(0)
    x, y, z = torch.randn(4, 64), torch.randn(4, 64) + 10, torch.randn(4, 64)
    args = (x, y.clone(), z.clone())
    got = compile_module(_ArgumentsNamedLikeBuffers(), (x, y, z))(*args)
    assert torch.equal(got, _ArgumentsNamedLikeBuffers()(x, y, z))
    assert torch.equal(args[1], y) and torch.equal(args[2], z)


def test_concat_and_views():
    def f(m, x):
        y = torch.cat([x * 2.0, torch.relu(x)], dim=1)  # [2, 6, 8]
        z = y.transpose(1, 2).reshape(2, 48)  # needs a real copy
        lo, hi = z.split([16, 32], dim=-1)
        return lo + 1.0, hi.unsqueeze(0) * 3.0

    prog, _ = run(Fn(f), (torch.randn(2, 3, 8),))
    assert {"concat", "copy"} <= set(kinds(prog))


def test_concat_with_empty_parts():
    """An empty part (``h[..., 4:]`` of a 4-wide row: the pass-through half of a full-width partial RoPE) compiled,
    then every call failed: its view, an empty box, "overruns buffer" (a fuzzer's finding). Empty parts are
    dropped, a legacy 1-D empty tensor too; a concatenation of empty parts only is refused by name."""
    from tilec.errors import UnsupportedNodeError

    def f(m, x):
        h = F.linear(x, m.w).view(1, 2, 1, 4).transpose(1, 2)  # [1, 1, 2, 4], not contiguous
        rot, rest = h[..., :4], h[..., 4:]
        return torch.cat([rot * 2.0, rest], dim=-1), torch.cat([x.reshape(8) + 1.0, rest.reshape(0)])

    prog, _ = run(Fn(f, w=torch.randn(8, 8)), (torch.randn(1, 8),))
    assert kinds(prog).count("concat") == 2
    prog, _ = run(Fn(lambda m, x: torch.cat([x.new_zeros(0), x * 2.0])), (torch.randn(2, 8),))  # (a 1-D empty part)
    assert kinds(prog) == ["unary", "concat"]
    with pytest.raises(UnsupportedNodeError, match="a concatenation with an empty result"):
        compile_module(Fn(lambda m, x: torch.cat([x[:, 8:], x[:, :0]], dim=1) + 1.0).eval(), (torch.randn(2, 8),))


def test_fused_gate_up_projection_chunk():
    """Regression: ``chunk``/``split`` (one fused gate-up GEMV, Phi-3 style) used to be unsupported."""
    def f(m, x):
        gate, up = F.linear(x, m.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, m.down)

    prog, _ = run(Fn(f, gate_up=torch.randn(64, 16) / 4, down=torch.randn(16, 32) / 6), (torch.randn(2, 16),),
                  tile_n=16, workers=4)
    assert kinds(prog) == ["linear", "silu_mul", "linear"]
    gate_view, up_view = prog.compiled.stages['opgraph'].ops[1].inputs
    assert gate_view.buffer == up_view.buffer and up_view.offset == 32  # zero-copy views of one buffer


# ---- attention (no cache) -------------------------------------------------------------------

def test_gqa_attention_without_mask():
    """F.scaled_dot_product_attention with HF's repeat_kv: the KV heads are read directly."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def repeat_kv(x, n):
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def f(m, q, k, v):
        return sdpa(q, repeat_kv(k, 4), repeat_kv(v, 4), scale=0.3)

    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    prog, _ = run(Fn(f), (q, k, v), attn_heads_per_tile=2, workers=3)
    assert kinds(prog) == ["attention"]
    att = prog.compiled.stages['opgraph'].ops[0]
    assert att.inputs[1].shape == (2, 2, 6, 16) and att.attr("scale") == pytest.approx(0.3)


@pytest.mark.parametrize("affine", [True, False])
def test_torch_rms_norm_module(affine):
    norm = torch.nn.RMSNorm(24, eps=1e-5, elementwise_affine=affine)
    if affine:
        torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    prog, _ = run(norm, (torch.randn(3, 24),), tile_rows=1)
    assert kinds(prog) == ["rmsnorm"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_default_eps_is_the_float32_one(dtype):
    """An ``nn.RMSNorm`` without eps in bf16 / fp16 normalizes with float32's epsilon, as torch's float32 math does:
    tilec took the input dtype's (bf16's 7.8e-3), a relative L2 error of 0.5 on rows of small values with no error
    (a fresh user's case)."""
    norm = torch.nn.RMSNorm(16).to(dtype)
    x = (torch.randn(2, 3, 16) * 0.05).to(dtype)
    prog = compile_module(norm.eval(), (x,))
    assert prog.compiled.stages['opgraph'].ops[-1].attr("eps") == torch.finfo(torch.float32).eps
    with torch.no_grad():
        assert torch.equal(prog(x), norm(x))  # bitwise: float32 math, one rounding


def test_type_as_is_a_cast():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return (x * 2).type_as(y) + y  # float32 -> bfloat16

    prog, _ = run(M(), (torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16)))
    casts = [op for op in prog.compiled.stages['opgraph'].ops if op.kind == "unary" and op.attr("fn") == "cast"]
    assert len(casts) == 1


# ---- a shapes / dtypes breaker's findings (thirty-seventh session): each was silently wrong ----

class _RotateHalfLike(torch.nn.Module):
    """``x * cos + cat([-a, b]) * sin`` with halves other than rotate-half's (a = x[..., h:], b = x[..., :h])."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cos, sin):
        h = x.shape[-1] // 2
        a, b = {"standard": (x[..., h:], x[..., :h]), "lower_negated": (x[..., :h], x[..., h:]),
                "shift_by_one": (x[..., 1:], x[..., :1])}[self.form]
        return x * cos + torch.cat((-a, b), dim=-1) * sin


@pytest.mark.parametrize("form", ["standard", "lower_negated", "shift_by_one"])
def test_only_true_rotate_half_is_lowered_as_rope(form):
    """The RoPE pattern checked the shape of the formula only: any halves, negated either way,
    were planned as HF's rotate-half (relative L2 0.41-0.69 off eager)."""
    x, cos, sin = torch.randn(1, 2, 1, 32), torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)
    prog, _ = run(_RotateHalfLike(form), (x, cos, sin))
    assert ("rope" in kinds(prog)) == (form == "standard")


def test_rmsnorm_form_without_keepdim_is_not_a_row_norm():
    """``x * rsqrt(mean(x^2, -1) + eps)`` without keepdim scales columns in eager; it was planned as
    an RMSNorm of rows. Now it is not matched (and the plain mean is not supported: a clear error)."""
    from tilec.errors import UnsupportedNodeError

    class M(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1) + 1e-6)

    with pytest.raises(UnsupportedNodeError, match="mean"):
        compile_module(M(), (torch.randn(4, 4),))


def test_attention_scale_zero_is_a_scale():
    """``scale=0.0`` was read as "no scale" (``or``), giving 1/sqrt(D) scores instead of uniform ones."""
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, scale=0.0)

    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    prog, _ = run(M(), (q, k, v))
    assert_close(prog(q, k, v), v.mean(2, keepdim=True), 1e-5)


def test_integer_cast_is_an_exact_copy():
    """An int32 -> int64 cast went through float32 (a unary op): ids past 2**24 came out rounded."""
    class M(torch.nn.Module):
        def forward(self, ids):
            return ids.to(torch.int64) * 1.0, ids.long()

    ids = torch.tensor([[16777217, 33554433, 1000000001, -7]], dtype=torch.int32)
    prog, _ = run(M(), (ids,))
    assert "copy" in kinds(prog)
    assert prog(ids)[1].tolist() == [[16777217, 33554433, 1000000001, -7]]


def test_a_position_tensor_of_another_shape_is_refused():
    """A [1, 1] position where the example had [1] was accepted and returned the compiled output
    shape, where eager broadcasts to another."""
    from tilec.errors import TilecError

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(20, 8), torch.nn.Embedding(16, 8)

        def forward(self, ids, pos):
            return self.wte(ids) + self.wpe(pos)

    m = M()
    prog = compile_module(m, (torch.tensor([3]), torch.tensor([5])), positions=[1], max_positions=16)
    with pytest.raises(TilecError, match=r"argument 1.*expected an integer tensor of shape \[1\].*\[1, 1\]"):
        prog(torch.tensor([4]), torch.tensor([[7]]))
    with torch.no_grad():
        assert_close(prog(torch.tensor([4]), torch.tensor([7])), m(torch.tensor([4]), torch.tensor([7])), 1e-5)
