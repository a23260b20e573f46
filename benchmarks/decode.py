"""Decode-step benchmark on a CUDA GPU: prints one table per model, and a GEMV table.

Rows: eager HF; the same under one CUDA graph; torch.compile (Inductor) under CUDA graphs
(mode="reduce-overhead"); tilec called from Python (one step = operand binding + one kernel
launch + output copy, the GPU drained before each call, so the host work is on the critical
path); a greedy loop of 32 tilec steps from Python with no sync between them (the host runs
ahead of the GPU, as in an application's decode loop; per step, including the argmax); the
tilec step replayed from a CUDA graph; the HBM roofline (bytes that
must move / measured read bandwidth). Each row is the median of many CUDA-event-timed steps
after warm-up, and is also given as a multiple of the roofline and with the median SM clock
while it was timed (``tilec.timing.SmClock``; "-" without nvidia-smi): the persistent kernel is
latency-bound and slows with the clock, which differs between machines.

GEMV microbenchmark (``--gemv``): a compiled plan of 8 independent GEMVs (M = 1, bf16, the
weights larger than L2 together) run by the persistent executor, as TB/s of weight bytes, with the
median memory clock while it was timed.

    python benchmarks/decode.py --model llama-3.2-1b --context 1024 [--batch 1] [--skip-inductor] [--gemv]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tilec.errors import TilecError  # noqa: E402
from tilec.hf import cache_kwargs, compile_decode_step  # noqa: E402
from tilec.options import Options  # noqa: E402
from tilec.timing import SmClock, cuda_graph, median_ms, need_gpu  # noqa: E402
from tilec.zoo import CONFIGS, make_model, prefill  # noqa: E402


def time_cuda(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each between two CUDA events."""
    return median_ms(fn, iters, warmup, "cuda")


