"""The CPU-side parts of the timing commands: traces and percentiles, and the nsys
script's message when Nsight Systems is missing."""

import os
import subprocess
from pathlib import Path

import pytest

from graphstep.timing import alone_line, default_trace, percentile, read_trace, serve_summary

ROOT = Path(__file__).resolve().parent.parent


def test_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 51.0 and percentile(values, 99) == 99.0 and percentile(values, 0) == 1.0


def test_default_trace_drifts_within_the_captured_sizes():
    trace = default_trace(16, 500, seed=3)
    assert len(trace) == 500 and min(trace) >= 1 and max(trace) <= 16
    assert len(set(trace)) > 5 and trace == default_trace(16, 500, seed=3)


def test_read_trace(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("1, 4\n16 2\n")
    assert read_trace(str(good)) == [1, 4, 16, 2]
    for text, message in (("1, x", "batch sizes separated"), ("", "at least one"), ("3 0", "at least one positive")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_trace(str(bad))


def test_nsys_script_says_when_nsys_is_missing():
    env = dict(os.environ, PATH="/usr/bin:/bin", NSYS="")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "nsys_capture.sh"), "/tmp/never"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2 and "nsys" in result.stderr and "not found" in result.stderr


def test_bench_line_puts_the_alone_graph_beside_the_default_steps():
    fine = alone_line(1, 60.0, 61.2, [1, 4, 16, 64])
    assert fine == (
        "B = 1 graph, cute fork: 60.0 us in a step that captured only [1], "
        "61.2 us in the step that captured [1, 4, 16, 64] (1.02x)"
    )
    slow = alone_line(1, 60.0, 311.0, [1, 4, 16, 64])  # issue 10's DCP 2 numbers
    assert "(5.18x)" in slow and "SLOWER" in slow and "issue 10" in slow
    assert "SLOWER" not in alone_line(4, 80.0, 90.0, [4, 64])


def test_serve_summary():
    summary = serve_summary([10.0, 20.0, 30.0], [100.0, 200.0, 300.0], tokens=12)
    assert summary["steps"] == 3 and summary["tokens"] == 12
    assert summary["tokens_per_s"] == pytest.approx(12 / 600e-6)
    assert summary["device_us"] == {"p50": 20.0, "p99": 30.0, "mean": 20.0}
    assert summary["host_us"]["mean"] == pytest.approx(200.0)
