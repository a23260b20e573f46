"""The compiled Llama-3.2-1B decode step the lab's A/B scripts time (batch 1 unless asked, bf16, random weights)."""
import argparse
import json

import torch

from tilec.hf import compile_decode_step
from tilec.options import Options
from tilec.timing import need_gpu
from tilec.zoo import make_model, prefill


def llama_model(script: str, ctx: int = 1024, name: str = "llama-3.2-1b", batch: int = 1):
    """Returns ``(model, cache, token)``: zoo model ``name`` (bf16, random weights) on the GPU with
    a cache of ``batch`` sequences prefilled to ``ctx`` positions. Exits (``need_gpu``, naming
    ``script``) without a CUDA device."""
    need_gpu(script)
    model = make_model(name, torch.bfloat16, "cuda")
    cache, tok = prefill(model, batch, ctx, ctx + 64, "cuda")
    return model, cache, tok


def step_runner(step, tok, ctx: int):
    """A function that re-decodes position ``ctx`` with ``step`` and returns the logits."""
    def run():
        step.seek(ctx)
        return step(tok, ctx)

    return run


def llama_step(script: str, ctx: int = 1024, batch: int = 1, name: str = "llama-3.2-1b", options: dict | None = None):
    """Returns ``(step, run)``: zoo model ``name``'s step of ``batch`` sequences compiled with
    ``check=False`` (and ``options``) at context ``ctx`` and its :func:`step_runner`. Exits
    (``need_gpu``, naming ``script``) without a CUDA device."""
    model, cache, tok = llama_model(script, ctx, name=name, batch=batch)
    step = compile_decode_step(model, cache, batch, options=dict(options or {}, check=False))
    return step, step_runner(step, tok, ctx)


def json_options(text: str, extra: tuple[str, ...] = ()) -> dict:
    """A JSON object of tilec compile options (keys in ``extra`` are passed through unchecked), for an
    argparse ``type=`` or a variant's text; ``argparse.ArgumentTypeError`` naming what is wrong."""
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object of tilec options: {text!r}")
    try:
        Options.from_dict({k: v for k, v in opts.items() if k not in extra})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return opts


def alternating_rounds(graphs: dict, rounds: int, iters: int):
    """Times each named CUDA graph's replay ``rounds`` times, the graphs alternating within a round (so
    drifts of the GPU's clocks hit all of them alike). Returns ``(ms, mhz)``: each name's median ms per
    round, and the median SM clock over the rounds (None without nvidia-smi)."""
    from tilec.timing import SmClock, median_ms

    res = {name: [] for name in graphs}
    with SmClock() as clk:
        for _ in range(rounds):
            for name, graph in graphs.items():
                res[name].append(median_ms(graph.replay, iters, 5, "cuda"))
    return res, clk.mhz
