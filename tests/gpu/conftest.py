"""GPU tests: marked ``gpu`` and skipped cleanly without CUDA (or without nvcc)."""
import shutil

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU"
    elif shutil.which("nvcc") is None and not __import__("os").environ.get("TILEC_NVCC"):
        reason = "needs nvcc"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
