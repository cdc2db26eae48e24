"""scripts/sanitize.sh's table, summary parsing and exit status, with a stand-in compute-sanitizer."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sanitize.sh"

FAKE = """#!/usr/bin/env bash
echo "$*" >> "$0.log"
case "$2" in
  racecheck) echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" ;;
  initcheck) [[ "$*" == *dcp2* ]] && { echo "========= ERROR SUMMARY: 3 errors"; exit 97; } ;&
  *) echo "========= ERROR SUMMARY: 0 errors" ;;
esac
"""


def _sanitize(tmp_path, *args):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "COMPUTE_SANITIZER": str(fake),
        "SANITIZE_LOGS": str(tmp_path / "logs"),
    }
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)
    calls = (tmp_path / "compute-sanitizer.log").read_text().splitlines() if result.returncode != 2 else []
    return result, calls


def test_quick_is_tp8_and_its_out_of_range_inputs_under_every_tool(tmp_path):
    result, calls = _sanitize(tmp_path, "--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    tools = ["initcheck", "memcheck", "racecheck", "synccheck"]
    for case in ("tp8", "tp8-range"):
        mine = [call for call in calls if call.endswith(f"scripts/sanitize_case.py {case}")]
        assert sorted(call.split()[1] for call in mine) == tools, case
    assert len(calls) == 8
    assert any("--report-api-errors no" in call for call in calls if call.split()[1] == "memcheck")
    table = result.stdout.split("\ncase")[1].splitlines()
    assert table[1].split() == ["tp8", "0", "0", "0", "0"] and "every run clean" in result.stdout
    assert table[2].split() == ["tp8-range", "0", "0", "0", "0"]


def test_errors_fail_the_run_and_show_in_the_table(tmp_path):
    result, _ = _sanitize(tmp_path, "--cases", "tp8,dcp2", "--tools", "memcheck,initcheck")
    assert result.returncode == 1 and "FAILED" in result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.split("\ncase")[1].splitlines()[1:3]}
    assert rows == {"tp8": ["0", "0"], "dcp2": ["0", "3"]}
    assert "dcp2 initcheck: ERROR SUMMARY: 3 errors" in result.stdout


def test_unknown_cases_are_refused_before_any_run(tmp_path):
    result, _ = _sanitize(tmp_path, "--cases", "tp9")
    assert result.returncode == 2 and "unknown case tp9" in result.stderr
