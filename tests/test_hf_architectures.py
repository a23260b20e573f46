"""Decode steps of other Hugging Face decoder families, compiled whole (compile_decode_step).

Each family brings forms the Llama tests do not: q/k/v biases (Qwen2), fused qkv and gate_up
projections (Phi-3), RMSNorm as x * (1 + w) and GELU-tanh MLP with an embedding scale (Gemma),
norms after the projections (OLMo-2), scalar multipliers (Granite), LayerNorm with partial
rotary (StableLM, Phi), parallel residuals (GPT-NeoX), a bias-free LayerNorm (OLMo), layers
without RoPE (SmolLM3). Tiny random configs (float32, 2 layers, context 6, reference executor);
logits and the KV cache must match eager within a relative L2 of 1e-5.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tilec.hf import cache_kwargs, compile_decode_step
from tilec.zoo import prefill

from _helpers import rel_l2

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, pad_token_id=0)

FAMILIES = {  # name: (config class, model class, config overrides)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                                                            attention_multiplier=0.2, logits_scaling=4.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=4)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),  # layer 1 without RoPE
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_step_matches_eager(family):
    cfg_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, cfg_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cfg_name}")
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, model_name)(cfg).eval()
    cache, tok = prefill(model, 1, 6, 24, "cpu")
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, 1, options={"workers": 8})
    with torch.no_grad():
        for p in (6, 7):
            got = step(tok, position=p)
            want = model(tok, cache_position=torch.tensor([p]), use_cache=True, **cache_kwargs(model, eager_cache)).logits
            assert rel_l2(got, want) < 1e-5, (family, p, rel_l2(got, want))
            tok = want[:, -1:].argmax(-1)
    for a, b in zip(cache.layers, eager_cache.layers):
        assert rel_l2(a.keys, b.keys) < 1e-5 and rel_l2(a.values, b.values) < 1e-5, family
