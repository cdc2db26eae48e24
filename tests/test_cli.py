import subprocess
import sys
from pathlib import Path

import pytest

from graphstep.cli import main


def test_info(capsys):
    assert main(["info", "--preset", "deepseek-v3.2", "--tp", "8", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "16 / 16 / 16" in out and "index_query" in out and "21.9" in out


def test_info_rejects_bad_topology(capsys):
    assert main(["info", "--tp", "3"]) == 2
    assert "Topology.tp=3" in capsys.readouterr().err


def test_run_on_cpu_says_what_it_did(capsys):
    assert main(["run", "--cpu", "--cpu-batch", "2", "--cpu-context", "300"]) == 0
    out = capsys.readouterr().out
    assert "reference step on the CPU" in out and "need an sm_90 GPU" in out
    assert out.count("\n") >= 5


def test_console_script_installed():
    exe = Path(sys.executable).parent / "graphstep"
    if not exe.exists():
        pytest.skip("graphstep is not installed as a console script here")
    result = subprocess.run([str(exe), "info", "--batch", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "indexer floor" in result.stdout


def test_gpu_commands_say_they_need_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for command in (["serve"], ["bench"], ["tune"], ["graph", "--batch", "4"]):
        with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
            main(command)
