"""The compiled Llama-3.2-1B decode step the lab's A/B scripts time (batch 1, bf16, random weights)."""
import torch

from tilec.hf import compile_decode_step
from tilec.timing import need_gpu
from tilec.zoo import make_model, prefill


def llama_step(script: str, ctx: int = 1024):
    """Returns ``(step, run)``: the step compiled with ``check=False`` at context ``ctx`` and a
    function that re-decodes position ``ctx`` and returns the logits. Exits (``need_gpu``,
    naming ``script``) without a CUDA device."""
    need_gpu(script)
    model = make_model("llama-3.2-1b", torch.bfloat16, "cuda")
    cache, tok = prefill(model, 1, ctx, ctx + 64, "cuda")
    step = compile_decode_step(model, cache, 1, options=dict(check=False))

    def run():
        step.seek(ctx)
        return step(tok, ctx)

    return step, run
