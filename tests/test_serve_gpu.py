"""`graphstep serve` on the GPU: its JSON document, with and without the value checks."""

import json

import pytest

from graphstep.cli import main
from graphstep.timing import default_trace

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("unchecked", [False, True], ids=["checked", "unchecked"])
def test_serve_reports_every_step_and_the_replay_inside_the_host_wall(capsys, unchecked):
    argv = ["serve", "--batch", "1,2,4", "--steps", "8", "--context", "4096", "--seed", "3", "--json"]
    assert main(argv + (["--unchecked"] if unchecked else [])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["value_checks"] is not unchecked and doc["steps"] == 8
    assert doc["tokens"] == sum(default_trace(4, 8, seed=3))
    device, host = doc["device_us"], doc["host_us"]
    # the replay's events lie inside each step's wall-clock window
    assert 0 < device["p50"] < host["p50"] and 0 < device["mean"] < host["mean"]
    assert doc["tokens_per_s"] == pytest.approx(doc["tokens"] / (host["mean"] * 8 / 1e6))
