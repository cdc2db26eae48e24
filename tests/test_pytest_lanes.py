"""scripts/pytest_lanes.sh: every lane runs at once, each lane's summary and status reported."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pytest_lanes.sh"

PASSING = "def test_one():\n    assert 1 + 1 == 2\n\n\ndef test_two():\n    assert 'ab'.upper() == 'AB'\n"
FAILING = "def test_kept():\n    assert True\n\n\ndef test_broken():\n    assert 2 + 2 == 5\n"
SLOW = "import time\n\n\ndef test_slow():\n    time.sleep({seconds})\n"
SEVEN = "import pytest\n\n\n@pytest.mark.parametrize('i', range(7))\ndef test_case(i):\n    print('ran', i)\n"
ROOT = Path(__file__).resolve().parent.parent


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


def test_a_lane_keeps_its_quoted_words(tmp_path):
    (tmp_path / "test_pass.py").write_text(PASSING)
    result = _lanes(tmp_path, "test_pass.py -k 'one or two'", "test_pass.py -k 'not two'")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lane 1 rc=0: 2 passed" in result.stdout and "lane 2 rc=0: 1 passed, 1 deselected" in result.stdout


def test_shards_cut_one_selection_into_contiguous_lanes_that_cover_it_once(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())  # the project's shard hook
    (tmp_path / "test_seven.py").write_text(SEVEN)
    result = _lanes(tmp_path, "--shards", "3", "test_seven.py -s -k 'not case[0] and not case[1]'")
    assert result.returncode == 0, result.stdout + result.stderr
    logs = [(tmp_path / "out" / f"lane_{n}.log").read_text() for n in (1, 2, 3)]
    ran = [[int(m) for m in re.findall(r"ran (\d+)", log)] for log in logs]
    assert ran == [[2], [3, 4], [5, 6]], ran  # cut after -k: 5 selected, at 5 // 3 = 1 and 10 // 3 = 3
    assert "lane 1 rc=0: 1 passed, 6 deselected" in result.stdout


def test_bad_arguments_are_usage_errors(tmp_path):
    for args in ((), ("--shards", "0", "tests"), ("--shards", "2"), ("--shards", "x", "tests")):
        result = _lanes(tmp_path, *args)
        assert result.returncode == 2 and "usage" in result.stderr, args


def test_a_bad_shard_is_refused(tmp_path):
    env = {**os.environ, "GRAPHSTEP_TEST_SHARD": "3/3"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_floor.py"]
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode != 0 and "expected i/n with 0 <= i < n" in result.stdout + result.stderr


def test_the_project_shards_cover_its_tests_once(tmp_path):
    def collect(shard):
        env = {**os.environ, "GRAPHSTEP_TEST_SHARD": shard}
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_floor.py"]
        result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return [line for line in result.stdout.splitlines() if "::" in line]

    whole = collect("")
    parts = [collect(f"{i}/4") for i in range(4)]
    assert len(whole) >= 4 and sum(parts, []) == whole
