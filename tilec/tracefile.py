"""Reading a trace file back (no torch: the lab's trace readers import only this).

:func:`tilec.trace.write_trace` writes a Chrome / Perfetto trace as JSON; the GPU scripts often
gzip it to carry it. :func:`read_trace` reads either, told apart by the file's first two bytes.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib


def read_trace(path: str | os.PathLike, measured: bool = True) -> dict:
    """The trace in ``path``: JSON as ``tilec.trace.write_trace`` writes it, or gzip-compressed
    JSON (recognized by its first two bytes, whatever the file's name).

    Raises:
        OSError: the file cannot be read (missing, a directory, no permission).
        ValueError: it is empty, not JSON or gzip-compressed JSON (a corrupt or truncated gzip
            stream, bytes that are no UTF-8, JSON nested too deeply to parse), not a trace object
            with ``otherData``, or, with ``measured``, its ``otherData.clock`` is not "measured"
            (a predicted trace, such as an artifact's ``trace.json``).
    """
    with open(os.fspath(path), "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError("empty file")
    try:
        trace = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (EOFError, zlib.error, gzip.BadGzipFile, RecursionError, ValueError) as e:  # (UnicodeDecodeError: a ValueError)
        raise ValueError(f"not JSON or gzip-compressed JSON: {e}") from e
    if not isinstance(trace, dict) or not isinstance(trace.get("otherData"), dict):
        raise ValueError("not a Chrome trace object with otherData")
    clock = trace["otherData"].get("clock")
    if measured and clock != "measured":
        raise ValueError(f"not a measured trace (clock {clock!r}): pass measured=False to read a predicted one")
    return trace
