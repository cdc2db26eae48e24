"""Timing on the GPU: graph-replay latencies, `graphstep run`, `serve` and `bench`.

Times are CUDA-event intervals around replays on the capturing device, after warm-up;
reported numbers are medians (p50) and p99 over the replays.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import floor
from .policy import UnusedPolicyEntries, overlap_for
from .report import Progress, json_keys, table
from .shapes import RankShape
from .step import DecodeStep


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`: the nearest element of the sorted list, no interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


L2_BYTES = 60_000_000  # at least an H100 / H200's L2 (50 MB): the benches' rotations and, where torch does not
# report the L2, the flush size are sized against it


def l2_flush_bytes(l2_bytes: int | None) -> int:
    """Bytes to read so that nothing a replay left in an L2 of `l2_bytes` stays there: twice it."""
    return 2 * (l2_bytes or L2_BYTES)


def l2_flusher(device, l2_bytes: int | None = None):
    """A function that evicts the L2 of `device` (of l2_bytes; None: as the device reports it)
    by reading a buffer of l2_flush_bytes on the current stream: its lines stay clean, so no
    write-back falls into the next timed region."""
    if l2_bytes is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    buffer = torch.zeros(l2_flush_bytes(l2_bytes) // 4, device=device)
    out = torch.empty((), device=device)
    return lambda: torch.sum(buffer, dim=0, out=out)


def replay_us(
    step: DecodeStep, size: int, mode: str | None = None, replays: int = 100, warmup: int = 10, cold_l2: bool = False
) -> list[float]:
    """Per-replay device times (us) of the graph of `size` in `mode`, back to back (the weights
    and caches a replay reads may still be in the L2 from the one before: at TP 8, B = 1 a
    step reads ~44 MB), or with cold_l2 after an untimed read that evicts the L2 before each
    replay, as a serving loop's other layers would."""
    graph = step.graph(size, mode)
    flush = l2_flusher(step.device) if cold_l2 else None
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        if flush is not None:
            flush()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def load_batch(step: DecodeStep, batch: int, context: int, seed: int = 0) -> None:
    """Load random inputs of `batch` tokens at `context` (and peers under DCP) into the step's
    buffers, for timing replays."""
    inputs = step.state.inputs(batch, context_lens=context, seed=seed)
    peers = step.state.peer_inputs(inputs, seed=seed + 1) if step.shape.topology.dcp > 1 else None
    step.load(inputs, peers)


def _knobs(args) -> dict:
    """The run's --knob values for its JSON record (tuple keys as their repr)."""
    return json_keys(getattr(args, "knobs", {}))


