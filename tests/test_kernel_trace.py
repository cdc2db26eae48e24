import json
import math
from pathlib import Path

import pytest

from graphstep.kernel_trace import describe, gpu_events, kernel_label, split_replays, stage_of, summarize

TRACE = Path(__file__).parent / "data" / "trace_fork.json"  # 3 fork-mode replays, as torch.profiler writes them


@pytest.fixture
def trace():
    return json.loads(TRACE.read_text())


def test_stages_from_kernel_names():
    mangled = "kernel_cutlass_{}_graphstepkernels{}_object_at__ptrf32gmemalign16_0"
    assert stage_of(mangled.format("top_k_cluster", "top_kClusterTopK")) == "TopK"
    assert stage_of(mangled.format("kernel", "top_kTopK")) == "TopK"  # before the renames: by module
    assert stage_of(mangled.format("row_kernel", "query_normQueryNorm")) == "QueryNorm"
    assert stage_of(mangled.format("project", "mla_queryMlaQuery")) == "MlaQuery"
    assert stage_of(mangled.format("index_query", "index_queryIndexQuery")) == "IndexQuery"
    assert stage_of(mangled.format("kernel", "index_keyIndexKey")) == "IndexKey"
    assert stage_of(mangled.format("sparse_core_combine", "sparse_coreSparseCore")) == "SparseCore"
    assert stage_of("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>") == "torch"
    assert kernel_label(mangled.format("kernel", "top_kClusterTopK")) == "ClusterTopK.kernel"
    assert kernel_label(mangled.format("mla_query_project", "mla_queryMlaQuery")) == "MlaQuery.mla_query_project"
    assert kernel_label("x" * 60) == "x" * 45 + "..."


def test_gpu_events_are_kernels_copies_and_memsets(trace):
    events = gpu_events(trace)
    assert len(events) == 3 * 13 + 3  # 13 per replay, and torch's replay prologue fill once per replay
    assert {e.kind for e in events} == {"kernel", "memcpy", "memset"}
    assert [e.start for e in events] == sorted(e.start for e in events)
    with pytest.raises(ValueError, match="traceEvents"):
        gpu_events({"events": []})


def test_replays_are_the_graph_launches(trace):
    replays, other = split_replays(gpu_events(trace))
    assert [len(r) for r in replays] == [13, 13, 13] and other == 3
    assert [{e.launch for e in r} for r in replays] == [{100}, {101}, {102}]
    lone = [e for e in gpu_events(trace) if e.launch in (50, 51, 52)]
    with pytest.raises(ValueError, match="no graph replay"):
        split_replays(lone)


def test_summary_per_kernel(trace):
    summary = summarize(trace)
    assert (summary.replays, summary.events_per_replay, summary.other_events) == (3, 13, 3)
    assert summary.span_us == pytest.approx(75.0)
    assert summary.busy_us == pytest.approx(109.7)  # 62.3 main + 47.4 side (QueryWait 1.0, 1.2, 1.4)
    assert summary.idle_us == pytest.approx(6.3)  # 0.5 + 0.5 + 3.3 + 0.5 + 1.0 + 0.5: nothing running
    rows = {r.kernel: r for r in summary.rows}
    assert [r.stage for r in summary.rows] == [
        "memcpy",
        "IndexKey",
        "QueryNorm",
        "MlaQuery",
        "IndexQuery",
        "DsaIndex",
        "MlaQuery",
        "TopK",
        "QueryWait",
        "SparseCore",
        "SparseCore",
        "torch",
        "memset",
    ]  # in start order
    wait = rows["QueryWait.query_wait"]
    assert (wait.calls, wait.per_replay) == (3, 1.0)
    assert wait.mean_us == pytest.approx(1.2) and wait.total_us == pytest.approx(3.6)
    assert wait.share == pytest.approx(3.6 / 225.0)
    # gaps on the event's own stream: PDL overlap negative, the join's wait positive, first on a stream none
    assert rows["QueryNorm.query_norm_rows"].gap_us == pytest.approx(-0.5)
    assert rows["SparseCore.sparse_core_partial"].gap_us == pytest.approx(10.0)
    assert rows["MlaQuery.mla_query_absorb"].gap_us == pytest.approx(-0.2)
    assert math.isnan(rows["MlaQuery.mla_query_project"].gap_us)
    assert math.isnan(summary.rows[0].gap_us)


def test_table_and_json(trace):
    summary = summarize(trace)
    text = describe(summary)
    assert "ClusterTopK.kernel" in text and "34.7%" in text
    assert "3 replays of 13 GPU events: span 75.0 us" in text and "3 GPU events outside the replays" in text
    record = json.loads(json.dumps(summary.as_dict(), allow_nan=False))  # strict JSON: no NaN
    assert record["rows"][0]["gap_us"] is None and record["replays"] == 3
