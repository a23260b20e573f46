"""Test configuration: deterministic seeds, hypothesis profiles, quiet third-party warnings."""
from __future__ import annotations

import os
import random
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


def pytest_configure(config):
    # third-party deprecation noise (transformers, torch.export) from module-scoped fixtures too
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")


torch.set_num_threads(min(2, torch.get_num_threads()))
# builds and plan caches of the test session go to a fresh directory, not ~/.cache/tilec
os.environ.setdefault("TILEC_CACHE_DIR", tempfile.mkdtemp(prefix="tilec-test-cache-"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
    yield
