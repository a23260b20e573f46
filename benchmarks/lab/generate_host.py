"""Where HF ``generate()``'s time per token goes under ``torch.compile(backend="tilec")`` (benchmarks/lab).

In the forty-fourth session, on an H200, ``benchmarks/generate.py`` (Llama-3.2-1B, prompt 1024, 64 new tokens) took
4.19 ms a token under tilec, against 2.57 for HF's own Inductor decoding and 21.8 eager, though tilec's step
replays in 1.1 ms: the host, not the step, sets the pace. HF reads its stop flag every token (a host sync), so a
token costs HF's work before the call + tilec's work before its launch + the step. This script times one
``generate()``'s decode calls (medians, ms): the compiled ``forward`` (Dynamo, AOTAutograd and tilec), tilec's
graph region, its argument binding (with the one host read of the positions and mask flags, which waits for the
GPU), the mask guards, the executor's launch, HF's ``prepare_inputs_for_generation``, and on a GPU the step's
kernel (CUDA events around the launch) and the GPU's idle time between steps.

    PYTHONPATH=. python benchmarks/lab/generate_host.py [--model llama-3.2-1b] [--context 1024] [--new-tokens 64]
    PYTHONPATH=. python benchmarks/lab/generate_host.py --device cpu --model llama-tiny --context 16 --new-tokens 6

On the CPU (float32, the reference executor: a smoke run) there is no kernel row.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tilec.backend as backend  # noqa: E402  (registers backend="tilec" from a source tree)
import tilec.program as program  # noqa: E402
from generate import generate as hf_generate  # noqa: E402  (benchmarks/generate.py: disable_compile, greedy)
from tilec.zoo import CONFIGS, make_model  # noqa: E402


def main(argv=None) -> dict[str, float]:
    """Prints and returns {row: median ms} over one generate()'s decode calls."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="default: cuda when there is one")
    ap.add_argument("--options", default="{}", help='tilec options as JSON, e.g. \'{"check": true}\'')
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: at least 2 (the first new token comes from the prefill; the rows "
                 f"are medians over the decode calls after it)")
    import json

    warnings.simplefilter("ignore")
    dev = args.device
    model = make_model(args.model, torch.bfloat16 if dev == "cuda" else torch.float32, dev)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    times: dict[str, list[float]] = collections.defaultdict(list)
    kernels: list[tuple] = []
    patched: list[tuple] = []

    decoding = [False]  # inside a decode call (one token a sequence): only those are timed

    def timed(name, fn, outer=False):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if outer:
                ids_ = k.get("input_ids", a[0] if a else None)
                decoding[0] = isinstance(ids_, torch.Tensor) and ids_.shape[-1] == 1
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if decoding[0]:
                times[name].append((time.perf_counter() - t0) * 1e3)
            if outer:
                decoding[0] = False
            return out
        return wrapper

    def patch(owner, attr, new):
        patched.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, new)

    patch(backend._Region, "__call__", timed("tilec region", backend._Region.__call__))
    patch(program.CompiledProgram, "_bind", timed("binding + host read", program.CompiledProgram._bind))
    patch(program, "mismatches", timed("mask guards", program.mismatches))
    if dev == "cuda":
        from tilec.cuda import CudaExecutor

        run = CudaExecutor.run

        def launch(self, *a, **k):
            if not decoding[0]:
                return run(self, *a, **k)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = run(self, *a, **k)
            times["launch"].append((time.perf_counter() - t0) * 1e3)
            end.record()
            kernels.append((start, end))
            return out
        patch(CudaExecutor, "run", launch)
    forward = model.forward
    try:
        prepare = model.prepare_inputs_for_generation

        @functools.wraps(prepare)
        def prepare_timed(*a, **k):  # its first call of a generate() prepares the prefill: left out below
            t0 = time.perf_counter()
            out = prepare(*a, **k)
            times["HF prepare_inputs"].append((time.perf_counter() - t0) * 1e3)
            return out
        model.prepare_inputs_for_generation = prepare_timed
        model.forward = timed("compiled forward", torch.compile(forward, backend="tilec", dynamic=False,
                                                                options=json.loads(args.options)), outer=True)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            hf_generate(model, ids, mask, args.new_tokens)  # compiles
            times.clear()
            kernels.clear()
            t0 = time.perf_counter()
            hf_generate(model, ids, mask, args.new_tokens)
            if dev == "cuda":
                torch.cuda.synchronize()
            total = (time.perf_counter() - t0) * 1e3
    finally:
        model.forward = forward
        del model.prepare_inputs_for_generation
        for owner, attr, old in reversed(patched):
            setattr(owner, attr, old)
        torch._dynamo.reset()
    times["HF prepare_inputs"] = times["HF prepare_inputs"][1:]
    med = {name: statistics.median(v) for name, v in times.items() if v}
    rows = {}  # nested as they run: forward > (Dynamo + AOTAutograd, region > (binding > guards, launch))
    for name, label in (("HF prepare_inputs", "HF prepare_inputs"), ("compiled forward", "compiled forward"),
                        (None, "  Dynamo + AOTAutograd"), ("tilec region", "  tilec region"),
                        ("binding + host read", "    binding + host read"), ("mask guards", "      mask guards"),
                        ("launch", "    launch")):
        if name is None and {"compiled forward", "tilec region"} <= set(med):
            rows[label] = med["compiled forward"] - med["tilec region"]  # a difference of medians
        elif name in med:
            rows[label] = med[name]
    if kernels:
        rows["kernel (GPU)"] = statistics.median(s.elapsed_time(e) for s, e in kernels)
        if len(kernels) > 1:
            rows["GPU idle between steps"] = statistics.median(
                kernels[i][1].elapsed_time(kernels[i + 1][0]) for i in range(len(kernels) - 1))
    calls = len(times.get("compiled forward", ()))
    print(f"HF generate() under tilec, {args.model}, {dev}, prompt {args.context}, {args.new_tokens} new tokens: "
          f"{total:.1f} ms in all; medians over its {calls} decode calls, ms (indented: parts of the row above)")
    for label, ms in rows.items():
        print(f"  {label:<26} {ms:8.3f}")
    return {label.strip(): ms for label, ms in rows.items()}


if __name__ == "__main__":
    main()
