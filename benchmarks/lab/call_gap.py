"""Where a decode step called from Python spends the time a CUDA graph replay does not (benchmarks/lab).

``benchmarks/decode.py`` times the Llama-3.2-1B step at ~0.22 ms more called from Python than replayed from a
CUDA graph (H200, thirty-fifth session: 1.330 against 1.110 ms), and cutting the Python argument handling
from 199 to 75 µs (a CPU stub) moved that row by ~0.02 ms only. This prints, for the same compiled step, the
median device time (CUDA events around each call, as ``decode.py``) and host time (``perf_counter`` until the
call returns) of each layer of the call, innermost first:

* ``launch``: ``CudaExecutor.run`` with the bound operand table (the ctypes call and the cooperative launch);
* ``graph of launch``: that launch alone replayed from a CUDA graph;
* ``program``: ``CompiledProgram.__call__`` (argument checks, the token copy, the launch, the logits copy);
* ``step``: ``DecodeStep.__call__`` (adds the cache counters' update);
* ``seek + step``: what ``decode.py`` times;
* ``graph of seek + step``: its ``tilec (CUDA graph replay)`` row.

    PYTHONPATH=. python benchmarks/lab/call_gap.py [--iters 100] [--batch 1]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _llama_step import llama_model  # noqa: E402
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.timing import cuda_graph, step_times  # noqa: E402


def host_us(fn, iters: int) -> float:
    """Median µs from calling ``fn()`` to its return (the GPU drained before each call)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    model, cache, tok = llama_model("call_gap.py", 1024, batch=args.batch)
    ctx = 1024
    step = compile_decode_step(model, cache, args.batch, options=dict(check=False))
    prog, ex = step.program, step.program.executor
    state = [ctx if t.dim() == 0 else t for t in step.module.state()]
    tensors, _ = prog.bind_args((tok, ctx, *state))
    table = prog._table(tensors)

    def launch():
        ex.run(tensors, table, position=ctx)

    def program():
        return prog(tok, ctx, *state)

    def step_only():  # the step without seek's two counter kernels: re-decoding ctx, as if just after a seek
        step._expected = ctx  # (the step then skips its consecutive-position check; it rewrites the counters)
        return step(tok, ctx)

    def seek_step():
        step.seek(ctx)
        return step(tok, ctx)

    layers = [("launch", launch), ("graph of launch", cuda_graph(launch).replay), ("program", program),
              ("step", step_only), ("seek + step", seek_step),
              ("graph of seek + step", cuda_graph(seek_step).replay)]
    print(f"Llama-3.2-1B decode step, batch {args.batch}, context {ctx}, {torch.cuda.get_device_name()}")
    print(f"{'call':24s} {'device ms':>10s} {'host us':>10s}")
    for name, fn in layers:
        step.seek(ctx)
        dev = statistics.median(step_times(fn, args.iters)) * 1e3
        print(f"{name:24s} {dev:10.3f} {host_us(fn, args.iters):10.1f}", flush=True)
    ex.check()


if __name__ == "__main__":
    main()
