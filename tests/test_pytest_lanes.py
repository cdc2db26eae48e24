"""scripts/pytest_lanes.sh: every lane runs at once, each lane's summary and status reported."""

import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pytest_lanes.sh"

PASSING = "def test_one():\n    assert 1 + 1 == 2\n\n\ndef test_two():\n    assert 'ab'.upper() == 'AB'\n"
FAILING = "def test_kept():\n    assert True\n\n\ndef test_broken():\n    assert 2 + 2 == 5\n"
SLOW = "import time\n\n\ndef test_slow():\n    time.sleep({seconds})\n"


def _lanes(tmp_path, *lanes):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    return subprocess.run(
        ["bash", str(SCRIPT), *lanes], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )


def test_each_lane_reports_its_summary_and_the_first_failure_sets_the_status(tmp_path):
    (tmp_path / "test_pass.py").write_text(PASSING)
    (tmp_path / "test_fail.py").write_text(FAILING)
    result = _lanes(tmp_path, "test_pass.py", "test_fail.py -x")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("lane 1 rc=0: ") and "2 passed" in line for line in lines), lines
    assert any(line.startswith("lane 2 rc=1: FAILED test_fail.py::test_broken") for line in lines), lines
    assert any(line.startswith("lane 2 rc=1: ") and "1 failed, 1 passed" in line for line in lines), lines
    assert "2 passed" in (tmp_path / "out" / "lane_1.log").read_text()


def test_lanes_run_at_the_same_time(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / f"test_slow_{name}.py").write_text(SLOW.format(seconds=4))
    start = time.monotonic()
    result = _lanes(tmp_path, "test_slow_a.py", "test_slow_b.py", "test_slow_c.py")
    took = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert sum("1 passed" in line for line in result.stdout.splitlines()) == 3
    assert 4 <= took < 10, took  # in series: over 12 s (pytest's own start is about a second)


def test_no_lane_is_a_usage_error(tmp_path):
    result = _lanes(tmp_path)
    assert result.returncode == 2 and "usage" in result.stderr
