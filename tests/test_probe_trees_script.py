"""scripts/probe_trees.sh: each plan step runs in its tree with its log under $OUT, a summary
table, and more than 8 files under $OUT (what the device tool brings back) packed into one."""

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "probe_trees.sh"


def _probe(tmp_path, plan_lines):
    root = tmp_path / "repo"
    (root / "graphstep").mkdir(parents=True)
    (root / "kernels").mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '0'\n")
    plan = tmp_path / "plan.txt"
    plan.write_text("\n".join(plan_lines) + "\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "TAIL": "2"}
    # pip is not what is tested: a stand-in that succeeds
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/usr/bin/env bash\nexit 0\n")
    (bin_dir / "python3").chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = subprocess.run(
        ["bash", str(SCRIPT), str(plan)], cwd=root, capture_output=True, text=True, env=env, timeout=60
    )
    return result, out


def test_steps_run_in_their_tree_and_leave_their_logs(tmp_path):
    result, out = _probe(tmp_path, ["# a comment", "main 10 echo hello from $PWD", "gone 10 true"])
    assert result.returncode == 0, result.stderr
    assert "hello from" in (out / "probe_main_1.log").read_text()
    summary = result.stdout.split("=== summary (step tree rc seconds)\n")[1].splitlines()
    assert summary[0].startswith("1 main rc=0 ") and summary[1] == "2 gone rc=missing-tree 0s"
    assert "packed" not in result.stdout


def test_more_than_eight_files_are_packed_into_one(tmp_path):
    steps = [f"main 10 echo step {i}" for i in range(6)] + ["main 10 mkdir -p $OUT/san && touch $OUT/san/a $OUT/san/b"]
    result, out = _probe(tmp_path, steps)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in out.iterdir()] == ["out.tgz"] and "packed into" in result.stdout
    with tarfile.open(out / "out.tgz") as archive:
        names = {Path(n).as_posix().lstrip("./") for n in archive.getnames() if archive.getmember(n).isfile()}
    assert names == {f"probe_main_{i}.log" for i in range(1, 8)} | {"san/a", "san/b"}
