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

PUBLIC = ["DecodeStep", "StepInputs", "StepOutputs", "LayerState", "InputRangeError", "RankShape", "Topology", "preset"]


def test_the_public_names_are_the_definitions():
    from graphstep import launch, shapes, state, step

    homes = {
        "DecodeStep": step,
        "InputRangeError": launch,
        "RankShape": shapes,
        "Topology": shapes,
        "preset": shapes,
    }
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


LAUNCHERS = [
    "query_norm",
    "mla_query",
    "query_wait",
    "index_key",
    "index_query",
    "dsa_index",
    "top_k",
    "candidate_sync",
    "dcp_merge",
    "sparse_core",
]


def test_every_kernel_launcher_documents_every_argument():
    """Kernels' launchers state each argument (its shape, dtype and layout) in the docstring,
    as `name:` or in a `name, other:` group."""
    import re

    from graphstep.launch import Kernels

    missing = {}
    for name in LAUNCHERS:
        launcher = getattr(Kernels, name)
        doc = inspect.getdoc(launcher) or ""
        arguments = [p for p in inspect.signature(launcher).parameters if p != "self"]
        undocumented = [a for a in arguments if not re.search(rf"\b{a}[:,]", doc)]
        if undocumented:
            missing[name] = undocumented
    assert missing == {}


def test_every_public_definition_of_the_package_has_a_docstring():
    """Every public class, function and method defined in graphstep/ says what it is for
    (a method overriding a documented one inherits its docstring)."""
    import importlib
    import pkgutil

    bare = []
    for info in pkgutil.iter_modules(graphstep.__path__):
        if info.name == "kernels":
            continue
        module = importlib.import_module(f"graphstep.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            if not inspect.getdoc(value):
                bare.append(f"{module.__name__}.{name}")
            if inspect.isclass(value):
                for attr, member in vars(value).items():
                    if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                        continue
                    if not inspect.getdoc(getattr(value, attr)):
                        bare.append(f"{module.__name__}.{name}.{attr}")
    assert bare == []
