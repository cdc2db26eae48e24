"""bench/profile_serve_host.py's wrapper: the profile runs inside the wrapped method only, not in
calls from inside the excluded method, and the originals come back (CPU: the torch backend's step)."""

import cProfile
import pstats
import sys
from pathlib import Path

from graphstep import DecodeStep, RankShape, Topology, preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from profile_serve_host import profiled  # noqa: E402


def _calls(profile: cProfile.Profile) -> dict[str, int]:
    """Calls of each function name in the profile (a snapshot: pstats stops the profiler)."""
    counts: dict[str, int] = {}
    for (_, _, name), (_, calls, *_) in pstats.Stats(profile).stats.items():
        counts[name] = counts.get(name, 0) + calls
    return counts


def _outside_the_wrapped_method():
    return sum(range(10))


def test_the_profile_holds_the_loops_loads_only():
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    step = DecodeStep(shape, capture_sizes=[1, 4], backend="torch", device="cpu", max_context=256)
    inputs = step.state.inputs(3, context_lens=200, seed=3)
    originals = (DecodeStep.load, DecodeStep.step)
    profile = cProfile.Profile()
    restore = profiled(DecodeStep, "load", profile, not_inside="step")
    try:
        step.step(inputs, eager=True)  # load inside step(): not profiled (serve's warm-up)
        assert step.load(inputs, None, check_values=True) == 4
        assert step.load(inputs, None, check_values=True) == 4
        _outside_the_wrapped_method()  # the profiler is off again after load returns
    finally:
        restore()
    assert (DecodeStep.load, DecodeStep.step) == originals
    step.load(inputs, None, check_values=True)  # restored: not counted
    calls = _calls(profile)
    assert calls["_check_values"] == 2 and calls["_validate"] == 2  # the two loads of the loop, not step()'s
    assert "_outside_the_wrapped_method" not in calls
    assert "run_stages" not in calls  # the eager step's stages ran outside the profile