def policy_step(shape: RankShape, args) -> DecodeStep:
    """The step of `run` and `serve` at the user's --policy: its table's unused entries were
    noted already (cli.check_policy), so DecodeStep's warning of them is not repeated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedPolicyEntries)
        return DecodeStep(shape, capture_sizes=args.batch, policy=args.policy, max_context=args.context, seed=args.seed)


def run_gpu(args, shape: RankShape) -> int:
    """`graphstep run` on an sm_90 GPU: build, capture, replay, print latencies (args.json: as JSON,
    the narrative on stderr)."""
    narrative = sys.stderr if args.json else sys.stdout
    device = torch.cuda.get_device_name()
    print(
        f"graphstep run: {shape.model.name} {shape.topology.name}, context {args.context}, sizes {args.batch}, "
        f"policy {args.policy or 'default'} ({device})",
        file=narrative,
        flush=True,
    )
    started = time.perf_counter()
    step = policy_step(shape, args)
    step.capture()
    print(f"built and captured {len(step.graphs)} graphs in {time.perf_counter() - started:.1f} s", file=narrative)
    records = []
    for size in step.sizes:
        load_batch(step, size, args.context, args.seed)
        times = replay_us(step, size, replays=args.replays)
        cold = replay_us(step, size, replays=args.replays, cold_l2=True)
        bound = floor.step_floor(shape, size, args.context, args.bandwidth * 1e12)
        p50 = statistics.median(times)
        records.append(
            dict(
                batch=size,
                mode=step.modes[size],
                p50_us=p50,
                p99_us=percentile(times, 99),
                p50_cold_l2_us=statistics.median(cold),
                floor_us=bound.us,
                p50_over_floor=p50 / bound.us,
            )
        )
    if args.json:
        meta = dict(model=shape.model.name, topology=shape.topology.name, device=device, torch=torch.__version__)
        meta["knobs"] = _knobs(args)
        record = dict(meta, context=args.context, replays=args.replays, floor_bandwidth_tbs=args.bandwidth)
        print(json.dumps(dict(record, sizes=records), indent=1))
    else:
        print(
            table(
                [
                    "batch",
                    "mode",
                    "p50 us",
                    "p99 us",
                    "p50 cold L2 us",
                    f"floor us ({args.bandwidth:g} TB/s)",
                    "p50/floor",
                ],
                [list(r.values()) for r in records],
            )
        )
    return 0


def default_trace(max_batch: int, steps: int, seed: int = 0) -> list[int]:
    """A serving-like trace: the batch drifts as requests arrive and finish."""
    gen = torch.Generator().manual_seed(seed)
    batch, trace = max(1, max_batch // 2), []
    for _ in range(steps):
        batch = int(min(max_batch, max(1, batch + int(torch.randint(-3, 4, (), generator=gen)))))
        trace.append(batch)
    return trace


def read_trace(path: str) -> list[int]:
    """A file of batch sizes (separated by spaces, commas or newlines) for `graphstep serve
    --trace`. Raises ValueError naming the path: no path, a file it cannot read (missing, a
    folder), one that is not text, one without positive sizes."""
    if not path:
        raise ValueError(f"{path!r}: expected the path of a file of batch sizes")
    try:
        text = Path(path).read_text().replace(",", " ").split()
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror or error})") from None
    except UnicodeDecodeError:
        what = "a trace is batch sizes separated by spaces, commas or newlines"
        raise ValueError(f"{path}: not a text file ({what})") from None
    try:
        trace = [int(v) for v in text]
    except ValueError:
        raise ValueError(f"{path}: a trace is batch sizes separated by spaces, commas or newlines") from None
    if not trace or min(trace) <= 0:
        raise ValueError(f"{path}: a trace needs at least one positive batch size")
    return trace


def serve(args, shape: RankShape) -> int:
    """Replay a trace of batch sizes as a serving loop would: what step() does (load: the
    value checks with their one sync and the input copies; the replay; under DCP the error
    word's read), then sync. Two times a step: the host's wall time of all of it, and the
    device's time of the graph replay alone (events around it: the checks' sync leaves the
    device idle while the host builds the copies, which would otherwise count as device time).
    args.unchecked: load without the value checks (check_values=False, as a serving loop that
    guarantees its inputs would); whatever the kernels' guards record is raised at the end."""
    trace = read_trace(args.trace) if args.trace is not None else default_trace(max(args.batch), args.steps, args.seed)
    if max(trace) > max(args.batch):
        raise ValueError(f"the trace needs batch {max(trace)} but the largest captured size is {max(args.batch)}")
    step = policy_step(shape, args)
    step.capture()
    pool = {b: step.state.inputs(b, context_lens=args.context, seed=b) for b in sorted(set(trace))}
    peers = {b: step.state.peer_inputs(pool[b], seed=b) for b in pool} if shape.topology.dcp > 1 else {}
    for b in pool:  # warm every size once
        step.step(pool[b], peers.get(b))
    torch.cuda.synchronize()
    wall_us, device_us = [], []
    tokens = 0
    with Progress(args.steps, "serve") as progress:
        for i in range(args.steps):
            batch = trace[i % len(trace)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            size = step.load(pool[batch], peers.get(batch), check_values=not args.unchecked)  # step() in parts
            start.record()
            step.replay(size)
            end.record()
            if shape.topology.dcp > 1:
                step.check()  # as step() does under DCP: what QueryWait recorded
            end.synchronize()
            wall_us.append((time.perf_counter() - t0) * 1e6)
            device_us.append(start.elapsed_time(end) * 1e3)
            tokens += batch
            progress.update()
    step.check()  # what the guards recorded in the last step (and, unchecked, in any step)
    summary = serve_summary(device_us, wall_us, tokens)
    if args.json:
        meta = dict(model=shape.model.name, topology=shape.topology.name, device=torch.cuda.get_device_name())
        meta["knobs"] = _knobs(args)
        meta["value_checks"] = not args.unchecked
        print(json.dumps(dict(meta, context=args.context, **summary), indent=1))
        return 0
    print(
        table(
            ["", "p50 us", "p99 us", "mean us"],
            [
                ["graph replay, device"] + [summary["device_us"][k] for k in ("p50", "p99", "mean")],
                [f"step, host wall ({'' if args.unchecked else 'checks, '}copies, replay, sync)"]
                + [summary["host_us"][k] for k in ("p50", "p99", "mean")],
            ],
        )
    )
    print(
        f"{summary['steps']} steps, {tokens} tokens, {summary['tokens_per_s']:,.0f} tokens/s (one layer's query stage)"
    )
    return 0


def serve_summary(device_us: list[float], wall_us: list[float], tokens: int) -> dict:
    """p50, p99 and mean of the per-step device and host times, and the tokens per second of the wall time."""

    def stats(values: list[float]) -> dict:
        return dict(p50=percentile(values, 50), p99=percentile(values, 99), mean=statistics.fmean(values))

    return dict(
        steps=len(wall_us),
        tokens=tokens,
        tokens_per_s=tokens / (sum(wall_us) / 1e6),
        device_us=stats(device_us),
        host_us=stats(wall_us),
    )


ALONE_SLOWER = 1.25  # flag the smallest size's graph when the full step replays it this much slower


def alone_line(size: int, alone_us: float, default_us: float, sizes: list[int]) -> str:
    """The smallest batch's graph (cute fork) in a step that captured only that size beside
    the same graph in the step that captured every size (issue 10: under DCP 2 a B = 1
    graph once took 311 us beside 60 us when the step had also captured size 64)."""
    ratio = default_us / alone_us
    line = (
        f"B = {size} graph, cute fork: {alone_us:.1f} us in a step that captured only [{size}], "
        f"{default_us:.1f} us in the step that captured {list(sizes)} ({ratio:.2f}x)"
    )
    if ratio > ALONE_SLOWER:
        line += " <- SLOWER once the larger sizes are captured: something sized by the largest batch (issue 10)"
    return line


def bench(args, shape: RankShape) -> int:
    """Per batch: cute fork, cute serial, cute fork without PDL, the torch backend, the floor;
    then the smallest batch's graph of a step that captured only that size beside the default's.
    Under DCP (rank 0, its peers simulated) then the group of real ranks (bench_group);
    args.group_only: that group table alone."""
    if shape.topology.dcp > 1 and getattr(args, "group_only", False):
        text = bench_group(args, shape)
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.md").write_text(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n{text}\n")
        print(f"wrote {out / 'bench.md'}")
        return 0
    sizes = args.batch
    common = dict(capture_sizes=sizes, max_context=args.context, seed=args.seed)
    steps = {
        "cute": DecodeStep(shape, policy="fork", **common),
        "cute_nopdl": DecodeStep(shape, policy="fork", pdl=False, **common),
        "torch": DecodeStep(shape, policy="fork", backend="torch", **common),
    }
    poll = not shape.topology.wide  # fork_poll (TP 1's split query has no mailbox to poll)
    steps["cute"].capture(modes=("serial", "fork_poll") if poll else ("serial",))
    steps["cute_nopdl"].capture()
    steps["torch"].capture()
    smallest = min(sizes)
    alone = DecodeStep(shape, policy="fork", **dict(common, capture_sizes=[smallest]))
    alone.capture()
    rows, records = [], []
    for size in sizes:
        for step in steps.values():
            load_batch(step, size, args.context, args.seed)
        t = {
            "cute_fork": statistics.median(replay_us(steps["cute"], size, "fork", args.replays)),
            "cute_fork_poll": statistics.median(replay_us(steps["cute"], size, "fork_poll", args.replays))
            if poll
            else None,
            "cute_serial": statistics.median(replay_us(steps["cute"], size, "serial", args.replays)),
            "cute_fork_nopdl": statistics.median(replay_us(steps["cute_nopdl"], size, "fork", args.replays)),
            "torch_fork": statistics.median(replay_us(steps["torch"], size, "fork", args.replays)),
        }
        bound = floor.step_floor(shape, size, args.context, args.bandwidth * 1e12)
        default = overlap_for(size, None, shape.topology.dcp > 1, shape.topology.wide, shape.topology.split)
        step_us = t[f"cute_{default}"]  # the mode a step uses by default at this size
        cold = replay_us(steps["cute"], size, default, args.replays, cold_l2=True)
        t["cute_default_cold_l2"] = statistics.median(cold)
        record = dict(batch=size, context=args.context, floor_us=bound.us, indexer_floor_us=bound.indexer_us, **t)
        record.update(default_mode=default, default_us=step_us)
        records.append(record)
        rows.append(
            [
                size,
                t["cute_fork"],
                "-" if t["cute_fork_poll"] is None else t["cute_fork_poll"],
                t["cute_serial"],
                t["cute_fork_nopdl"],
                t["torch_fork"],
                bound.us,
                default,
                step_us / bound.us,
                t["cute_default_cold_l2"],
                t["cute_default_cold_l2"] / bound.us,
                t["torch_fork"] / step_us,
                t["cute_serial"] / t["cute_fork"],
                t["cute_fork_nopdl"] / t["cute_fork"],
            ]
        )
        print(f"  batch {size} done", file=sys.stderr, flush=True)
    load_batch(alone, smallest, args.context, args.seed)
    alone_us = statistics.median(replay_us(alone, smallest, "fork", args.replays))
    default_us = next(r["cute_fork"] for r in records if r["batch"] == smallest)
    headers = [
        "batch",
        "cute fork",
        "cute fork_poll",
        "cute serial",
        "fork no-PDL",
        "torch",
        f"floor ({args.bandwidth:g} TB/s)",
        "default",
        "default/floor",
        "default, cold L2",
        "cold/floor",
        "torch/default",
        "serial/fork",
        "no-PDL/fork",
    ]
    text = f"times in us (median of {args.replays} graph replays)\n\n" + table(headers, rows, markdown=True)
    text += "\n\n" + alone_line(smallest, alone_us, default_us, sizes)
    if shape.topology.dcp > 1:  # the rows above: rank 0 with simulated peers; now the real group
        del steps, alone
        text += "\n\n" + bench_group(args, shape)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        shape=shape.model.name,
        topology=shape.topology.name,
        context=args.context,
        floor_bandwidth_tbs=args.bandwidth,
        knobs=_knobs(args),
    )
    alone_record = dict(batch=smallest, captured_alone_us=alone_us, captured_all_us=default_us)
    (out / "bench.json").write_text(json.dumps(dict(meta=meta, rows=records, alone=alone_record), indent=1))
    (out / "bench.md").write_text(f"{meta}\n\n{text}\n")
    _plot(records, out / "bench.png", meta)
    print(
        f"wrote {out / 'bench.json'}, {out / 'bench.md'}"
        + (f", {out / 'bench.png'}" if (out / "bench.png").exists() else "")
    )
    return 0


