"""GPU tests run only where CUDA exists; elsewhere each is skipped with the reason."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine (tests/gpu needs one)")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
