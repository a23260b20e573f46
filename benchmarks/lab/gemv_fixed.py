"""Where the GEMV microbenchmark's time goes besides streaming: a fixed cost per launch.

``decode.py --gemv`` times one plan of 8 independent 2048 x 8192 GEMVs (268 MB) between two CUDA
events; at 3.2 TB/s that is 84 µs, where 268 MB at the 4.3-4.4 TB/s of the larger shapes is ~62.
This script times plans of 1, 2, 4, 8, 16 and 32 such GEMVs (bf16, M = 1) and fits
``µs = fixed + MB / rate`` by least squares, each plan timed two ways: one launch between two events
(as decode.py does), and a CUDA graph of ``--chain`` launches back to back (the event-to-kernel latency
then counts once a chain); a plan timed right after compiling ("cold", as decode.py did before it warmed
each plan for 50 ms, forty-eighth session) and after ~300 ms of replays ("warm"). Prints a table and the
fits, then one profiled run's stamps; needs a CUDA GPU.

    python benchmarks/lab/gemv_fixed.py [--n 2048] [--k 8192] [--counts 1,2,4,8,16,32] [--chain 10]
    python benchmarks/lab/gemv_fixed.py --order 8    # one plan, under what ran or was allocated before it
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from decode import gemv_plan  # noqa: E402
from tilec.timing import cuda_graph, median_ms, need_gpu  # noqa: E402


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def stamp_summary(stamps_ns: torch.Tensor) -> str:
    """The workers' part of ``stamp_table``'s line from ``Executor.stamps[:, 0]`` ([W, 4] int64 ns: each
    worker's first instruction's start, end, mark 1 (x staged), mark 2 (first weight stage in)): the span
    from the first start to the last end and medians over the workers that ran an instruction (µs) - a
    plan with fewer tiles than workers leaves the others' stamps zero, which are left out.

    Raises ValueError when no worker stamped an instruction."""
    import statistics as st

    s = stamps_ns.double() / 1e3
    s = s[s[:, 0] > 0]
    if not len(s):
        raise ValueError("no worker stamped an instruction (was the plan compiled with profile=True?)")
    start, end, m1, m2 = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
    t0 = float(start.min())
    med = lambda v: st.median(v.tolist())  # noqa: E731
    return (f"stamped span {float(end.max()) - t0:.2f} (first start to last end); medians over {s.shape[0]} workers: "
            f"start {med(start - t0):.2f} after the first, x staged {med(m1 - start):.2f} and first stage in "
            f"{med(m2 - start):.2f} after their start, end {med(end - start):.2f} after it; last end "
            f"{float(end.max()) - med(end):.2f} after the median end")


def stamp_table(n: int, k: int, count: int) -> None:
    """One profiled run of ``count`` GEMVs (``Options.profile``: each instruction's start, x staged, first
    weight stage in, end; one instruction a worker here): the kernel's event time against the span its
    workers stamped, and medians over the workers (µs)."""
    _, _, prog, run = gemv_plan(n, k, count, profile=True)
    graph = cuda_graph(run)
    kernel = median_ms(graph.replay, 200, 50, "cuda") * 1e3  # the last replay's stamps are kept
    print(f"\nprofiled, {count} x {n} x {k}: kernel {kernel:.2f} us (events, median); "
          + stamp_summary(prog.executor.stamps.cpu()[:, 0]))


def read_4gib() -> None:
    """decode.py's ``read_bandwidth()``: 4 GiB allocated, summed 25 times, freed (its block stays cached)."""
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()
    median_ms(lambda: x.sum(), 20, 5, "cuda")  # x is freed on return


def time_plan(n: int, k: int, count: int, iters: int, after_weights=None, trace: int = 0) -> list[float]:
    """µs of one plan of ``count`` GEMVs [n, k] (bf16, M = 1), timed three times as decode.py's GEMV table
    did (a CUDA graph replayed ``iters`` times right after compiling, 5 warm-up replays; it now warms 50 ms);
    ``after_weights()`` runs after the weights are allocated and the plan compiled, before the timings.
    With ``trace``: instead, each of the first ``trace`` replays' µs (two events each, no warm-up)."""
    _, _, prog, run = gemv_plan(n, k, count)
    graph = cuda_graph(run)
    if after_weights is not None:
        after_weights()
    if trace:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(trace + 1)]
        events[0].record()
        for e in events[1:]:
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        us = [a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:])]
    else:
        us = [median_ms(graph.replay, iters, 5, "cuda") * 1e3 for _ in range(3)]
    prog.executor.check()
    return us