def read_bandwidth() -> float:
    """Measured HBM read bandwidth in bytes/s: a sum over 4 GiB (read-bound)."""
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()
    ms = time_cuda(lambda: x.sum(), 20)
    return x.numel() * 4 / (ms * 1e-3)


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step must move: every weight once (the tied embedding once as LM head;
    the embedding lookup reads only ``batch`` rows) plus the KV cache read up to ``context``."""
    cfg = model.config
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * context * cfg.head_dim * 2
    return nbytes + kv


def int_list(low: int):
    """An argparse type: comma-separated integers >= ``low`` (at least one)."""
    def parse(text: str) -> list[int]:
        items = text.split(",")
        try:
            values = [int(v) for v in items]
        except ValueError:
            values = []
        if not values or any(v < low for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low} (e.g. {low},{low + 1}), "
                                             f"got {text!r}")
        return values
    return parse


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def main():
    ap = argparse.ArgumentParser(description="Times one decode step on a CUDA GPU (eager, CUDA graph, Inductor, "
                                             "tilec, roofline) and optionally the GEMV microbenchmark. Needs a "
                                             "CUDA GPU; the arguments are checked first.")
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS),
                    help="a tilec.zoo model with random weights (default llama-3.2-1b)")
    ap.add_argument("--context", type=positive, default=1024, help="cached positions before the step (default 1024)")
    ap.add_argument("--batch", type=positive, default=1, help="sequences per step (default 1)")
    ap.add_argument("--iters", type=positive, default=100, help="timed steps per row (default 100)")
    ap.add_argument("--skip-inductor", action="store_true", help="leave out torch.compile (Inductor), which takes "
                                                                  "minutes to compile an 8B model")
    ap.add_argument("--gemv", action="store_true", help="also run the GEMV streaming microbenchmark")
    ap.add_argument("--gemv-rows", type=int_list(1), default=None, metavar="M,M,...",
                    help="with --gemv: x rows (M) of the microbenchmark's GEMVs, one table each (default 1)")
    ap.add_argument("--ring-stages", type=int_list(2), default=[], metavar="N,N,...",
                    help="also time the tilec step (CUDA graph replay) with each of these weight-ring depths")
    ap.add_argument("--options", default="{}", help='extra tilec compile options as JSON, e.g. \'{"fold_cache_writes": false}\' '
                         '(it sets check=False and times the CUDA executor: other values of those are refused)')
    args = ap.parse_args()
    depths = args.ring_stages
    if args.gemv_rows is not None and not args.gemv:
        ap.error("--gemv-rows sizes the GEMV microbenchmark: add --gemv")
    gemv_rows = args.gemv_rows or [1]
    try:  # bad flags fail here, before any timing
        extra = json.loads(args.options)
        if not isinstance(extra, dict):
            raise ValueError(f"expected a JSON object, got {args.options}")
        Options.from_dict(extra)
        if extra.get("check", False) is not False:  # (it would be overridden silently)
            raise ValueError("decode.py sets check=False itself (the step is timed without the per-call check)")
        if extra.get("executor", "cuda") not in ("cuda", "auto"):
            raise ValueError("decode.py times the CUDA executor (executor='cuda')")
    except ValueError as e:
        ap.error(f"--options {args.options!r}: {e}")
    need_gpu("decode.py")
    warnings.simplefilter("ignore")
    bw = model_table(args, extra, depths)
    if args.gemv:
        # the model, its cache, graphs and compiled step go first: the GEMV plans stream in a device
        # without the step's ~2.5-16 GB allocated (decode.py's row had read 3-7 % below the same plan alone)
        torch._dynamo.reset()  # Inductor's compiled model holds the model
        gc.collect()
        torch.cuda.empty_cache()
        for m in gemv_rows:
            gemv_table(bw, args.iters, stages=tuple(depths), rows=m)


def model_table(args, extra: dict, depths: list[int]) -> float:
    """Times the model's decode step every way and prints the table; returns the measured HBM read
    bandwidth (bytes/s). Everything it allocates on the GPU is garbage once it returns."""
    dev = "cuda"
    model = make_model(args.model, torch.bfloat16, dev)
    ctx, B = args.context, args.batch
    cache_len = ctx + 64
    cache, tok = prefill(model, B, ctx, cache_len, dev)
    pos_t = torch.tensor([ctx], device=dev)
    rows = []  # (label, ms, median SM clock in MHz or None)

    def timed(label, fn, iters=args.iters, per=1):
        with SmClock() as clk:
            ms = time_cuda(fn, iters)
        rows.append((label, ms / per, clk.mhz))

    def eager():
        with torch.no_grad():
            return model(tok, **cache_kwargs(model, cache), cache_position=pos_t, use_cache=True).logits

    counters = [l for l in cache.layers if isinstance(getattr(l, "cumulative_length", None), torch.Tensor)]

    def rewind():  # keep the position fixed at ctx (transformers versions with a counter advance it)
        for l in counters:
            l.cumulative_length.fill_(ctx)

    def eager_fixed():
        rewind()
        return eager()

    timed("eager", eager_fixed)

    # one CUDA graph of the eager step (the counter reset is captured too)
    g = cuda_graph(eager_fixed)
    timed("CUDA graph (eager)", g.replay)

    if not args.skip_inductor:
        t0 = time.time()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=False)

        def inductor():
            rewind()
            with torch.no_grad():
                return compiled(tok, **cache_kwargs(compiled, cache), cache_position=pos_t, use_cache=True).logits

        for _ in range(3):
            inductor()
        print(f"inductor compile+warmup {time.time() - t0:.1f}s", flush=True)
        timed("torch.compile (Inductor, CUDA graphs)", inductor)

    t0 = time.time()
    step = compile_decode_step(model, cache, B, options=dict(extra, check=False))
    print(f"tilec compile {time.time() - t0:.1f}s; stats {step.program.stats}", flush=True)

    def tilec_step():
        step.seek(ctx)  # re-decode position ctx every time
        return step(tok, ctx)

    tilec_step()
    step.program.executor.check()
    timed("tilec (Python call)", tilec_step)
    try:
        tg = cuda_graph(tilec_step)
        timed("tilec (CUDA graph replay)", tg.replay)
    except RuntimeError as e:  # report, do not hide the other rows
        print(f"tilec under a CUDA graph failed: {e}")
    loop = min(32, cache_len - ctx)

    def tilec_loop():  # greedy decoding from Python as an application runs it: no host sync between steps
        step.seek(ctx)
        t = tok
        for i in range(loop):
            t = step(t, ctx + i)[:, -1:].argmax(-1)

    timed(f"tilec (Python loop of {loop} greedy steps, per step)", tilec_loop, max(5, args.iters // 8), loop)
    step.program.executor.check()
    ex = step.program.executor
    plan_stages = ex.ring_stages
    for n in depths:
        try:
            ex.use_ring_stages(n)
        except TilecError as e:
            print(f"ring stages {n}: {e}")
            continue
        timed(f"tilec (CUDA graph replay, {n} ring stages)", cuda_graph(tilec_step).replay)
        ex.check()
    if depths and plan_stages:
        ex.use_ring_stages(plan_stages)

    bw = read_bandwidth()
    nbytes = step_bytes(model, B, ctx)
    roof = nbytes / bw * 1e3
    rows.append((f"roofline ({nbytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)", roof, None))
    name = torch.cuda.get_device_name()
    print(f"\n{args.model} decode step, batch {B}, context {ctx}, bf16, {name}")
    print(f"{'variant':<48} {'ms':>9} {'x roofline':>11} {'SM MHz':>7}")
    for label, ms, mhz in rows:
        print(f"{label:<48} {ms:>9.3f} {ms / roof:>11.2f} {mhz if mhz is not None else '-':>7}")
    return bw


class Gemvs(torch.nn.Module):
    """``count`` independent bias-free linears [n, k] of one input (the GEMV microbenchmark)."""

    def __init__(self, n: int, k: int, count: int = 8):
        super().__init__()
        self.ws = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False) for _ in range(count))

    def forward(self, x):
        return tuple(w(x) for w in self.ws)


def gemv_plan(n: int, k: int, count: int, rows: int = 1, profile: bool = False):
    """``(module, x, program, run)`` for ``count`` GEMVs [n, k] of ``rows`` x rows (bf16) on the GPU: ``run()``
    launches the executor once on an operand table bound once (no host work to time, so a CUDA graph can hold it)."""
    from tilec.api import compile_module

    mod = Gemvs(n, k, count).to("cuda", torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        prog = compile_module(mod, (x,), options=dict(check=False, profile=profile))
    tensors, p = prog.bind_args((x,))
    table = prog.plan.bind_base(tensors)
    return mod, x, prog, lambda: prog.executor.run(tensors, table, position=p)


GEMV_WARM_MS = 50.0  # replays of a GEMV plan before it is timed (see gemv_table)


def gemv_table(bw: float, iters: int, count: int = 8, stages: tuple[int, ...] = (), rows: int = 1) -> None:
    """Prints TB/s of weight bytes for ``count`` independent GEMVs of ``rows`` x rows (M) per plan,
    run by the persistent executor (kernel only: the operand table is bound once, the launch
    replayed from a CUDA graph); also with each weight-ring depth in ``stages``.

    Each plan replays for ``GEMV_WARM_MS`` (50 ms) before its ``iters`` timed replays: right after
    ``read_bandwidth()`` and the weights' allocation, the 8 x 2048 x 8192 plan's first ~80 replays
    (~9 ms) took 111-112 µs each and every later one 97-98 (forty-eighth session, H100,
    ``benchmarks/lab/gemv_context.py``); timed with 5 warm-up replays, as before, this table's first
    row read 114-117 µs where the same plan alone steadies at 98-102."""
    print(f"\nGEMV streaming: {count} independent GEMVs per plan, M = {rows}, bf16 (HBM read {bw / 1e12:.2f} TB/s)")
    print(f"{'weight [N, K]':<20} {'ring':>5} {'MB':>8} {'us':>9} {'TB/s':>7} {'mem MHz':>8}")
    for n, k in ((2048, 8192), (4096, 14336), (128256, 2048)):
        mod, x, prog, run = gemv_plan(n, k, count, rows)
        with torch.no_grad():
            got = prog(x)
            want = mod(x)
        err = max(float((g.float() - w.float()).norm() / w.float().norm()) for g, w in zip(got, want))
        ex = prog.executor
        nbytes = count * n * k * 2
        for depth in (ex.ring_stages, *stages):
            try:
                if depth != ex.ring_stages:
                    ex.use_ring_stages(depth)
            except TilecError as e:
                print(f"ring stages {depth}: {e}")
                continue
            graph = cuda_graph(run)  # no host time
            once = time_cuda(graph.replay, 3, warmup=1)
            with SmClock() as clk:  # the memory clock while timed (a stream's rate follows it)
                ms = time_cuda(graph.replay, iters, warmup=max(5, int(GEMV_WARM_MS / once)))
            ex.check()
            mem = clk.mem_mhz if clk.mem_mhz is not None else "-"
            print(f"{f'{n} x {k}':<20} {depth:>5} {nbytes / 1e6:>8.1f} {ms * 1e3:>9.1f} {nbytes / ms / 1e9:>7.2f}"
                  f" {mem:>8}   (rel. L2 vs torch {err:.1e})")
        del mod, prog, run


if __name__ == "__main__":
    main()
