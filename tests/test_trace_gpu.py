"""`graphstep trace` on the GPU: one trace event per graph kernel per replay, each named by its stage."""

import re
import subprocess
import sys
from collections import Counter

import pytest

from graphstep.graphs import inspect
from graphstep.kernel_trace import gpu_events, kernel_label, record, split_replays, stage_of, summarize
from graphstep.shapes import RankShape, Topology, preset
from graphstep.step import DecodeStep
from graphstep.timing import load_batch

pytestmark = pytest.mark.gpu
REPLAYS = 5


@pytest.mark.parametrize("mode", ["fork", "serial"])
def test_one_event_per_kernel_per_replay(tmp_path, mode):
    step = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8)), capture_sizes=[2], policy=mode, max_context=4096
    )
    step.capture(keep_graph=True)
    load_batch(step, 2, 4096)
    graph = step.graph(2)
    nodes = inspect(graph).nodes
    kinds = Counter(node.kind for node in nodes)
    cute = Counter(node.name for node in nodes if node.name.startswith("kernel_cutlass_"))
    trace = record(graph, REPLAYS, tmp_path / "trace.json")
    replays, _ = split_replays(gpu_events(trace))
    assert len(replays) in (REPLAYS, REPLAYS + 1)  # record adds one (its first may come back incomplete)
    for replay in replays:  # torch's kernels show demangled in the trace: count them, compare the CuTe names
        events = Counter(e.kind for e in replay)
        assert (events["kernel"], events["memcpy"], events["memset"]) == (
            kinds["kernel"],
            kinds["memcpy"],
            kinds["memset"],
        )
        assert Counter(e.name for e in replay if e.name.startswith("kernel_cutlass_")) == cute
    summary = summarize(trace)
    stages = {row.stage for row in summary.rows if row.kind == "kernel"}
    opening = {"fork": "IndexKey+QueryNorm", "serial": "IndexKey"}[mode]  # fork: one launch of both
    assert {opening, "QueryNorm", "MlaQuery", "IndexQuery", "DsaIndex", "TopK", "SparseCore"} <= stages
    assert cute and all(stage_of(name) != "torch" for name in cute), [kernel_label(n) for n in cute]


def test_trace_command_prints_its_table(tmp_path):
    """In its own process, as a user runs it (a second profiler session in a process that
    already ran one came back without the replays' events on an H100)."""
    out = tmp_path / "trace.json"
    command = ["trace", "--batch", "2", "--context", "4096", "--replays", "3", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from graphstep.cli import main; sys.exit(main(sys.argv[1:]))", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    text = run.stdout
    found = re.search(r"(\d+) replays of", text)
    assert found and int(found[1]) >= 3, text  # (one more is recorded: kernel_trace.record)
    assert out.exists() and "SparseCore" in text and "share" in text
