"""A kernel whose mbarrier never completes fails its launch instead of hanging (the bounded
primitives.mbar_wait, kernels/guards.py). Each case runs tests/stuck_wait.py in a child
process: a trap ends that process's CUDA context, not this one's."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
PROBE = Path(__file__).with_name("stuck_wait.py")
ROOT = PROBE.parent.parent


def _run(mode: str, limit_ns: int) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(PROBE), mode, str(limit_ns)], capture_output=True, text=True, timeout=300, env=env
    )
    return done, time.monotonic() - start


def test_a_wait_that_completes_returns():
    done, _ = _run("arrive", 60_000_000_000)  # (limit 0 could trap a short spin that meets a tick)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stored 7" in done.stdout


def test_a_wait_that_never_completes_traps_within_the_limit():
    """Limit 0: the trap comes once the timer's high word ticks (at most 2**32 ns, 4.3 s)."""
    done, seconds = _run("stuck", 0)
    assert done.returncode != 0 and "stored" not in done.stdout, done.stdout
    # the error is CUDA's, raised at the sync (not a compile or import error of the probe)
    assert "CUDA" in done.stderr or "cuda" in done.stderr, done.stderr[-2000:]
    assert "probe(" not in done.stderr and "Error" in done.stderr, done.stderr[-2000:]
    assert seconds < 120, seconds  # compile (tens of s) + at most 4.3 s of spin
