"""Tests marked gpu (tests/ and bench/) skip without an sm_90 CUDA GPU."""

import pytest
import torch


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    if _sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
