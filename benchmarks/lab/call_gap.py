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
* ``graph of seek + step``: its ``tilec (CUDA graph replay)`` row;
* ``loop of 32 steps + argmax``: greedy decoding from Python without a sync between steps (the
  host runs ahead of the GPU, as an application's loop does), per step.

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

    loop = 32

    def greedy_loop():  # an application's decode loop: no host sync between steps, so the host runs ahead
        step.seek(ctx)
        t = tok
        for i in range(loop):
            t = step(t, ctx + i)[:, -1:].argmax(-1)

    layers = [("launch", launch, 1), ("graph of launch", cuda_graph(launch).replay, 1), ("program", program, 1),
              ("step", step_only, 1), ("seek + step", seek_step, 1),
              ("graph of seek + step", cuda_graph(seek_step).replay, 1),
              (f"loop of {loop} steps + argmax", greedy_loop, loop)]
    print(f"Llama-3.2-1B decode step, batch {args.batch}, context {ctx}, {torch.cuda.get_device_name()}")
    print(f"{'call (per step)':30s} {'device ms':>10s} {'host us':>10s}")
    for name, fn, per in layers:  # per: steps a call of fn makes (the row is per step)
        step.seek(ctx)
        n = max(5, args.iters // per)
        dev = statistics.median(step_times(fn, n)) * 1e3 / per
        print(f"{name:30s} {dev:10.3f} {host_us(fn, n) / per:10.1f}", flush=True)
    ex.check()


if __name__ == "__main__":
    main()
