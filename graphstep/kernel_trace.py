"""Kernel timelines of graph replays: `graphstep trace` records them with torch.profiler,
`summarize` turns the Chrome trace JSON it writes into per-kernel rows.

Every kernel a graph replay runs shares the correlation id of its cudaGraphLaunch, so the
trace's GPU events (`cat` "kernel", "gpu_memcpy", "gpu_memset") group into replays by
`args.correlation`; launches outside the graph (torch's replay prologue, say) are counted
and left out. A kernel's gap is its start minus the end of the event before it on its own
stream: positive is launch latency the PDL chain did not hide (or a wait at a join),
negative an overlap (a PDL prologue running under its predecessor's tail). A replay's idle
time is the time no event of it runs on any stream.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from .report import table

# Name fragments -> stage, most specific first: a CuTe DSL kernel is named
# kernel_cutlass_<method>_graphstepkernels<module><Class>_object_at_<arguments>_<n>, so both
# the method (top_k_cluster, sparse_core_partial, ...) and the module (top_k, sparse_core, ...) match.
STAGES = (
    ("key_and_norm", "IndexKey+QueryNorm"),  # one launch of both (kernels/key_and_norm.py)
    ("sparse_core", "SparseCore"),
    ("dcp_merge", "DcpMerge"),
    ("candidate_sync", "CandidateSync"),
    ("query_wait", "QueryWait"),
    ("top_k", "TopK"),
    ("dsa_index", "DsaIndex"),
    ("index_query", "IndexQuery"),
    ("index_key", "IndexKey"),
    ("mla_query", "MlaQuery"),
    ("query_norm", "QueryNorm"),
)
GPU_EVENTS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_CUTE_NAME = re.compile(r"^kernel_cutlass_(?P<method>\w+?)_graphstepkernels[a-z0-9_]*?(?P<cls>[A-Z]\w*?)_object_at_")


def stage_of(name: str) -> str:
    """The step stage a GPU event belongs to ("torch" for torch's own kernels)."""
    for fragment, stage in STAGES:
        if fragment in name:
            return stage
    return "torch"


def kernel_label(name: str, width: int = 48) -> str:
    """A readable kernel name: `Class.method` for CuTe DSL kernels, else the name cut to `width`."""
    match = _CUTE_NAME.match(name)
    if match:
        name = f"{match['cls']}.{match['method']}"
    return name if len(name) <= width else name[: width - 3] + "..."


@dataclass
class GpuEvent:
    """One GPU event of a profiler trace (kernel, memcpy or memset), times in us."""

    name: str
    kind: str  # "kernel", "memcpy" or "memset"
    start: float  # us
    duration: float  # us
    launch: int | None  # the correlation id of the launch (one per graph replay)
    stream: int | None


@dataclass
class KernelRow:
    """One kernel name's events over the replays (times in us)."""

    stage: str  # the step stage; "torch" for torch's kernels, "memcpy" or "memset" for those events
    kernel: str
    kind: str
    calls: int  # events over all replays
    per_replay: float  # calls / replays
    mean_us: float
    total_us: float
    share: float  # total_us / the replays' summed span (rows overlap on two streams: shares may add past 1)
    gap_us: float  # mean gap after the event before it on its stream (nan: always first on its stream)
    offset_us: float  # mean start after the replay's first event (rows are ordered by it)


@dataclass
class TraceSummary:
    """What `graphstep trace` prints: per-kernel rows and the replays' span and idle time."""

    rows: list[KernelRow]
    replays: int
    events_per_replay: int
    span_us: float  # mean first start -> last end of a replay
    busy_us: float  # mean summed event durations of a replay (streams overlap: may exceed the span)
    idle_us: float  # mean time of a replay with no event running
    other_events: int  # GPU events outside the replays (other launches)

    def as_dict(self) -> dict:
        """The summary as plain data (for --json and tests)."""
        return dict(
            replays=self.replays,
            events_per_replay=self.events_per_replay,
            span_us=self.span_us,
            busy_us=self.busy_us,
            idle_us=self.idle_us,
            other_events=self.other_events,
            rows=[{k: None if v != v else v for k, v in vars(row).items()} for row in self.rows],  # nan -> null
        )


def gpu_events(trace: dict) -> list[GpuEvent]:
    """The kernels, copies and memsets of a Chrome trace (torch.profiler's export_chrome_trace)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list")
    events = []
    for event in trace["traceEvents"]:
        kind = GPU_EVENTS.get(str(event.get("cat", "")).lower())
        if kind is None or event.get("ph", "X") != "X":
            continue
        args = event.get("args") or {}
        correlation, stream = args.get("correlation"), args.get("stream", event.get("tid"))
        events.append(
            GpuEvent(
                str(event["name"]),
                kind,
                float(event["ts"]),
                float(event["dur"]),
                None if correlation is None else int(correlation),
                None if stream is None else int(stream),
            )
        )
    return sorted(events, key=lambda e: e.start)


def split_replays(events: list[GpuEvent]) -> tuple[list[list[GpuEvent]], int]:
    """Group events by launch; the replays are the launches of the most common size (2 events
    or more). Returns the replays in time order and the number of events left out."""
    launches: dict[int | None, list[GpuEvent]] = defaultdict(list)
    for event in events:
        launches[event.launch].append(event)
    sizes = Counter(len(group) for launch, group in launches.items() if launch is not None and len(group) > 1)
    if not sizes:
        raise ValueError(
            f"no graph replay in the trace: none of its {len(events)} GPU events share a launch "
            "(args.correlation) with another"
        )
    size = max(sizes, key=lambda n: (sizes[n], n))
    replays = [group for launch, group in launches.items() if launch is not None and len(group) == size]
    replays.sort(key=lambda group: group[0].start)
    return replays, len(events) - size * len(replays)


def summarize(trace: dict) -> TraceSummary:
    """Per-kernel calls, mean and total time, share of the step and gaps over the replays of a trace."""
    replays, other = split_replays(gpu_events(trace))
    by_name: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    spans, busy, idle = [], [], []
    for replay in replays:
        first, latest_end, idle_sum = replay[0].start, replay[0].start, 0.0
        stream_end: dict[int | None, float] = {}
        for event in replay:
            idle_sum += max(event.start - latest_end, 0.0)
            latest_end = max(latest_end, event.start + event.duration)
            record = by_name[event.name]
            record["duration"].append(event.duration)
            if event.stream in stream_end:
                record["gap"].append(event.start - stream_end[event.stream])
            stream_end[event.stream] = event.start + event.duration
            record["offset"].append(event.start - first)
            record["kind"] = event.kind
        spans.append(latest_end - first)
        busy.append(sum(event.duration for event in replay))
        idle.append(idle_sum)
    total_span = sum(spans)
    rows = [
        KernelRow(
            stage=stage_of(name) if record["kind"] == "kernel" else record["kind"],
            kernel=kernel_label(name),
            kind=record["kind"],
            calls=len(record["duration"]),
            per_replay=len(record["duration"]) / len(replays),
            mean_us=statistics.fmean(record["duration"]),
            total_us=sum(record["duration"]),
            share=sum(record["duration"]) / total_span if total_span > 0 else float("nan"),
            gap_us=statistics.fmean(record["gap"]) if record["gap"] else float("nan"),
            offset_us=statistics.fmean(record["offset"]),
        )
        for name, record in by_name.items()
    ]
    rows.sort(key=lambda row: row.offset_us)
    return TraceSummary(
        rows=rows,
        replays=len(replays),
        events_per_replay=len(replays[0]),
        span_us=statistics.fmean(spans),
        busy_us=statistics.fmean(busy),
        idle_us=statistics.fmean(idle),
        other_events=other,
    )


def describe(summary: TraceSummary) -> str:
    """The per-kernel table and a summary line."""
    rows = [
        [
            r.stage,
            r.kernel,
            r.calls,
            r.mean_us,
            r.total_us,
            f"{100 * r.share:.1f}%",
            r.gap_us,
            r.offset_us,
        ]
        for r in summary.rows
    ]
    text = table(["stage", "kernel", "calls", "mean us", "total us", "share", "gap us", "starts at us"], rows)
    line = (
        f"{summary.replays} replays of {summary.events_per_replay} GPU events: span {summary.span_us:.1f} us, "
        f"busy {summary.busy_us:.1f} us (summed), idle gaps {summary.idle_us:.1f} us per replay"
    )
    if summary.other_events:
        line += f"; {summary.other_events} GPU events outside the replays left out"
    return f"{text}\n{line}"


def record(graph, replays: int, path: Path, warmup: int = 10) -> dict:
    """Replay a captured torch.cuda.CUDAGraph (or anything with a `replay()`: a DcpGroup's
    gated step) `replays` times under torch.profiler (CUDA activity), write the Chrome trace
    to `path` and return it. One more replay runs first under the
    profiler: the first one's kernel events can come back incomplete while CUPTI starts
    (seen on an H100), and `summarize` keeps only the replays with every event."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(replays + 1):
            graph.replay()
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(path))
    return json.loads(Path(path).read_text())
