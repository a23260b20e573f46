"""Model shapes used by tests, examples and benchmarks (random weights, HF ``transformers``)."""
from __future__ import annotations

import torch

MAX_POSITION_EMBEDDINGS = 8192  # every zoo model's max_position_embeddings (RoPE tables, HF checks)

CONFIGS = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads, head_dim 64, tied embeddings
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5),
    # Llama-3.1-8B: 32 layers, hidden 4096, 32/8 heads, head_dim 128
    "llama-3.1-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
    # Qwen3-0.6B: 28 layers, hidden 1024, 16/8 heads, head_dim 128, q/k norms, tied embeddings
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # tiny shapes for CI
    "llama-tiny": dict(arch="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000),
    "qwen3-tiny": dict(arch="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1000),
}


def make_model(name: str, dtype=torch.float32, device="cpu", layers: int | None = None, seed: int = 0,
               **overrides):
    """An HF causal LM with the named shapes and random weights (``attn_implementation="sdpa"``).

    ``layers`` replaces the number of decoder layers; ``overrides`` replace other config fields of
    the named shapes (e.g. ``num_attention_heads=16``).

    Raises:
        KeyError: an unknown name, or a field the named shapes do not have (``arch`` comes with
            the name).
        ValueError: ``layers`` below 1 or given twice (also as ``num_hidden_layers``), or query
            heads that are not a multiple of the KV heads.
        TypeError: ``dtype`` is not a ``torch.dtype`` (``"bfloat16"``, or a device given in its place).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"make_model({name!r}): dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r} "
                        f"(the arguments are name, dtype, device)")
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if name not in CONFIGS:
        raise KeyError(f"make_model: no model named {name!r}; the zoo has {sorted(CONFIGS)}")
    kw = dict(CONFIGS[name])
    arch = kw.pop("arch")
    unknown = sorted(set(overrides) - set(kw))
    if unknown:
        raise KeyError(f"make_model({name!r}): no config field(s) {unknown} to override; it has {sorted(kw)} "
                       f"(its architecture, {arch}, comes with the name)")
    if layers is not None and "num_hidden_layers" in overrides:
        raise ValueError(f"make_model({name!r}): the layer count given twice (layers={layers}, "
                         f"num_hidden_layers={overrides['num_hidden_layers']})")
    kw.update(overrides)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    if kw["num_hidden_layers"] < 1:
        raise ValueError(f"make_model({name!r}): {kw['num_hidden_layers']} layers; at least 1")
    if kw["num_attention_heads"] % kw["num_key_value_heads"]:
        raise ValueError(f"make_model({name!r}): {kw['num_attention_heads']} query heads are not a multiple of "
                         f"{kw['num_key_value_heads']} KV heads")
    cls_cfg, cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = cls_cfg(max_position_embeddings=MAX_POSITION_EMBEDDINGS, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    return model


def prefill(model, batch: int, context: int, max_cache_len: int, device="cpu", seed: int = 1):
    """Allocates a ``StaticCache`` and runs an eager prefill of ``context`` random tokens.

    Returns ``(cache, next_token [batch, 1])``. Raises ValueError when ``context`` is not in
    ``1..max_cache_len``.
    """
    import warnings

    if not 0 < context <= max_cache_len:
        raise ValueError(f"prefill of {context} positions into a cache of {max_cache_len}: need "
                         f"0 < context <= max_cache_len")

    from transformers import StaticCache

    from .hf import cache_kwargs

    g = torch.Generator().manual_seed(seed)
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model(ids, cache_position=torch.arange(context, device=device), use_cache=True, **cache_kwargs(model, cache))
    return cache, out.logits[:, -1:].argmax(-1)


def eager_step(model, cache, tokens, position: int):
    """One eager HF decode step: logits [B, 1, V]; updates ``cache`` in place."""
    import warnings

    from .hf import cache_kwargs

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model(tokens, **cache_kwargs(model, cache), use_cache=True,
                     cache_position=torch.tensor([position], device=tokens.device)).logits
