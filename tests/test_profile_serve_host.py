"""bench/profile_serve_host.py's wrapper: the profile runs inside the wrapped method only, and
the original method comes back (CPU: the torch backend's step)."""

import cProfile
import pstats
import sys
from pathlib import Path

from graphstep import DecodeStep, RankShape, Topology, preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from profile_serve_host import profiled  # noqa: E402


def _functions(profile: cProfile.Profile) -> set[str]:
    return {name for _, _, name in pstats.Stats(profile).stats}


def test_the_profile_holds_load_and_its_value_checks_and_nothing_outside_it():
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    step = DecodeStep(shape, capture_sizes=[1, 4], backend="torch", device="cpu", max_context=256)
    inputs = step.state.inputs(3, context_lens=200, seed=3)
    original = DecodeStep.load
    profile = cProfile.Profile()
    restore = profiled(DecodeStep, "load", profile)
    try:
        step.state.inputs(1, context_lens=100, seed=1)  # outside load: not profiled
        assert step.load(inputs, None, check_values=True) == 4
    finally:
        restore()
    assert DecodeStep.load is original
    seen = _functions(profile)
    assert {"load", "_check_values", "new_token_slots"} <= seen
    assert "inputs" not in seen  # LayerState.inputs ran outside the wrapped method
    step.load(inputs, None, check_values=True)  # restored: this call adds nothing
    assert _functions(profile) == seen
