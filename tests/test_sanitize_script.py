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


def test_a_failing_run_names_its_code_sites(tmp_path):
    """Under each failing run the table is followed by where its reports point: kernel (its DSL
    name shortened) + offset, and the source line where the kernels carry line info."""
    site = "kernel_cutlass_sparse_core_partial_graphstepkernelssparse_coreSparseCore_object_at__x_0"
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(
        f"""#!/usr/bin/env bash
echo "$*" >> "$0.log"
echo "LINEINFO=$CUTE_DSL_LINEINFO" >> "$0.log"
if [[ "$2" == synccheck && "$*" == *tp1-fp8* ]]; then
  for i in 1 2 3; do
    echo "========= Barrier error detected. Divergent thread(s) in block"
    echo "=========     at {site}+0xd90 in /somewhere/kernels/sparse_core_wgmma.py:523"
  done
  echo "=========     at {site}+0x39f0"
  echo "========= ERROR SUMMARY: 4 errors"; exit 97
fi
echo "========= ERROR SUMMARY: 0 errors"
"""
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": sys.executable, "COMPUTE_SANITIZER": str(fake), "SANITIZE_LOGS": str(tmp_path / "l")}
    env.pop("CUTE_DSL_LINEINFO", None)
    args = ["bash", str(SCRIPT), "--cases", "tp8,tp1-fp8", "--tools", "memcheck,synccheck"]
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    where = result.stdout.split("tp1-fp8 synccheck: where")[1].splitlines()[1:3]
    assert where[0].split() == ["3", "sparse_core_partial+0xd90", "kernels/sparse_core_wgmma.py:523"]
    assert where[1].split() == ["1", "sparse_core_partial+0x39f0"]
    assert "tp8 memcheck: where" not in result.stdout  # clean runs list nothing
    assert set(line for line in fake.with_suffix(".log").read_text().splitlines() if "LINEINFO" in line) == {
        "LINEINFO=1"
    }


KERNEL = "kernel_cutlass_top_k_cluster_graphstepkernelstop_kClusterTopK_object_at__x_0"
# the known pair's two lines as scripts/sanitize_known.txt lists them (ClusterTopK's read, then its write), so the
# fake reports follow the list when the source moves (test_known_sites_are_still_in_their_functions checks the list)
READ, WRITE = (
    int(site.split("@")[0].split(":")[1])
    for site in next(
        line.split()[2:4]
        for line in (SCRIPT.parent / "sanitize_known.txt").read_text().splitlines()
        if line.startswith("racecheck top_k_cluster ")
    )
)
RACE = f"""#!/usr/bin/env bash
echo "$*" >> "$0.log"
if [[ "$2" == racecheck ]]; then
  for i in $(seq PRINTED); do
    echo "========= Error: Race reported between Read access at {KERNEL}+0xcc0 in /x/kernels/top_k.py:{READ}"
    echo "=========     and Write access at {KERNEL}+0x1d80 in /x/kernels/top_k.py:{WRITE} [3512 hazards]"
    echo "=========     and Write access at {KERNEL}+0x1e60 in /x/kernels/top_k.py:{WRITE} [3688 hazards]"
  done
  EXTRA
  DONE
  echo "========= RACECHECK SUMMARY: 12 hazards displayed (12 errors, 0 warnings)"; exit 97
fi
echo "========= ERROR SUMMARY: 0 errors"
"""


def _race(tmp_path, extra: str, *args, done: bool = True, printed: int = 12):
    """A racecheck run of tp8 reporting 12 hazards, `printed` of them (each the known pair) and
    `extra`; its case finished or not. -> (the result, the table's tp8 row)."""
    fake = tmp_path / "compute-sanitizer"
    last = 'echo "sanitize_case tp8: done in 1.0 s"' if done else 'echo "Traceback (most recent call last): ..."'
    fake.write_text(RACE.replace("EXTRA", extra).replace("DONE", last).replace("PRINTED", str(printed)))
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": sys.executable, "COMPUTE_SANITIZER": str(fake), "SANITIZE_LOGS": str(tmp_path / "l")}
    command = ["bash", str(SCRIPT), "--cases", "tp8", "--tools", "synccheck,racecheck", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    return result, result.stdout.split("\ncase")[1].splitlines()[1].split()


def test_known_racecheck_reports_are_shown_and_do_not_fail(tmp_path):
    """A racecheck run whose every hazard pair scripts/sanitize_known.txt lists shows as N(known),
    the sweep passes and prints why; --strict fails it."""
    result, row = _race(tmp_path, "")
    assert result.returncode == 0, result.stdout + result.stderr
    assert row == ["tp8", "0", "12(known)"]
    assert "ClusterTopK: round 0's histogram" in result.stdout and "every run clean" in result.stdout
    assert "tp8 racecheck: where" in result.stdout  # the sites are still listed
    result, row = _race(tmp_path, "", "--strict")
    assert result.returncode == 1 and row == ["tp8", "0", "12"] and "FAILED" in result.stderr


def test_an_unlisted_hazard_pair_fails_the_run(tmp_path):
    """One hazard pair the file does not list (here: the known read against another write, and
    a pair without line info) makes the run fail as any error would."""
    for extra, unlisted in (
        (
            f'echo "=========     and Write access at {KERNEL}+0x2000 in /x/kernels/top_k.py:{READ + 1} [4 hazards]"',
            f"top_k_cluster top_k.py:{READ} top_k.py:{READ + 1}",
        ),
        (
            f'echo "========= Error: Race reported between Write access at {KERNEL}+0x10 '
            f'and Read access at {KERNEL}+0x20"',
            "top_k_cluster ? ?",
        ),
    ):
        result, row = _race(tmp_path, extra, printed=11 if "Race reported" in extra else 12)
        assert result.returncode == 1 and row == ["tp8", "0", "12"], (extra, result.stdout)
        # under the run, every pair, the known one marked, however few reports the others have
        pairs = result.stdout.split("tp8 racecheck: every hazard pair (kernel, first site, second site):\n")[1]
        assert sorted(pairs.splitlines()[:2]) == sorted(
            [f"  {unlisted}", f"  top_k_cluster top_k.py:{READ} top_k.py:{WRITE} (known)"]
        ), pairs


def test_known_reports_with_some_unprinted_fail(tmp_path):
    """A report the tool counted but did not print (its print limit) could be any pair: the run
    is not shown as known."""
    result, row = _race(tmp_path, "", printed=10)
    assert result.returncode == 1 and row == ["tp8", "0", "12"], result.stdout


def test_known_reports_of_a_case_that_did_not_finish_fail(tmp_path):
    """The tool's exit code (97) hides the case's own, so a known-only run passes only if the
    case printed its last line."""
    result, row = _race(tmp_path, "", done=False)
    assert result.returncode == 1 and row == ["tp8", "0", "12(known),unfinished"], result.stdout


def test_known_sites_are_still_in_their_functions():
    """Each site of scripts/sanitize_known.txt (kernels/FILE:LINE@FUNCTION) is still the line of
    that function's inline_ptx call (the line the tool reports for the instruction): an edit that
    moves it makes this fail, before a sweep stops matching or matches another line."""
    import ast

    root = SCRIPT.parent.parent
    entries = [
        line.split("|")[0].split()
        for line in (SCRIPT.parent / "sanitize_known.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert entries
    for tool, kernel, *sites in entries:
        assert tool == "racecheck" and kernel and len(sites) == 2, (tool, kernel, sites)
        for site in sites:
            place, function = site.split("@")
            name, line = place.split(":")
            source = (root / "kernels" / name).read_text()
            (found,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function]
            assert found.lineno < int(line) <= found.end_lineno, (site, found.lineno, found.end_lineno)
            assert "inline_ptx(" in source.splitlines()[int(line) - 1], site
