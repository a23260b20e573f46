"""Model factories for ``tilec compile`` (``tilec compile examples/factories.py:tiny_llama_step -o DIR``).

A factory takes no arguments and returns ``(module, example_args)`` or
``(module, example_args, dict(positions=..., max_positions=...))``; it should be
deterministic (fixed seeds), because ``tilec run --check`` and ``tilec bench`` call it again
to build the eager reference (with the artifact's weights loaded into it).
"""
from __future__ import annotations

import torch

from tilec.hf import StaticCacheStep
from tilec.zoo import make_model, prefill

CONTEXT, MAX_CACHE_LEN = 4, 16


def tiny_llama_step(device: str | None = None):
    """One decode step of the tiny random-weight HF Llama (``llama-tiny``, 2 layers) over a
    ``StaticCache`` prefilled eagerly with 4 tokens: the step at position 4.

    On a machine with CUDA the model is bf16 on the GPU, otherwise float32 on the CPU.
    Arguments: ``(input_ids [1, 1], cache_position [1], *cache state)``; the position inputs
    (``cache_position`` and any per-layer length counters) are planned for p < 16.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = make_model("llama-tiny", dtype, device)
    cache, token = prefill(model, batch=1, context=CONTEXT, max_cache_len=MAX_CACHE_LEN, device=device)
    step = StaticCacheStep(model, cache)
    state = [t.clone() if t.dim() == 0 else t for t in step.state()]  # length counters: CONTEXT
    position = torch.tensor([CONTEXT], device=device)
    positions = [1] + [2 + i for i, t in enumerate(state) if t.dim() == 0]
    return step, (token, position, *state), dict(positions=positions, max_positions=MAX_CACHE_LEN)


def tiny_llama_step_cpu():
    """:func:`tiny_llama_step` in float32 on the CPU, also on a machine with a GPU (what the tests use)."""
    return tiny_llama_step("cpu")
