"""The CPU-side parts of the timing commands: traces, percentiles and the serve summary, and
the nsys script's lookup, flags and messages (with a stand-in nsys)."""

import os
import subprocess
from pathlib import Path

import pytest

from graphstep.timing import (
    L2_BYTES,
    alone_line,
    default_trace,
    l2_flush_bytes,
    l2_flusher,
    percentile,
    read_trace,
    serve_summary,
)

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


NSYS_SCRIPT = ROOT / "scripts" / "nsys_capture.sh"


def _nsys_script(args, tmp_path, path="/usr/bin:/bin", **env):
    env = {**os.environ, "PATH": path, "NSYS": "", "NSIGHT_COMPUTE_ROOT": str(tmp_path / "no-nsight"), **env}
    return subprocess.run(["bash", str(NSYS_SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def _fake_nsys(path: Path) -> Path:
    """An nsys that logs its arguments; `profile -o R` writes R.nsys-rep, `stats` prints a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{path}.log"\n'
        'if [[ "$1" == profile ]]; then while [[ "$1" != -o ]]; do shift; done; touch "$2.nsys-rep"; fi\n'
        'if [[ "$1" == stats ]]; then echo " Time (%)  Total Time (ns)  Instances  Name"; fi\n'
    )
    path.chmod(0o755)
    return path


def test_nsys_script_says_when_nsys_is_missing(tmp_path):
    result = _nsys_script(["/tmp/never"], tmp_path)
    assert result.returncode == 2 and "not found" in result.stderr and "NSYS=/path/to/nsys" in result.stderr
    result = _nsys_script(["/tmp/never"], tmp_path, NSYS=str(tmp_path / "missing"))
    assert result.returncode == 2 and "is not an executable file" in result.stderr


def test_nsys_script_finds_nsys_in_nsys_then_path_then_nsight_compute(tmp_path):
    root = tmp_path / "nsight-compute"
    older = _fake_nsys(root / "2025.1.0" / "host" / "target-linux-x64" / "nsys")
    newer = _fake_nsys(root / "2025.3.1" / "host" / "target-linux-x64" / "nsys")
    on_path = _fake_nsys(tmp_path / "bin" / "nsys")
    found = _nsys_script(["--which"], tmp_path, NSIGHT_COMPUTE_ROOT=str(root))
    assert found.returncode == 0 and found.stdout.strip() == str(newer) != str(older)
    path = f"{on_path.parent}:/usr/bin:/bin"
    assert _nsys_script(["--which"], tmp_path, path, NSIGHT_COMPUTE_ROOT=str(root)).stdout.strip() == str(on_path)
    chosen = _nsys_script(["--which"], tmp_path, path, NSYS=str(older)).stdout.strip()
    assert chosen == str(older)


def test_nsys_script_flags_and_summaries(tmp_path):
    nsys = _fake_nsys(tmp_path / "nsys")
    report = tmp_path / "steps"
    result = _nsys_script([str(report), "--", "--batch", "2"], tmp_path, NSYS=str(nsys))
    assert result.returncode == 0, result.stderr
    version, profile, *stats = Path(f"{nsys}.log").read_text().splitlines()
    for flag in (
        "--trace=cuda,nvtx",
        "--sample=none",
        "--cpuctxsw=none",
        "--backtrace=none",
        "--cuda-graph-trace=node",
        "--capture-range=cudaProfilerApi",
        "scripts/nsys_steps.py --batch 2",
    ):
        assert flag in profile
    assert version == "--version" and [line.split()[2] for line in stats] == ["cuda_gpu_kern_sum", "nvtx_sum"]
    assert "report written to" in result.stdout and "Time (%)" in result.stdout


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


def test_nsys_steps_wraps_every_launcher_of_the_cute_stages():
    """nsys_steps.py's eager stage ranges wrap the launchers of step.stages.kernels (the
    step keeps its Kernels in its CuteStages); every stage name must still be a launcher."""
    import importlib.util

    from graphstep import RankShape, Topology, preset
    from graphstep.stages import CuteStages
    from graphstep.step import DecodeStep

    spec = importlib.util.spec_from_file_location("nsys_steps", ROOT / "scripts" / "nsys_steps.py")
    nsys_steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nsys_steps)
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    step = DecodeStep(shape, capture_sizes=[2], backend="torch", device="cpu", max_context=256)
    stages = CuteStages(step.state, step.buffers, step.error, step.budget_ns)
    assert nsys_steps.stage_ranges(stages.kernels) == list(nsys_steps.STAGE_LAUNCHERS.values())


def test_the_cold_l2_flush_reads_twice_the_l2():
    """bench's cold-L2 column evicts the L2 before each replay by reading twice its size (the
    benches' 60 MB bound on an H100 / H200's where torch does not say)."""
    assert l2_flush_bytes(60 << 20) == 120 << 20
    assert l2_flush_bytes(None) == l2_flush_bytes(0) == 2 * L2_BYTES == 120_000_000
    flush = l2_flusher("cpu", 1 << 12)  # the same ops as on the GPU
    flush()


def test_read_trace_names_the_path_of_a_file_it_cannot_read(tmp_path):
    """A missing file, a folder, a binary file, no path: a ValueError naming the path (before:
    a raw OSError or UnicodeDecodeError, and '' read the current folder)."""
    binary = tmp_path / "binary"
    binary.write_bytes(b"\x7fELF\xd0\xff\x00\x01")
    for path, message in (
        (str(tmp_path / "missing"), "missing: cannot read it \\(No such file or directory\\)"),
        (str(tmp_path), "cannot read it \\(Is a directory\\)"),
        (str(binary), "binary: not a text file"),
        ("", "'': expected the path of a file of batch sizes"),
    ):
        with pytest.raises(ValueError, match=message):
            read_trace(path)
