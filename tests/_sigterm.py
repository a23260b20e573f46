"""A pytest plugin (loaded by ``conftest.py``): a SIGTERM stops the test run.

Tests call tilec's CLI in the pytest process (click's ``CliRunner``); the CLI installs its own SIGTERM handler
over the default action for the command's length, which turns a SIGTERM into that one command's exit 143 - so a
``timeout`` or a CI runner's SIGTERM landing in such a command stopped nothing: the run went on to its end, with
that test failing (a fresh user's finding). This handler, installed first, makes pytest stop after the test it
interrupts (and the CLI then leaves SIGTERM alone: it never replaces a handler the caller installed)."""
from __future__ import annotations

import signal
import threading


def pytest_sessionstart(session):
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def terminated(signum, frame):
        session.shouldstop = "SIGTERM"  # (a CLI command under test turns the KeyboardInterrupt into its exit 130)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
