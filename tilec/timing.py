"""Timing helpers shared by the CLI's ``bench`` and the benchmark scripts."""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
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


class SmClock:
    """Samples the GPU's SM and memory clocks (MHz) while a block runs, with ``nvidia-smi`` queries
    from a background thread (one every ``period_s``), so a timing table can say at what clock it
    was measured: the latency-bound persistent kernel slows with the SM clock, which differs between
    machines and moves with power and heat, while bandwidth-bound baselines barely do (they move with
    the memory clock).

        with SmClock() as clk:
            ms = median_ms(fn, 100)
        clk.mhz, clk.mem_mhz  # medians of the samples, or None

    ``mhz`` / ``mem_mhz`` are None when ``nvidia-smi`` is missing or its output is not a number.
    Never raises for a missing or broken tool; the first query runs on entry, so a short block has a
    sample.
    """

    def __init__(self, device: int | None = None, period_s: float = 0.1):
        self.device, self.period_s = device, period_s
        self.samples: list[int] = []  # SM clock, MHz
        self.mem_samples: list[int] = []  # memory clock, MHz
        self._stop = None
        self._thread = None
        self._cmd = None

    def _query(self) -> None:
        try:
            out = subprocess.run(self._cmd, capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return
        rows = [[v.strip() for v in ln.split(",")] for ln in out.strip().splitlines()]
        rows = [r for r in rows if r and r[0].isdigit()]  # (past a warning line, e.g. an infoROM one)
        vals = rows[-1] if rows else []
        if vals:
            self.samples.append(int(vals[0]))
        if len(vals) > 1 and vals[1].isdigit():
            self.mem_samples.append(int(vals[1]))

    def __enter__(self) -> "SmClock":
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        gpu = "0"
        if torch.cuda.is_available():
            d = torch.cuda.current_device() if self.device is None else self.device
            props = torch.cuda.get_device_properties(d)
            ids = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
            gpu = f"{ids[0]:08X}:{ids[1]:02X}:{ids[2]:02X}.0" if None not in ids else str(d)
        self._cmd = [exe, "-i", gpu, "--query-gpu=clocks.sm,clocks.mem", "--format=csv,noheader,nounits"]
        self._query()
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(self.period_s):
                self._query()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)

    @property
    def mhz(self) -> int | None:
        return int(statistics.median(self.samples)) if self.samples else None

    @property
    def mem_mhz(self) -> int | None:
        return int(statistics.median(self.mem_samples)) if self.mem_samples else None
