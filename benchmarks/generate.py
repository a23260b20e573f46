"""HF ``generate()`` with a static KV cache: eager, HF's own compiled decoding and
``torch.compile(backend="tilec")``.

What an application sees: greedy decoding of ``--new-tokens`` tokens after a random prompt of
``--context`` tokens, through HF's own generation loop (its logits processing, stopping checks
and, per step, the attention mask it builds). The decode time per token is
``(t(N new tokens) - t(1 new token)) / (N - 1)``, so the prefill cancels (under tilec it runs
eagerly: tilec compiles decode steps); each time is the median of ``--iters`` runs after a
warm-up run of each length (the first compiles). Take ``--iters`` of 3 or more: one run of each
is noise, and can even give a negative difference.

Rows: ``eager`` (``disable_compile=True``); ``HF compiled`` - what ``generate()`` does by default
on a GPU with a static cache: it compiles the model's call with Inductor in "reduce-overhead"
mode (CUDA graphs) for the decode steps (skipped on the CPU, where HF does not, and with
``--skip-inductor``); ``tilec``: ``model.forward = torch.compile(model.forward, backend="tilec",
dynamic=False)`` with ``disable_compile=True`` (left on, HF's Inductor compile wraps tilec's and
breaks its graph there: 4.76 against 4.50 ms a token on an H200 in the forty-fourth session).

The table also gives the fraction of generated tokens equal to eager's and, for the first one that
differs, how far apart eager's own logits of the two tokens were: bf16 with random weights has
near-ties, and one different token changes every later one.

    python benchmarks/generate.py --model llama-3.2-1b --context 1024 --new-tokens 64
    python benchmarks/generate.py --model llama-tiny --device cpu --context 16 --new-tokens 4 --iters 1   # a smoke run

On the CPU (``--device cpu``, float32) tilec runs its reference executor: a check that the path
works, not a speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tilec.backend  # noqa: E402,F401  (registers backend="tilec" when run from the source tree)
from decode import positive  # noqa: E402
from tilec.zoo import CONFIGS, MAX_POSITION_EMBEDDINGS, make_model  # noqa: E402


def generate(model, ids: torch.Tensor, mask: torch.Tensor, new: int, hf_compile: bool = False, logits: bool = False):
    """Greedy ``generate()`` of ``new`` tokens after ``ids`` [B, T] (static cache); HF's own
    compiled decoding only with ``hf_compile``. Returns the token ids [B, T + new], or with
    ``logits`` also the per-step logits (a tuple of ``new`` float [B, vocab])."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, cache_implementation="static", pad_token_id=0,
                         disable_compile=not hf_compile, return_dict_in_generate=logits, output_logits=logits)
    return (out.sequences, out.logits) if logits else out


def first_difference(want: torch.Tensor, got: torch.Tensor, logits) -> tuple[int, float] | None:
    """(step, gap) of the first generated token where ``got`` [B, N] differs from ``want`` [B, N]
    (eager's tokens; ``logits``: eager's N logits [B, vocab]), the gap being eager's logit of its
    own token less its logit of ``got``'s (>= 0; small: a near-tie); None when all are equal."""
    diff = (want != got).nonzero()
    if not len(diff):
        return None
    t = int(diff[:, 1].min())
    b = int(diff[diff[:, 1] == t][0, 0])
    row = logits[t][b].float()
    return t, float(row[want[b, t]] - row[got[b, t]])


def timed_ms(fn, iters: int, device: str) -> float:
    """Median wall time of ``fn()`` in ms over ``iters`` runs (the GPU synchronized around each)."""
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> list[tuple]:
    ap = argparse.ArgumentParser(description="Times HF generate() (greedy, static cache) eager, compiled by HF "
                                             "(Inductor) and under torch.compile(backend='tilec'): ms per "
                                             "decoded token.")
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS),
                    help="a tilec.zoo model with random weights (default llama-3.2-1b)")
    ap.add_argument("--context", type=positive, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--new-tokens", type=positive, default=64, help="tokens to generate, >= 2 (default 64)")
    ap.add_argument("--batch", type=positive, default=1, help="sequences (default 1)")
    ap.add_argument("--pad", type=int, default=0, help="left-pad the last sequence by this many tokens: its "
                                                       "calls fail tilec's mask check and run eagerly (default 0)")
    ap.add_argument("--iters", type=positive, default=5, help="timed runs per row (default 5)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (bf16) or cpu (float32, tilec's reference executor: a smoke run)")
    ap.add_argument("--skip-inductor", action="store_true",
                    help="leave out the row of HF's own compiled decoding (Inductor: a minute or more to compile)")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: the per-token time needs at least 2")
    if not 0 <= args.pad < args.context:
        ap.error(f"--pad {args.pad}: expected 0 <= pad < --context ({args.context})")
    if args.context + args.new_tokens > MAX_POSITION_EMBEDDINGS:
        ap.error(f"--context {args.context} + --new-tokens {args.new_tokens} exceeds {args.model}'s "
                 f"max_position_embeddings ({MAX_POSITION_EMBEDDINGS})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here (use --device cpu for a smoke run)")
    warnings.simplefilter("ignore")
    dev = args.device
    model = make_model(args.model, torch.bfloat16 if dev == "cuda" else torch.float32, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), generator=gen).to(dev)
    mask = torch.ones_like(ids)
    if args.pad:
        mask[-1, :args.pad] = 0
    new = args.new_tokens
    labels = ["eager"] + (["HF compiled"] if dev == "cuda" and not args.skip_inductor else []) + ["tilec"]
    rows, tokens = [], {}
    with torch.no_grad():
        forward = model.forward
        for label in labels:
            hf = label == "HF compiled"
            if label == "tilec":
                model.forward = torch.compile(forward, backend="tilec", dynamic=False)
            try:
                seqs, logits = generate(model, ids, mask, new, hf, logits=True)  # warm-up (compiles)
                tokens[label] = seqs[:, -new:]
                if label == "eager":
                    eager_logits = logits
                generate(model, ids, mask, 1, hf)
                t_n = timed_ms(lambda: generate(model, ids, mask, new, hf), args.iters, dev)
                t_1 = timed_ms(lambda: generate(model, ids, mask, 1, hf), args.iters, dev)
            finally:
                model.forward = forward
                torch._dynamo.reset()
            rows.append((label, (t_n - t_1) / (new - 1), t_n))
    print(f"HF generate(), {args.model}, {dev}, batch {args.batch}, prompt {args.context}"
          f"{f' (last sequence left-padded by {args.pad})' if args.pad else ''}, {new} new tokens, "
          f"median of {args.iters}")
    print(f"{'':<12} {'ms / token':>11} {'tokens / s':>11} {f'ms for {new}':>12}  tokens equal to eager's"
          f"   (ms for {new}: the whole call, prefill included)")
    for label, per, total in rows:
        agree = (tokens[label] == tokens["eager"]).float().mean().item()
        first = first_difference(tokens["eager"], tokens[label], eager_logits)
        said = "" if first is None else (f" (first differs at new token {first[0]}, where eager's logits of the "
                                         f"two tokens are {first[1]:.3g} apart)")
        print(f"{label:<12} {per:>11.3f} {args.batch * 1e3 / per:>11.1f} {total:>12.1f}  {agree:.1%}{said}")
    if args.iters < 3:
        print(f"(--iters {args.iters}: one or two runs of each length are noise; take 3 or more for a timing)")
    if dev == "cpu":
        print("(cpu: tilec runs its reference executor - a check that the path works, not a speed)")
    return rows


if __name__ == "__main__":
    main()
