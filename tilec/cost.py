"""Cost model: predicted time of a task on one worker, from bytes and flops.

Planning figures measured on an H200 (``shared/DESIGN.md``): ~4.0 TB/s HBM read shared by
132 workers, ~790 TFLOP/s bf16 tensor-core rate, ~0.76 us per dependency hop between CTAs.
A task costs ``max(bytes / per-worker bandwidth, flops / per-worker rate) + overhead``.
"""
from __future__ import annotations

HBM_BYTES_PER_US = 4.0e6  # 4.0 TB/s in bytes per microsecond
FLOPS_PER_US = 790e6  # 790 TFLOP/s in flop per microsecond
SMS = 132
TASK_OVERHEAD_US = 0.3  # descriptor fetch, barriers, signal
HOP_US = 0.76  # one event hop between CTAs (release add -> acquire poll)


def task_time_us(nbytes: int, flops: int) -> float:
    """Predicted microseconds of one task on one worker (an SM's share of bandwidth/compute)."""
    return max(nbytes / (HBM_BYTES_PER_US / SMS), flops / (FLOPS_PER_US / SMS)) + TASK_OVERHEAD_US
