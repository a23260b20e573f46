"""Test configuration: deterministic seeds, hypothesis profiles, quiet third-party warnings."""
from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" (default) keeps the suite fast; HYPOTHESIS_PROFILE=thorough runs many more examples.
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", deadline=None, max_examples=500, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

pytest_plugins = ["_sigterm"]  # a SIGTERM stops the run, also inside an in-process CLI command


def pytest_configure(config):
    # third-party deprecation noise (transformers, torch.export) from module-scoped fixtures too
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")


torch.set_num_threads(min(2, torch.get_num_threads()))
# builds and plan caches of the test session go to a fresh directory, not ~/.cache/tilec,
# removed when the session ends
if "TILEC_CACHE_DIR" not in os.environ:
    os.environ["TILEC_CACHE_DIR"] = _session_cache = tempfile.mkdtemp(prefix="tilec-test-cache-")
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_fallback_log(monkeypatch):
    """The backend logs each group of eagerly run nodes once per process; each test starts afresh."""
    from tilec import backend

    monkeypatch.setattr(backend, "_LOGGED_GROUPS", set())
