"""Why decode.py's first GEMV row was slow: the 8 x 2048 x 8192 plan timed in one process after each of
decode.py's stages (the model's weights and KV cache allocated, its eager step and CUDA graph run, its tilec
step compiled and replayed, read_bandwidth()), then each of its first 200 replays' time after
read_bandwidth(), after a 4.2 GB plan, and alone. Forty-eighth session, H100: decode.py's row read 114-117 µs
and gemv_fixed.py's same plan 97-101; here, after read_bandwidth() and a fresh allocation, the first ~80
replays took 111-112 µs and later ones 97-98 - a transient, which decode.py now warms past.

    python benchmarks/lab/gemv_context.py    # needs a CUDA GPU
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "lab"))
from gemv_fixed import print_times, read_4gib, time_plan  # noqa: E402
from tilec.hf import cache_kwargs, compile_decode_step  # noqa: E402
from tilec.timing import cuda_graph, median_ms, need_gpu  # noqa: E402
from tilec.zoo import make_model, prefill  # noqa: E402


def main() -> None:
    need_gpu("gemv_context.py")
    n, k, count, iters, ctx = 2048, 8192, 8, 50, 1024
    mb = count * n * k * 2 / 1e6
    row = lambda label: print_times(label, time_plan(n, k, count, iters), mb)  # noqa: E731
    row("alone")
    model = make_model("llama-3.2-1b", torch.bfloat16, "cuda")
    cache, tok = prefill(model, 1, ctx, ctx + 64, "cuda")
    row("model + KV cache allocated")
    pos = torch.tensor([ctx], device="cuda")
    with torch.no_grad():
        eager = lambda: model(tok, **cache_kwargs(model, cache), cache_position=pos, use_cache=True).logits  # noqa: E731
        median_ms(eager, 20, 3, "cuda")
    row("eager step run")
    step = compile_decode_step(model, cache, 1, options=dict(check=False))
    row("tilec step compiled")
    tilec_step = lambda: (step.seek(ctx), step(tok, ctx))  # noqa: E731
    tilec_step()
    g = cuda_graph(tilec_step)
    median_ms(g.replay, 50, 5, "cuda")
    row("tilec step replayed")
    read_4gib()
    row("read_bandwidth() run")
    g = step = tilec_step = None  # noqa: F841 (freed)
    torch.cuda.empty_cache()
    row("tilec step freed")
    # the slow first timing seen after decode.py's 128256 x 2048 row: each replay's µs, in tens (median each)
    for label, before in (("after read_bandwidth()", read_4gib),
                          ("after 55 replays of 8 x 128256 x 2048", lambda: time_plan(128256, 2048, 8, 50, trace=55)),
                          ("alone", None)):
        torch.cuda.empty_cache()
        if before is not None:
            before()
        us = time_plan(n, k, count, iters, trace=200)
        tens = [sorted(us[i:i + 10])[5] for i in range(0, len(us), 10)]
        print(f"{label}: replays' us, a median of ten each: " + " ".join(f"{t:.1f}" for t in tens), flush=True)


if __name__ == "__main__":
    main()
