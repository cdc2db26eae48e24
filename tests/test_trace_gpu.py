"""`graphstep trace` on the GPU: one trace event per graph kernel per replay, each named by its stage."""

import re
from collections import Counter

import pytest

from graphstep.cli import main
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
    assert {"IndexKey", "QueryNorm", "MlaQuery", "IndexQuery", "DsaIndex", "TopK", "SparseCore"} <= stages
    assert cute and all(stage_of(name) != "torch" for name in cute), [kernel_label(n) for n in cute]


def test_trace_command_prints_its_table(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["trace", "--batch", "2", "--context", "4096", "--replays", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    found = re.search(r"(\d+) replays of", text)
    assert found and int(found[1]) >= 3, text  # (one more is recorded: kernel_trace.record)
    assert out.exists() and "SparseCore" in text and "share" in text
