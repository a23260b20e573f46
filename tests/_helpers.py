"""Shared test helpers (imported by the test modules; pytest puts ``tests/`` on ``sys.path``)."""
from __future__ import annotations

import contextlib
import signal
import threading

import torch


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ``|a - e| / |e|`` in float64 (``|e|`` must be non-zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert torch.isfinite(a).all(), "result has NaN/Inf (an element was never written?)"
    norm = e.norm()
    assert norm > 0, "reference is all zeros: the comparison would prove nothing"
    return float((a - e).norm() / norm)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4, what: str = "output") -> None:
    err = rel_l2(actual, expected)
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.0e}"


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fails the test (instead of hanging CI) if the block runs longer than ``seconds``."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s (hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class StageRecorder:
    """A pipeline hook collecting ``{stage name: IR}`` in call order."""

    def __init__(self):
        self.stages: dict[str, object] = {}
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, ir, seconds: float) -> None:
        self.stages[name] = ir
        self.seconds[name] = seconds

    def render(self, name: str) -> str:
        return self.stages[name].render()
