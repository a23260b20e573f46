"""MPK-style passes over the TaskGraph (Mirage Persistent Kernel, arXiv 2512.22219, section 4).

The pipeline (``tilec.pipeline``) runs, in order:
  fuse_events -> normalize -> linearize -> schedule
and runs the stage verifier (``tilec.verify``) after each one when ``Options.verify`` is on.
"""
from .fusion import fuse_events
from .linearize import linearize
from .normalize import normalize
from .schedule import Schedule, schedule

__all__ = ["fuse_events", "normalize", "linearize", "schedule", "Schedule"]
