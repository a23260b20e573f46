"""Decode steps of other Hugging Face decoder families, compiled whole (compile_decode_step).

Each family brings forms the Llama tests do not: q/k/v biases (Qwen2), fused qkv and gate_up
projections (Phi-3), RMSNorm as x * (1 + w) and GELU-tanh MLP with an embedding scale (Gemma),
norms after the projections (OLMo-2), scalar multipliers (Granite), LayerNorm with partial
rotary (StableLM, Phi), parallel residuals (GPT-NeoX), a bias-free LayerNorm (OLMo), layers
without RoPE (SmolLM3), GPT-2's Conv1D, Falcon's grouped q/k/v (5-d views), ReLU^2 MLPs
(Nemotron, Arcee), RoPE on pairs rotated in place (GPT-J, GLM, GLM-4, Helium, ERNIE-4.5, Cohere),
a LayerNorm written out in torch ops (Cohere) and attention written out in torch ops (HF's eager
attention: Llama with ``attn_implementation="eager"``; GPT-J's own ``_attn``).

Tiny random configs (``_helpers.FAMILIES``; 2 layers, context 6, reference executor): logits and
the KV cache must match eager within a relative L2 of 1e-5 in float32 (batch 1) and 2e-2 in
bfloat16 (batch 2).
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tilec.hf import cache_kwargs, compile_decode_step
from tilec.zoo import prefill

from _helpers import COMMON, FAMILIES, family_model, rel_l2


@pytest.mark.parametrize("dtype,batch,tol", [(torch.float32, 1, 1e-5), (torch.bfloat16, 2, 2e-2)],
                         ids=["fp32-b1", "bf16-b2"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_step_matches_eager(family, dtype, batch, tol):
    """bf16 within 2e-2 of eager bf16 (~4e-3 seen: rounding order; a family whose forms match only
    in float32 fails to compile whole instead)."""
    model = family_model(family, dtype, "cpu")
    cache, tok = prefill(model, batch, 6, 24, "cpu")
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch, options={"workers": 8})
    with torch.no_grad():
        for p in (6, 7):
            got = step(tok, position=p)
            want = model(tok, cache_position=torch.tensor([p]), use_cache=True, **cache_kwargs(model, eager_cache)).logits
            assert rel_l2(got, want) < tol, (family, p, rel_l2(got, want))
            tok = want[:, -1:].argmax(-1)
    for a, b in zip(cache.layers, eager_cache.layers):
        assert rel_l2(a.keys, b.keys) < tol and rel_l2(a.values, b.values) < tol, family


def test_full_width_partial_rotary_matches_eager():
    """Phi with ``partial_rotary_factor=1.0`` concatenates the rotated queries and keys with an empty pass-through
    part: the step compiled, then every call failed ("operand view ... overruns buffer"; a fuzzer's finding)."""
    cfg = transformers.PhiConfig(**{**COMMON, "partial_rotary_factor": 1.0})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.PhiForCausalLM(cfg).eval()
    cache, tok = prefill(model, 1, 6, 24, "cpu")
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, 1, options={"workers": 8})
    with torch.no_grad():
        for p in (6, 7):
            got = step(tok, position=p)
            want = model(tok, cache_position=torch.tensor([p]), use_cache=True, **cache_kwargs(model, eager_cache)).logits
            assert rel_l2(got, want) < 1e-5, (p, rel_l2(got, want))
            tok = want[:, -1:].argmax(-1)


def test_sliding_window_attention_is_refused_by_name():
    """Gemma-2's sliding-window layers (a StaticSlidingWindowLayer cache of ``window`` slots): the error
    said "position 5 outside the planned range [0, 4) of max_positions=4" (a fresh user's finding)."""
    from tilec.errors import InputError

    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("no Gemma2Config")
    cfg = transformers.Gemma2Config(**{**COMMON, "head_dim": 16, "sliding_window": 4})
    cfg._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    cache, _ = prefill(model, 1, 5, 12, "cpu")
    with pytest.raises(InputError, match=r"Gemma2ForCausalLM has sliding-window attention .*window 4.* does not "
                                         r"support sliding windows"):
        compile_decode_step(model, cache, 1)
