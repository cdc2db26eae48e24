"""A kernel whose mbarrier never completes fails its launch instead of hanging (the bounded
primitives.mbar_wait, kernels/guards.py). Each case runs tests/stuck_wait.py in a child
process: a trap ends that process's CUDA context, not this one's."""

import os
import re
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
    assert done.returncode != 0 and "launched" in done.stdout and "stored" not in done.stdout, done.stdout
    # the error is the trap's, raised at the sync (after the launch: not a compile or import
    # error of the probe), not a memory fault (CUDA reports a trap as a launch failure)
    assert re.search(r"unspecified launch failure|illegal instruction", done.stderr), done.stderr[-2000:]
    assert "illegal memory access" not in done.stderr and "misaligned" not in done.stderr, done.stderr[-2000:]
    assert seconds < 120, seconds  # compile (tens of s) + at most 4.3 s of spin
