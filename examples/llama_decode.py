"""The main job on a bundled example: compile one decode step of a (tiny, random-weight)
Hugging Face Llama with tilec, run it for a few steps, and check it against eager PyTorch.

On a machine with CUDA (and nvcc) the step runs as one persistent kernel in bf16; without
CUDA it runs on tilec's CPU reference executor in float32 (validation, not speed).

    python examples/llama_decode.py [--model llama-tiny|qwen3-tiny|llama-3.2-1b] [--steps 4]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.stats import render_stats  # noqa: E402
from tilec.zoo import CONFIGS, eager_step, make_model, prefill  # noqa: E402


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--model", default="llama-tiny", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=positive, default=1)
    ap.add_argument("--context", type=positive, default=8, help="prefilled positions before the decode steps")
    ap.add_argument("--steps", type=positive, default=4)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cuda = torch.cuda.is_available()
    device, dtype, tol = ("cuda", torch.bfloat16, 2e-2) if cuda else ("cpu", torch.float32, 1e-4)
    print(f"model {args.model}, batch {args.batch}, {dtype}, on {device} "
          f"({'CUDA executor' if cuda else 'CPU reference executor'})")
    model = make_model(args.model, dtype, device)
    print(f"eager prefill of {args.context} positions ...", flush=True)
    cache, tok = prefill(model, args.batch, args.context, args.context + args.steps + 1, device)
    eager_cache = copy.deepcopy(cache)

    t0 = time.perf_counter()
    print("compiling (torch.export and the lowering first: the longer the cache, the longer that stage) ...",
          flush=True)
    step = compile_decode_step(model, cache, args.batch,
                               hook=lambda stage, ir, s: print(f"  {stage:<11} {s * 1e3:8.1f} ms"))
    print(f"compiled in {time.perf_counter() - t0:.1f} s\n{render_stats(step.program.stats)}\n")

    worst = 0.0
    for i in range(args.steps):
        pos = args.context + i
        want = eager_step(model, eager_cache, tok, pos)
        t0 = time.perf_counter()
        got = step(tok, pos)
        dt = time.perf_counter() - t0
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        worst = max(worst, err)
        same = torch.equal(got.argmax(-1), want.argmax(-1))
        print(f"step {i} (position {pos}): logits rel L2 vs eager {err:.2e}, greedy token "
              f"{'matches' if same else 'differs'}, {dt * 1e3:.1f} ms")
        tok = want.argmax(-1)
    ok = worst <= tol
    print(f"\n{'OK' if ok else 'MISMATCH'}: worst relative L2 {worst:.2e} (tolerance {tol:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
