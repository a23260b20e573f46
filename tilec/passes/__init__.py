"""Compiler passes. ``split_kv`` (split-KV / flash-decoding attention) and ``fuse_gemv_chains``
(RMSNorm / SiLU-mul / residual-add fusion into GEMVs) rewrite the OpGraph;
the rest are MPK-style passes over the TaskGraph (Mirage Persistent Kernel, arXiv 2512.22219,
section 4).

The pipeline (``tilec.pipeline``) runs, in order:
  split_kv -> fuse_gemv_chains -> (build_taskgraph) -> fuse_events -> normalize -> linearize -> schedule
and runs the stage verifier (``tilec.verify``) after each one when ``Options.verify`` is on.
"""
from .fuse_gemv import fuse_gemv_chains
from .fusion import fuse_events
from .linearize import linearize
from .normalize import normalize
from .schedule import Schedule, schedule
from .split_kv import split_kv

__all__ = ["split_kv", "fuse_gemv_chains", "fuse_events", "normalize", "linearize", "schedule", "Schedule"]
