"""The package's public face: what `from graphstep import ...` gives, its version, its cost,
and docstrings that name every argument and output field."""

import dataclasses
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import graphstep

PUBLIC = ["DecodeStep", "StepInputs", "StepOutputs", "LayerState", "RankShape", "Topology", "preset"]


def test_the_public_names_are_the_definitions():
    from graphstep import shapes, state, step

    homes = {"DecodeStep": step, "RankShape": shapes, "Topology": shapes, "preset": shapes}
    for name in PUBLIC:
        assert getattr(graphstep, name) is getattr(homes.get(name, state), name), name
        assert name in graphstep.__all__ and name in dir(graphstep), name
    with pytest.raises(AttributeError, match="no attribute 'DecodeSteps'"):
        graphstep.DecodeSteps  # noqa: B018


def test_version_is_pyprojects():
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert graphstep.__version__ == pyproject["project"]["version"]


def test_import_is_cheap_and_needs_no_cuda():
    """`import graphstep` loads no torch; the first DecodeStep does, on a machine without CUDA too."""
    code = (
        "import sys, graphstep\n"
        "assert 'torch' not in sys.modules, 'import graphstep loaded torch'\n"
        "from graphstep import DecodeStep, StepOutputs\n"
        "assert 'torch' in sys.modules and 'cutlass' not in sys.modules\n"
        "print(DecodeStep.__module__, StepOutputs.__module__)\n"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["graphstep.step", "graphstep.state"]


def _documented(cls, names):
    doc = inspect.getdoc(cls)
    return [name for name in names if f"{name}:" not in doc]


def test_decode_step_documents_every_argument():
    arguments = [p for p in inspect.signature(graphstep.DecodeStep).parameters]
    assert arguments[0] == "shape" and "transport" in arguments
    assert _documented(graphstep.DecodeStep, arguments) == []


def test_step_outputs_documents_every_field():
    fields = [f.name for f in dataclasses.fields(graphstep.StepOutputs)]
    assert fields == ["q_c", "slots", "q_rows", "out", "lse"]
    assert _documented(graphstep.StepOutputs, fields) == []


def test_step_inputs_documents_every_field():
    fields = [f.name for f in dataclasses.fields(graphstep.StepInputs)]
    assert fields == ["qkv", "context_lens", "slot_mapping", "block_tables"]
    assert _documented(graphstep.StepInputs, fields) == []
