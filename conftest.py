"""Tests marked gpu (tests/ and bench/) skip without an sm_90 CUDA GPU. GRAPHSTEP_TEST_SHARD=i/n
keeps shard i (0-based) of n of the selected tests, cut into contiguous runs so that a
parametrized test's cases (which share compiled kernels) mostly stay in one process:
scripts/pytest_lanes.sh --shards runs the n shards at once."""

import os

import pytest
import torch


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def shard_of(text: str) -> tuple[int, int]:
    """'i/n' as (i, n), 0 <= i < n."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not sep or not 0 <= i < n:
        raise pytest.UsageError(f"GRAPHSTEP_TEST_SHARD={text!r}: expected i/n with 0 <= i < n")
    return i, n


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: shards of what runs
def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("GRAPHSTEP_TEST_SHARD", "").strip()
    if shard:
        i, n = shard_of(shard)
        start, stop = len(items) * i // n, len(items) * (i + 1) // n
        config.hook.pytest_deselected(items=items[:start] + items[stop:])
        items[:] = items[start:stop]
    if _sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
