"""How far apart two *eager* bf16 decode steps are when only the attention kernel differs, or
when one element of one token's embedding is nudged by one bf16 ulp.

Prints relative L2 distances of the logits between eager bf16 (default SDPA backend), eager
bf16 with the math SDPA backend, eager bf16 with the nudged embedding, tilec, and an eager
float32 reference, for one step at the given context. This measures the bf16 noise floor any
implementation faces: with random weights a one-ulp change anywhere changes rounding decisions
downstream, and the logits move about as far as bf16's own distance from float32 (on the CPU,
Llama-3.2-1B shapes at context 64: 2.50e-2 for the nudge, 2.41e-2 bf16 vs float32).

    python benchmarks/bf16_noise.py --model llama-3.2-1b --context 1024
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.zoo import eager_step, make_model, prefill  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def nudge(model, token: int):
    """Adds one bf16 ulp to element 0 of ``token``'s embedding row (in place); returns an undo."""
    w = model.get_input_embeddings().weight
    old = w.data[token, 0].clone()
    w.data[token, 0] = (old.view(torch.int16) + 1).view(torch.bfloat16)  # the next magnitude (sign-magnitude bits)
    return lambda: w.data[token, 0].copy_(old)


def nudged_step(model, cache, tok, pos):
    """eager_step with the input token's embedding nudged by one ulp (restored afterwards)."""
    undo = nudge(model, int(tok.view(-1)[0]))
    try:
        return eager_step(model, cache, tok, pos)
    finally:
        undo()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=0, help="also count greedy agreement over this many steps")
    args = ap.parse_args()
    model = make_model(args.model, torch.bfloat16, "cuda")
    ctx = args.context
    cache, tok = prefill(model, 1, ctx, ctx + args.steps + 8, "cuda")
    c_default, c_math, c_tilec = copy.deepcopy(cache), copy.deepcopy(cache), copy.deepcopy(cache)
    c_nudge = copy.deepcopy(cache)
    default = eager_step(model, c_default, tok, ctx)
    with sdpa_kernel([SDPBackend.MATH]):
        math = eager_step(model, c_math, tok, ctx)
    nudged = nudged_step(model, c_nudge, tok, ctx)
    step = compile_decode_step(model, c_tilec, 1)
    tilec = step(tok, ctx)
    m32 = copy.deepcopy(model).float()
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.float(), layer.values.float()
    ref = eager_step(m32, cache, tok, ctx)
    print(f"{args.model} context {ctx}: relative L2 distance of logits")
    print(f"  eager(default SDPA) vs eager(math SDPA): {rel(default, math):.3e}")
    print(f"  eager(default SDPA) vs eager(one embedding element + 1 ulp): {rel(default, nudged):.3e}")
    print(f"  tilec vs eager(default SDPA):           {rel(tilec, default):.3e}")
    print(f"  tilec vs eager(math SDPA):              {rel(tilec, math):.3e}")
    print(f"  eager(default) vs fp32: {rel(default, ref):.3e}; eager(math) vs fp32: {rel(math, ref):.3e}; "
          f"tilec vs fp32: {rel(tilec, ref):.3e}")
    if args.steps:
        # greedy agreement over consecutive steps, every variant fed eager(default)'s tokens
        agree_math = agree_tilec = agree_nudge = 0
        t = default.argmax(-1)
        for i in range(1, args.steps + 1):
            d = eager_step(model, c_default, t, ctx + i)
            with sdpa_kernel([SDPBackend.MATH]):
                m = eager_step(model, c_math, t, ctx + i)
            g = step(t, ctx + i)
            n = nudged_step(model, c_nudge, t, ctx + i)
            agree_math += int(torch.equal(m.argmax(-1), d.argmax(-1)))
            agree_nudge += int(torch.equal(n.argmax(-1), d.argmax(-1)))
            agree_tilec += int(torch.equal(g.argmax(-1), d.argmax(-1)))
            t = d.argmax(-1)
        print(f"  greedy agreement with eager(default) over {args.steps} steps: eager(math SDPA) {agree_math}, "
              f"eager(nudged embedding) {agree_nudge}, tilec {agree_tilec}")


if __name__ == "__main__":
    main()
