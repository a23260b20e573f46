"""Host time of one ``torch.compile(backend="tilec")`` decode call, less the executor's run.

Compiles an HF decode step through the backend (a static cache, one token), then times the
program's own host work per call with the executor's run replaced by nothing: ``bind_args`` (the
arguments checked and bound, positions read) and the whole call (also the operand-table lookup,
the mask check, the position updates and the output copy). Medians of ``--iters`` calls, in µs.
On the CPU the reference executor's NaN poisoning of its buffers is part of the call row, so read
``bind_args`` there; on a GPU both rows are what a call costs the host.

    PYTHONPATH=. python benchmarks/lab/call_host_cost.py --model llama-3.2-1b [--layers 16] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tilec.backend  # noqa: E402,F401  (registers backend="tilec" when run from the source tree)
from tilec import program as progmod  # noqa: E402
from tilec.hf import cache_kwargs  # noqa: E402
from tilec.zoo import CONFIGS, make_model  # noqa: E402


class _NoRun:
    def run(self, *args, **kwargs):
        pass


def main(argv=None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args(argv)
    from transformers import StaticCache

    dev = args.device
    model = make_model(args.model, torch.bfloat16, dev, layers=args.layers)
    cache = StaticCache(config=model.config, max_cache_len=64)
    ids = torch.randint(3, 1000, (1, 5), device=dev)
    seen = {}
    real = progmod.CompiledProgram.__call__

    def spy(self, *a, **kw):
        seen["program"], seen["args"] = self, a
        return real(self, *a, **kw)

    with torch.no_grad():
        model(ids, cache_position=torch.arange(5, device=dev), use_cache=True, **cache_kwargs(model, cache))
        f = torch.compile(model, backend="tilec", options={"fallback": False})
        progmod.CompiledProgram.__call__ = spy
        try:
            f(ids[:, -1:], cache_position=torch.tensor([5], device=dev), use_cache=True, **cache_kwargs(model, cache))
        finally:
            progmod.CompiledProgram.__call__ = real
        torch._dynamo.reset()
    prog, call_args = seen["program"], seen["args"]
    prog.executor = _NoRun()
    counters = [a for a in call_args if isinstance(a, torch.Tensor) and a.numel() == 1 and not a.is_floating_point()]
    rows = {}
    for label, fn in (("bind_args", lambda: prog.bind_args(call_args)), ("call, no run", lambda: prog(*call_args))):
        times = []
        for _ in range(args.iters):
            for c in counters:  # keep the step at position 5
                c.fill_(5)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        rows[label] = statistics.median(times)
    n_layers = model.config.num_hidden_layers
    print(f"{args.model}, {n_layers} layers, {dev}: {len(call_args)} arguments, {len(counters)} one-element integer arguments")
    for label, us in rows.items():
        print(f"  {label:<14} {us:8.1f} µs (median of {args.iters})")
    return rows


if __name__ == "__main__":
    main()