def print_times(label: str, us: list[float], mb: float) -> None:
    """One row of ``time_plan``'s three timings and the first one's TB/s."""
    print(f"{label:<52} " + " ".join(f"{u:>8.2f}" for u in us) + f"   {mb / us[0]:.2f} TB/s (first)", flush=True)


def order_table(n: int, k: int, count: int, iters: int) -> None:
    """One plan of ``count`` GEMVs timed as decode.py's GEMV table did (``time_plan``), under what ran or was allocated
    before it: decode.py's first GEMV row ran ~15 µs slower than this script's same plan (forty-seventh
    session, H100). Conditions: weights in fresh memory; weights carved from the cached 4 GiB block of
    decode.py's ``read_bandwidth()``; that block freed first (``empty_cache``); the 4 GiB read run after the
    weights were allocated (a busy GPU, fresh memory)."""
    mb = count * n * k * 2 / 1e6
    conditions = (("fresh memory", None, None),
                  ("carved from read_bandwidth()'s freed 4 GiB", read_4gib, None),
                  ("read_bandwidth(), empty_cache(), then weights", lambda: (read_4gib(), torch.cuda.empty_cache()),
                   None),
                  ("fresh memory, read_bandwidth() before timing", None, read_4gib),
                  ("fresh memory (again)", None, None))
    print(f"\n{count} x {n} x {k} GEMVs, us (three timings of {iters} replays each, the first as decode.py's did)")
    for label, before, after in conditions:
        torch.cuda.empty_cache()
        if before is not None:
            before()
        print_times(label, time_plan(n, k, count, iters, after), mb)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--counts", default="1,2,4,8,16,32")
    ap.add_argument("--chain", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--stamps", type=int, default=8, metavar="COUNT",
                    help="then one profiled plan of COUNT GEMVs (0: none)")
    ap.add_argument("--order", type=int, default=0, metavar="COUNT",
                    help="only time one plan of COUNT GEMVs under what ran or was allocated before it (decode.py's "
                         "slow first GEMV row)")
    args = ap.parse_args(argv)
    need_gpu("gemv_fixed.py")
    if args.order:
        return order_table(args.n, args.k, args.order, args.iters)
    counts = [int(c) for c in args.counts.split(",")]
    print(f"{'GEMVs':>6} {'MB':>8} {'tasks':>6} {'us cold':>9} {'TB/s':>6} {'us warm':>9} {'TB/s':>6} {'chained':>9} "
          f"{'TB/s':>6}")
    rows = []
    for count in counts:
        mod, x, prog, run = gemv_plan(args.n, args.k, count)
        with torch.no_grad():
            got, want = prog(x), mod(x)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        err = max(float((g.float() - w.float()).norm() / w.float().norm()) for g, w in zip(got, want))
        graph = cuda_graph(run)
        one = median_ms(graph.replay, args.iters, 5, "cuda") * 1e3  # right after compiling (decode.py warms 50 ms first)
        warm = median_ms(graph.replay, args.iters, max(5, int(300e3 / one)), "cuda") * 1e3  # after ~300 ms busy
        chain = cuda_graph(lambda r=run: [r() for _ in range(args.chain)])
        chained = median_ms(chain.replay, max(5, args.iters // args.chain), 2, "cuda") * 1e3 / args.chain
        prog.executor.check()
        mb = count * args.n * args.k * 2 / 1e6
        rows.append((mb, one, warm, chained))
        print(f"{count:>6} {mb:>8.1f} {prog.plan.stats['tasks']:>6} {one:>9.2f} {mb / one:>6.2f} {warm:>9.2f} "
              f"{mb / warm:>6.2f} {chained:>9.2f} {mb / chained:>6.2f}   (rel. L2 vs torch {err:.1e})", flush=True)
        del mod, prog, run, graph, chain  # (run holds the program, and with it the weights)
        torch.cuda.empty_cache()
    for label, col in (("1 launch, cold", 1), ("1 launch, warm", 2), ("chained", 3)):
        a, b = fit([r[0] for r in rows], [r[col] for r in rows])
        print(f"fit ({label}): fixed {a:.2f} us + MB / {1 / b:.3f} TB/s")
    if args.stamps:
        stamp_table(args.n, args.k, args.stamps)


if __name__ == "__main__":
    main()