def tune(args, shape: RankShape) -> int:
    """Time every allowed mode per captured size and print the policy table to use."""
    from .policy import MODES, WIDE_MODES

    topo = shape.topology
    modes = WIDE_MODES if topo.wide else MODES
    step = DecodeStep(shape, capture_sizes=args.batch, policy="fork", max_context=args.context, seed=args.seed)
    step.capture(modes=tuple(modes))
    rows, picks = [], []
    for size in step.sizes:
        load_batch(step, size, args.context, args.seed)
        times = {mode: statistics.median(replay_us(step, size, mode, args.replays)) for mode in modes}
        best = min(times, key=times.get)
        picks.append(f"{size}:{best}")
        rows.append([size] + [times[mode] for mode in modes] + [best])
    print(table(["batch"] + [f"{mode} us" for mode in modes] + ["fastest"], rows))
    print(f"policy for {topo.name}: {','.join(picks)}")
    return 0


def trace(args, shape: RankShape) -> int:
    """`graphstep trace`: steady-state replays of one size under torch.profiler, the Chrome
    trace written to args.out and the per-kernel table printed."""
    from .kernel_trace import describe, record, summarize

    step = DecodeStep(
        shape, capture_sizes=[args.batch_size], policy=args.mode, max_context=args.context, seed=args.seed
    )
    step.capture()
    load_batch(step, args.batch_size, args.context, args.seed)
    mode = step.modes[args.batch_size]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # checked writable, made only now (cli.writable_dir)
    summary = summarize(record(step.graph(args.batch_size), args.replays, Path(args.out)))
    if args.json:
        print(json.dumps(dict(batch=args.batch_size, mode=mode, context=args.context, **summary.as_dict()), indent=1))
        return 0
    print(
        f"graphstep trace: {shape.model.name} {shape.topology.name}, batch {args.batch_size}, mode {mode}, "
        f"context {args.context} ({torch.cuda.get_device_name()})"
    )
    print(describe(summary))
    print(f"wrote {args.out} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _plot(records: list[dict], path: Path, meta: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no bench.png (pip install -e '.[plot]')", file=sys.stderr)
        return
    batches = [r["batch"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in [
        ("cute_fork", "cute fork"),
        ("default_us", "cute (default mode)"),
        ("cute_default_cold_l2", "cute (default mode), cold L2"),
        ("cute_serial", "cute serial"),
        ("torch_fork", "torch"),
        ("floor_us", "bytes floor"),
    ]:
        ax.plot(batches, [r[key] for r in records], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("step latency (us)")
    ax.set_title(f"{meta['shape']} {meta['topology']}, context {meta['context']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- a DCP group of real ranks on one GPU (graphstep.dcp_group) --------------------------------


GROUP_GATE_S = 0.0005  # longer than one host thread takes to launch every rank's graph


def group_replay_us(group, size: int, replays: int = 100, warmup: int = 10) -> tuple[list[float], list[list[float]]]:
    """Per group step (us): from the start of every rank's graph (all launched behind a GPU
    gate, so they start together as on separate GPUs) to the last rank's end, and each
    rank's own time (its start to its end, waits for its peers included)."""
    for _ in range(warmup):
        group.replay(size, GROUP_GATE_S)
    group.check()  # a timed-out wait would leave a flag set and skew every later step
    runs = []
    for _ in range(replays):
        runs.append(group.replay(size, GROUP_GATE_S))
        torch.cuda.synchronize()  # the next gate must not open behind this step
    group.check()
    torch.cuda.synchronize()
    whole = [start.elapsed_time(end) * 1e3 for start, end, _ in runs]
    ranks = [[r[0].elapsed_time(r[1]) * 1e3 for _, _, rs in runs for r in [rs[rank]]] for rank in range(group.dcp)]
    return whole, ranks


def group_wait_us(group, size: int, replays: int = 10) -> dict[str, float]:
    """Mean GPU time per rank and step of the group's two waits (QueryWait, CandidateSync)
    over gated group replays recorded by kernel_trace.record (replays + 1 of them): how much
    of a rank's step is spent waiting for its peers (on one GPU, also for the SMs they hold).
    Each rank runs each wait once a step, so the mean is over the wait's kernels recorded (the
    first replay's can be missing: kernel_trace.record)."""
    from types import SimpleNamespace

    from .kernel_trace import gpu_events, record, stage_of

    def one_step() -> None:
        group.replay(size, GROUP_GATE_S)
        torch.cuda.synchronize()  # the next gate must not open behind this step

    with tempfile.TemporaryDirectory() as folder:
        trace = record(SimpleNamespace(replay=one_step), replays, Path(folder) / "group.json", warmup=0)
    group.check()
    events = gpu_events(trace)
    waits = {"QueryWait": [], "CandidateSync": []}
    for event in events:
        stage = stage_of(event.name)
        if stage in waits:
            waits[stage].append(event.duration)
    return {stage: statistics.mean(times) if times else 0.0 for stage, times in waits.items()}


def _group(shape: RankShape, dcp: int, sizes, context: int, seed: int):
    from .dcp_group import DcpGroup

    group = DcpGroup(shape, dcp, capture_sizes=sizes, backend="cute", max_context=context, seed=seed)
    group.capture()
    return group


def run_group(args, shape: RankShape) -> int:
    """`graphstep run --dcp d` on a GPU: a DcpGroup of d ranks on it (their kernels exchange
    through each other's memory), one checked group step per size, then timed replays
    (args.json: as JSON, the narrative on stderr)."""
    narrative = sys.stderr if args.json else sys.stdout
    device = torch.cuda.get_device_name()
    print(
        f"graphstep run: {shape.model.name} {shape.topology.name}, a DCP group of {args.dcp} ranks on one GPU, "
        f"context {args.context}, sizes {args.batch} ({device})",
        file=narrative,
        flush=True,
    )
    started = time.perf_counter()
    group = _group(shape, args.dcp, args.batch, args.context, args.seed)
    graphs = sum(len(step.graphs) for step in group.steps)
    print(
        f"built and captured {graphs} graphs ({args.dcp} ranks) in {time.perf_counter() - started:.1f} s",
        file=narrative,
    )
    rows, records = [], []
    for size in group.steps[0].sizes:
        inputs = group.unsharded.inputs(size, context_lens=args.context, seed=args.seed + 1)
        outputs = group.step(inputs)  # checked: every rank's error word read
        picked = [int((out.slots >= 0).sum()) for out in outputs]
        whole, ranks = group_replay_us(group, group.load(inputs), args.replays)
        rank_p50 = [statistics.median(times) for times in ranks]
        records.append(dict(batch=size, group_p50_us=statistics.median(whole), rank_p50_us=rank_p50, slots=picked))
        rows.append([size, statistics.median(whole), percentile(whole, 99), " / ".join(f"{t:.1f}" for t in rank_p50)])
    if args.json:
        meta = dict(model=shape.model.name, topology=shape.topology.name, device=device, torch=torch.__version__)
        meta["knobs"] = _knobs(args)
        print(json.dumps(dict(meta, dcp=args.dcp, context=args.context, replays=args.replays, sizes=records), indent=1))
    else:
        print(table(["batch", "group p50 us", "group p99 us", "per rank p50 us"], rows))
        print(
            "group: every rank's graph launched behind one GPU gate, from the gate to the last rank's end; "
            "each rank: from the gate to its own end (waits for its peers included)"
        )
    return 0


def bench_group(args, shape: RankShape) -> str:
    """`graphstep bench --dcp d`'s group table: per batch, the group step of d real ranks on
    one GPU, each rank's step, and the step of one rank without DCP over the same context
    (the ranks share the SMs here: the multi-GPU figures are another issue's)."""
    group = _group(shape, shape.topology.dcp, args.batch, args.context, args.seed)
    single = DecodeStep(
        shape.with_topology(dcp=1, rank=0), capture_sizes=args.batch, max_context=args.context, seed=args.seed
    )
    single.capture()
    rows = []
    for size in args.batch:
        group.step(group.unsharded.inputs(size, context_lens=args.context, seed=args.seed + 1))  # checked once
        whole, ranks = group_replay_us(group, size, args.replays)
        load_batch(single, size, args.context, args.seed)
        alone = statistics.median(replay_us(single, size, replays=args.replays))
        group_us = statistics.median(whole)
        rank_us = [statistics.median(times) for times in ranks]
        waits = group_wait_us(group, size)
        mean_rank = statistics.mean(rank_us)
        shares = [waits["QueryWait"] / mean_rank, waits["CandidateSync"] / mean_rank]
        rows.append([size, group_us, *rank_us, alone, group_us / alone, *shares])
        print(f"  group batch {size} done", file=sys.stderr, flush=True)
    headers = ["batch", "group", *[f"rank {r}" for r in range(group.dcp)], "one rank, no DCP", "group/one"]
    headers += ["QueryWait share", "CandidateSync share"]
    return (
        f"DCP group of {group.dcp} ranks on one GPU, context {args.context} (us, median of {args.replays}; "
        "each rank from the common start to its end; the waits' shares: their kernels' mean GPU time per rank "
        "(torch.profiler, 11 steps; under PDL from their early launch, so their own predecessor's tail is in it) "
        "over the mean rank time):\n\n" + table(headers, rows, markdown=True)
    )
