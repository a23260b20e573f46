"""Decode steps of the other HF decoder families (``_helpers.FAMILIES``) on the CUDA executor.

The CPU suite runs these families on the reference executor (tests/test_hf_architectures.py);
here their generated CUDA programs run: q/k/v biases, LayerNorm with and without bias, GELU
MLPs, partial rotary, parallel residuals, scalar multipliers, layers without RoPE, fused qkv
and gate_up weights, RoPE on pairs rotated in place (rope style 2). Tiny random configs (2 layers), context 20, 4 greedy steps fed eager's tokens.

- float32, batch 1: logits and KV cache within a relative L2 of 1e-4 of eager (float32 on both
  sides; only the reduction order differs).
- bfloat16, batch 2 (marked slow: a second library per family): tilec no farther from eager float32 than 1.5 x eager bfloat16 is, or 1e-2
  (a tiny model's logits are near the bf16 rounding step itself), and the KV cache within 2e-2
  of eager bf16's.
"""
import copy

import pytest
import torch

from _helpers import FAMILIES, family_model, rel_l2
from tilec.hf import compile_decode_step
from tilec.zoo import eager_step, prefill

DEV = "cuda"
CONTEXT, STEPS = 20, 4


def cache_rel(c1, c2) -> float:
    """The largest relative L2 distance between two caches' per-layer keys or values."""
    return max(max(rel_l2(a.keys, b.keys), rel_l2(a.values, b.values)) for a, b in zip(c1.layers, c2.layers))


@pytest.mark.parametrize("dtype,batch", [(torch.float32, 1), pytest.param(torch.bfloat16, 2, marks=pytest.mark.slow)],
                         ids=["fp32-b1", "bf16-b2"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_decode_matches_eager(family, dtype, batch):
    model = family_model(family, dtype, DEV)
    cache, tok = prefill(model, batch, CONTEXT, CONTEXT + STEPS + 4, DEV)
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch)
    assert step.program.executor_kind == ("cuda" if DEV == "cuda" else "reference")
    if dtype == torch.bfloat16:
        model32, cache32 = copy.deepcopy(model).float(), copy.deepcopy(cache)
        for layer in cache32.layers:
            layer.keys, layer.values = layer.keys.float(), layer.values.float()
    for i in range(STEPS):
        pos = CONTEXT + i
        if dtype == torch.bfloat16:
            ref32 = eager_step(model32, cache32, tok, pos).float()
        want = eager_step(model, eager_cache, tok, pos)
        got = step(tok, pos)
        if dtype == torch.float32:
            assert rel_l2(got, want) < 1e-4, (family, pos, rel_l2(got, want))
        else:
            d_tilec, d_eager = rel_l2(got.float(), ref32), rel_l2(want.float(), ref32)
            assert d_tilec <= max(1.5 * d_eager, 1e-2), (family, pos, d_tilec, d_eager)
        tok = want[:, -1:].argmax(-1)
    assert cache_rel(cache, eager_cache) < (1e-4 if dtype == torch.float32 else 2e-2), family
