"""The benchmarks' shared flags (bench/bench_kernels.py parse_args): --knob sets a kernel
module's constant for the run, as graphstep's --knob does, and rejects what graphstep's would."""

import argparse
import sys
from pathlib import Path

import pytest
from graphstep.kernels import sparse_core

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_kernels import parse_args  # noqa: E402


def test_a_bench_knob_sets_the_kernel_constant(monkeypatch, capsys):
    monkeypatch.setattr(sparse_core, "COMBINE_WARP_SPLITS", sparse_core.COMBINE_WARP_SPLITS)  # restored after
    args = parse_args(argparse.ArgumentParser(), ["--knob", "sparse_core.COMBINE_WARP_SPLITS=2", "--json", "x"])
    assert sparse_core.COMBINE_WARP_SPLITS == 2 and args.json == "x"
    assert "knobs: sparse_core.COMBINE_WARP_SPLITS=2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "knob, said",
    [
        ("sparse_core.NOT_A_KNOB=1", "is not a knob"),
        ("sparse_core.COMBINE_WARP_SPLITS='4'", "takes an int"),
        ("no_such_kernel.X=1", "no kernel"),
    ],
)
def test_a_bad_bench_knob_is_a_usage_error_and_sets_no_knob(monkeypatch, capsys, knob, said):
    """A good knob before the bad one is not applied either: every knob is checked first."""
    before = sparse_core.COMBINE_WARP_SPLITS
    monkeypatch.setattr(sparse_core, "COMBINE_WARP_SPLITS", before)
    good = f"sparse_core.COMBINE_WARP_SPLITS={before + 1}"
    with pytest.raises(SystemExit) as exit_:
        parse_args(argparse.ArgumentParser(), ["--knob", good, "--knob", knob])
    assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert sparse_core.COMBINE_WARP_SPLITS == before
