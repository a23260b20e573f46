"""Timing helpers shared by the CLI's ``bench`` and the benchmark scripts."""
from __future__ import annotations

import statistics
import time

import torch


def step_times(fn, iters: int, warmup: int = 5, device: torch.device | str = "cuda") -> list[float]:
    """Seconds per call of ``fn()`` after ``warmup`` calls: CUDA events around each call on a
    GPU (device time, including any host gap inside the call), wall clock on the CPU."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median_ms(fn, iters: int, warmup: int = 5, device: torch.device | str = "cuda") -> float:
    """Median milliseconds per call (see :func:`step_times`)."""
    return statistics.median(step_times(fn, iters, warmup, device)) * 1e3


def cuda_graph(fn, warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """``fn()`` captured in one CUDA graph, after ``warmup`` calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def need_gpu(script: str) -> None:
    """Exits with a one-line message (status 2) when torch sees no CUDA GPU: for GPU-only scripts."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU, and torch sees none")
