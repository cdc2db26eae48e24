"""The `graphstep` command line."""

from __future__ import annotations

import argparse
import ast
import faulthandler
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from . import floor
from .policy import MODES
from .report import mb, table
from .shapes import MAX_DCP, PRESETS, RankShape, Topology, preset


def sm90_device() -> bool:
    """Whether torch sees an sm_90 GPU (H100/H200): the commands that capture graphs need one."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def add_shape_args(parser: argparse.ArgumentParser, dcps: bool = False) -> None:
    """The shape and topology flags every command shares (`rank_shape` reads them back).
    dcps: --dcp takes a comma-separated list (bench: one table per size)."""
    parser.add_argument("--preset", default="deepseek-v3.2", choices=sorted(PRESETS), help="model shapes")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel size (heads per rank = heads / tp)")
    if dcps:
        parser.add_argument("--dcp", type=dcp_sizes, default=[1], help="decode context-parallel sizes, e.g. 2,4")
    else:
        parser.add_argument("--dcp", type=int, default=1, help="decode context-parallel size")
    parser.add_argument("--rank", type=int, default=0, help="the DCP rank simulated")
    parser.add_argument("--wide", action="store_true", help="TP1's split query")
    parser.add_argument("--split", action="store_true", help="the split query under DCP")
    parser.add_argument("--q-format", default="bf16", choices=["bf16", "fp8"], help="query rows in the mailbox")
    parser.add_argument("--mla-cache", default="bf16", choices=["bf16", "fp8"], help="MLA cache format")
    parser.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="KERNEL.NAME=VALUE",
        help="set a kernel module's tuning constant for this run, e.g. mla_query.STREAM_FROM_HEADS=64 (repeatable)",
    )


def _a(kind: type) -> str:
    """A type as the knob errors name it: 'an int', 'a dict', 'None'."""
    if kind is type(None):
        return "None"
    return f"{'an' if kind.__name__[0] in 'aeiou' else 'a'} {kind.__name__}"


def parse_knob(text: str) -> tuple[str, str, object]:
    """(kernel module, constant, value) of a --knob KERNEL.NAME=VALUE. The module is one of
    kernels/catalog.py's KERNELS, the constant one of its KNOBS (the tuning constants the host
    reads when it builds a variant; not the probes, whose results are wrong), and the value a
    Python literal of a type its KNOBS entry names (a dict with the constant's keys, each
    value of its present value's type). Ranges are the kernel's to check when the step is
    built (a ValueError then too). Raises ValueError."""
    from .kernels import catalog

    name, sep, literal = text.partition("=")
    kernel, dot, constant = (part.strip() for part in name.partition("."))
    literal = literal.strip()
    if not sep or not dot:
        raise ValueError(f"--knob {text!r}: expected KERNEL.NAME=VALUE")
    if kernel not in catalog.KERNELS:
        raise ValueError(f"--knob {text!r}: no kernel {kernel!r} (kernels: {', '.join(sorted(catalog.KERNELS))})")
    module = catalog.KERNELS[kernel]
    knobs = getattr(module, "KNOBS", {})
    if constant not in knobs:
        listed = f"its knobs: {', '.join(knobs)}" if knobs else "it has none"
        raise ValueError(f"--knob {text!r}: {constant!r} is not a knob of kernels/{kernel}.py ({listed})")
    current = getattr(module, constant)
    kinds = knobs[constant] if isinstance(knobs[constant], tuple) else (knobs[constant],)
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        hint = ""
        if str in kinds or (isinstance(current, dict) and any(isinstance(item, str) for item in current.values())):
            example = repr(current) if isinstance(current, dict) else repr(literal)
            hint = f'; quote a str, and the whole flag for the shell: --knob "{kernel}.{constant}={example}"'
        raise ValueError(f"--knob {text!r}: {literal!r} is not a Python literal{hint}") from None
    if type(value) not in kinds:  # (exact types: a bool is no int here)
        names = " or ".join(_a(kind) for kind in kinds)
        raise ValueError(f"--knob {text!r}: {kernel}.{constant} takes {names} (now {current!r})")
    if isinstance(current, dict):
        if set(value) != set(current):
            raise ValueError(f"--knob {text!r}: {kernel}.{constant} takes the keys {sorted(current)}")
        for key, item in value.items():
            if type(item) is not type(current[key]):  # (exact: a bool is no int, 10.5 no int)
                kind = _a(type(current[key]))
                raise ValueError(f"--knob {text!r}: {kernel}.{constant}[{key!r}] takes {kind} (now {current[key]!r})")
    return kernel, constant, value


def apply_knobs(texts: list[str]) -> dict[str, object]:
    """Set every --knob on its kernel module (the compiled variants and the host's choices read
    them when the step is built); returns {KERNEL.NAME: value} for the records."""
    from .kernels import catalog

    applied = {}
    for kernel, constant, value in [parse_knob(text) for text in texts]:
        setattr(catalog.KERNELS[kernel], constant, value)
        applied[f"{kernel}.{constant}"] = value
    return applied


def rank_shape(args) -> RankShape:
    """The RankShape the shape flags of `add_shape_args` name."""
    topology = Topology(
        tp=args.tp,
        dcp=args.dcp[0] if isinstance(args.dcp, list) else args.dcp,
        wide=args.wide,
        split=args.split,
        rank=args.rank,
        q_format=args.q_format,
        mla_cache=args.mla_cache,
    )
    return RankShape(preset(args.preset), topology)


def _number(kind, accepts, expected: str):
    """An argparse type: `kind(text)` where `accepts` it, else an error naming `expected`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected
    parse.__doc__ = f"An argparse type: {expected}."
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
seed = _number(int, lambda v: 0 <= v < 2**63, "a seed in [0, 2^63)")  # torch.Generator's range


class Formatter(argparse.HelpFormatter):
    """--help shows every option's default (lists comma-separated; none for flags)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            "(default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default).replace("%", "%%")
        return f"{text} (default: {shown})" if shown else text  # (--knob's []: nothing to show)


ARCHS = ("sm_90a",)  # the kernels use wgmma, setmaxnreg and clusters: sm_90a only


def writable_dir(path: str, flag: str) -> None:
    """Check, before any work, that the folder `path` can be written in or made: it, or its
    nearest existing parent, is a folder a file can be written in. Creates nothing: the command
    makes the folder when it writes (a run refused later, as without a GPU, leaves none)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    existing = target.absolute()
    while not (existing.exists() or existing.is_symlink()):  # (a dangling link is no folder to make)
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, f"{existing} is not a folder")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: not a writable folder ({error.strerror or error})") from None


def host_memory_bytes() -> int:
    """Memory available for new allocations (MemAvailable; the physical size elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(
    shape: RankShape,
    batch: int,
    context: int,
    available: int,
    where: str,
    flags: str,
    reference: bool = False,
    states: int = 1,
    group: bool = False,
) -> None:
    """Refuse `states` states (built one after another, all kept), or with group the CPU DCP
    group of shape's dcp ranks (group_bytes), too large for `available` bytes before
    allocating any (a clear error, not an OOM). flags: the flags and values that set batch and
    context, which the error names (either can be the one to lower)."""
    from .state import state_bytes

    if group:
        need = group_bytes(shape, batch, context)
        what = f"the DCP group of {shape.topology.dcp} ranks for batch {batch} needs"
    else:
        need = state_bytes(shape, batch, context, reference=reference)
        need += (states - 1) * state_bytes(shape, batch, context, building=False)
        what = f"the state for batch {batch} needs" if states == 1 else f"the {states} states for batch {batch} need"
    if need > available:
        raise ValueError(
            f"{flags}: {what} about {need / 1e9:,.1f} GB, more than the {available / 1e9:,.1f} GB of {where}"
        )


def group_bytes(shape: RankShape, batch: int, context: int) -> int:
    """About the peak bytes of the DcpGroup `run --dcp` builds on the CPU (graphstep.dcp_group):
    the unsharded layer (about dcp ranks' caches, heads of tp / dcp ranks) built first, then
    every rank's state beside it, each with its fp32 draws while built, then all the ranks'
    steps at once in threads (each a reference working set, state_bytes' reference=True). One
    rank's state alone under-counts it several times over."""
    from .state import state_bytes

    topo = shape.topology
    shapes = [shape.unsharded()] + [shape.with_topology(rank=rank) for rank in range(topo.dcp)]
    built = [state_bytes(s, batch, context, building=False) for s in shapes]
    building = [sum(built[:i]) + state_bytes(s, batch, context) for i, s in enumerate(shapes)]
    working = state_bytes(shape, batch, context, reference=True) - state_bytes(shape, batch, context)
    return max(building + [sum(built) + topo.dcp * working])


def positive_ints(what: str):
    """An argparse type: a comma-separated list ("1,4,16") of positive ints, `what` naming
    them in its errors."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return values

    parse.__name__ = what.replace(" ", "_")
    parse.__doc__ = f"Parse a list of {what} into positive ints; argparse reports a bad one."
    return parse


batches = positive_ints("batch sizes")  # --batch
dcp_sizes = positive_ints("DCP sizes")  # bench --dcp


def info_record(shape: RankShape, batches: list[int], context: int, bandwidth_tbs: float) -> dict:
    """What `graphstep info` reports: the per-rank sizes and, per batch, each stage's bytes,
    FLOPs, bytes floor and MMA time, the step floor and the indexer floor."""
    m, t = shape.model, shape.topology
    sizes = dict(
        heads=shape.heads,
        gathered=shape.gathered,
        q_heads=shape.q_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_dim=m.qk_nope_dim,
        qk_rope_dim=m.qk_rope_dim,
        query_row=m.query_row,
        q_bytes=shape.q_bytes,
        mailbox_row_chunks=shape.mailbox_row_chunks,
        packed_width=m.packed_width,
        index_heads=m.index_heads,
        index_dim=m.index_dim,
        index_topk=m.index_topk,
        index_token_bytes=m.index_token_bytes,
        mla_token_bytes=shape.mla_token_bytes,
    )
    floors = []
    for batch in batches:
        step = floor.step_floor(shape, batch, context, bandwidth_tbs * 1e12)
        stages = [
            dict(
                name=c.name,
                stream=c.stream,
                weight_bytes=c.weight_bytes,
                io_bytes=c.io_bytes,
                flops=c.flops,
                floor_us=c.floor_us(step.bandwidth),
                mma_us=c.mma_us(),
            )
            for c in step.costs
        ]
        floors.append(
            dict(
                batch=batch,
                context=context,
                bandwidth_tbs=bandwidth_tbs,
                stages=stages,
                step_bytes=step.bytes,
                step_floor_us=step.us,
                indexer_bytes=step.indexer_bytes,
                indexer_floor_us=step.indexer_us,
            )
        )
    return dict(model=m.name, topology=t.name, assumed=list(m.assumed), sizes=sizes, floors=floors)


def cmd_knobs(args) -> int:
    """`graphstep knobs`: every kernel module's KNOBS with its value for this run (after any
    --knob) and the types it takes; needs no GPU."""
    from .kernels import catalog

    rows = []
    for kernel, module in catalog.KERNELS.items():
        for name, kinds in getattr(module, "KNOBS", {}).items():
            kinds = kinds if isinstance(kinds, tuple) else (kinds,)
            given = f"{kernel}.{name}" in args.knobs
            rows.append(
                [
                    kernel,
                    name,
                    repr(getattr(module, name)),
                    " or ".join(_a(k) for k in kinds),
                    "--knob" if given else "",
                ]
            )
    print(table(["kernel", "knob", "value", "takes", "set by"], rows))
    print("set one for a run with --knob KERNEL.NAME=VALUE; what each does: its comment in kernels/KERNEL.py")
    return 0


def cmd_info(args) -> int:
    """`graphstep info`: sizes, bytes, FLOPs and floors per stage; needs no GPU."""
    record = info_record(rank_shape(args), args.batch, args.context, args.bandwidth)
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    s = record["sizes"]
    print(f"{record['model']} ({record['topology']}); assumed: {', '.join(record['assumed']) or 'nothing'}")
    print(
        table(
            ["size", "value"],
            [
                ["heads per rank / gathered / q_heads", f"{s['heads']} / {s['gathered']} / {s['q_heads']}"],
                [
                    "q_lora / kv_lora / nope / rope",
                    f"{s['q_lora_rank']} / {s['kv_lora_rank']} / {s['qk_nope_dim']} / {s['qk_rope_dim']}",
                ],
                [
                    "query row / q_bytes / mailbox chunks per row",
                    f"{s['query_row']} / {s['q_bytes']} / {s['mailbox_row_chunks']}",
                ],
                ["packed row P", s["packed_width"]],
                ["indexer heads x dim, top-k", f"{s['index_heads']} x {s['index_dim']}, {s['index_topk']}"],
                ["indexer / MLA cache bytes per token", f"{s['index_token_bytes']} / {s['mla_token_bytes']}"],
            ],
        )
    )
    for f in record["floors"]:
        print(f"\nbatch {f['batch']}, context {f['context']}, {f['bandwidth_tbs']} TB/s")
        rows = [
            [
                c["name"],
                c["stream"],
                round(mb(c["weight_bytes"]), 2),
                round(mb(c["io_bytes"]), 2),
                round(mb(c["weight_bytes"] + c["io_bytes"]), 2),
                round(c["flops"] / 1e9, 3),
                c["floor_us"],
                round(c["mma_us"], 3),
                "MMA" if c["mma_us"] > c["floor_us"] else "bytes",
            ]
            for c in f["stages"]
        ]
        rows.append(
            ["step (floor.py's rule)", "", "", "", round(mb(f["step_bytes"]), 2), "", f["step_floor_us"], "", ""]
        )
        indexer_mb = round(mb(f["indexer_bytes"]), 2)
        rows.append(["indexer floor (wq_b + cache)", "main", "", "", indexer_mb, "", f["indexer_floor_us"], "", ""])
        mma = f"MMA us ({floor.MMA_RATE / 1e12:.0f} TFLOP/s)"
        print(table(["stage", "stream", "weights MB", "io MB", "total MB", "GFLOP", "floor us", mma, "bound"], rows))
    return 0


RUN_GPU_DEFAULTS = {
    "batch": [1, 4, 16, 64],
    "context": 32768,
    "policy": None,
    "replays": 200,
    "bandwidth": floor.H200_COPY_BW / 1e12,
}
RUN_CPU_DEFAULTS = {"cpu_batch": 4, "cpu_context": 4096}


def _given(args, defaults: dict) -> list[str]:
    return ["--" + name.replace("_", "-") for name in defaults if getattr(args, name) is not None]


def cmd_run(args) -> int:
    """`graphstep run`: capture and replay on an sm_90 GPU, else the torch reference on the CPU."""
    gpu = not args.cpu and sm90_device()
    if gpu:
        given = _given(args, RUN_CPU_DEFAULTS)
        if given:
            raise ValueError(
                f"{', '.join(given)}: for the CPU reference run only (add --cpu); the GPU run takes "
                "--batch and --context"
            )
        for name, value in RUN_GPU_DEFAULTS.items():
            setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
        # (check_args checked --policy against these sizes)
        # a DCP group: its unsharded layer (about d ranks' caches) and its d ranks
        _check_device_memory(args, rank_shape(args), max(args.batch), states=2 * args.dcp if args.dcp > 1 else 1)
        from .timing import run_gpu, run_group

        return (run_group if args.dcp > 1 else run_gpu)(args, rank_shape(args))
    given = _given(args, RUN_GPU_DEFAULTS) + (["--knob"] if args.knob else [])  # (it sets GPU kernels' constants)
    if given:
        why = "--cpu was given" if args.cpu else "no sm_90 GPU was found"
        raise ValueError(
            f"{', '.join(given)}: for the GPU run only ({why}); the CPU reference run takes "
            "--cpu-batch and --cpu-context"
        )
    for name, value in RUN_CPU_DEFAULTS.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    check_fits(
        rank_shape(args),
        args.cpu_batch,
        args.cpu_context,
        host_memory_bytes(),
        "memory available",
        f"--cpu-batch {args.cpu_batch} --cpu-context {args.cpu_context}",
        reference=True,
        group=args.dcp > 1,  # run_cpu_group: the unsharded layer and every rank
    )
    return run_cpu(args)


def check_policy(args, shape: RankShape) -> None:
    """Refuse a --policy this topology does not allow (in any entry), a table naming no --batch
    size (it would change nothing) or '' (not the default: leave the flag out), before any GPU
    work; entries naming other sizes (tune's table) are noted on stderr, then unused (the step
    run and serve build does not warn of them again: timing.policy_step)."""
    import warnings

    from .policy import modes_for

    topo = shape.topology
    policy = getattr(args, "policy", None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            modes_for(args.batch, policy, dcp=topo.dcp > 1, wide=topo.wide, split=topo.split)
    except ValueError as error:
        raise ValueError(f"--policy {policy!r}: {error}") from None
    for warning in caught:
        print(f"graphstep {args.command}: note: --policy {policy!r}: {warning.message}", file=sys.stderr)


def _check_device_memory(args, shape: RankShape, batch: int, states: int = 1) -> None:
    import torch

    free = torch.cuda.mem_get_info()[0]
    sizes = f"--batch {','.join(map(str, args.batch))}" if hasattr(args, "batch") else f"--batch-size {batch}"
    check_fits(shape, batch, args.context, free, "free GPU memory", f"{sizes} --context {args.context}", states=states)


# the states a command keeps at once: bench's three steps and the step of its smallest size alone
STATES = {"bench": 4}


def _needs_gpu(command: str, args) -> None:
    if not sm90_device():
        raise SystemExit(f"graphstep {command}: needs an sm_90 GPU (H100/H200) for graph capture; none was found")
    batch = max(args.batch) if hasattr(args, "batch") else args.batch_size
    _check_device_memory(args, rank_shape(args), batch, states=STATES.get(command, 1))


def cmd_serve(args) -> int:
    """`graphstep serve`: replay a trace of batch sizes as a serving loop does
    (graphstep.timing.serve)."""
    _needs_gpu("serve", args)
    from .timing import serve

    return serve(args, rank_shape(args))


def cmd_bench(args) -> int:
    """`graphstep bench`: the backends and modes per batch against the floor
    (graphstep.timing.bench), per --dcp size (into --out/dcp<d> when there are several)."""
    _needs_gpu("bench", args)
    from .timing import bench

    for dcp in args.dcp:
        one = argparse.Namespace(**vars(args))
        one.dcp = dcp
        if len(args.dcp) > 1:
            one.out = str(Path(args.out) / f"dcp{dcp}")
        bench(one, rank_shape(one))
    return 0


def cmd_tune(args) -> int:
    """`graphstep tune`: time every allowed mode per size and print the fastest as a policy table."""
    _needs_gpu("tune", args)
    from .timing import tune

    return tune(args, rank_shape(args))


def cmd_trace(args) -> int:
    """`graphstep trace`: replays under torch.profiler, the trace file and its per-kernel summary."""
    _needs_gpu("trace", args)
    from .timing import trace

    return trace(args, rank_shape(args))


def cmd_graph(args) -> int:
    """`graphstep graph`: capture one size and print the graph's nodes, edges, forks and joins."""
    _needs_gpu("graph", args)
    from .graphs import inspect
    from .step import DecodeStep

    step = DecodeStep(rank_shape(args), capture_sizes=[args.batch_size], policy=args.mode, max_context=args.context)
    step.capture(keep_graph=True)
    print(f"batch {args.batch_size}, mode {step.modes[args.batch_size]}, backend {step.backend}")
    print(describe_graph(inspect(step.graph(args.batch_size))))
    return 0


def describe_graph(info) -> str:
    """A graphs.GraphInfo as tables: its nodes, its edges, then roots, forks and joins."""
    from .graphs import PROGRAMMATIC
    from .kernel_trace import kernel_label, stage_of

    lines = [
        table(
            ["node", "kind", "stage", "name"],
            [[n.index, n.kind, stage_of(n.name) if n.name else "", kernel_label(n.name)] for n in info.nodes],
        )
    ]
    lines.append(
        table(
            ["from", "to", "type", "port"],
            [[e.src, e.dst, "programmatic" if e.type == PROGRAMMATIC else "default", e.from_port] for e in info.edges],
        )
    )
    lines.append(
        f"{len(info.nodes)} nodes ({len(info.kernels())} kernels), {len(info.edges)} edges, "
        f"{len(info.programmatic)} programmatic; roots {info.roots}, forks {info.forks}, joins {info.joins}"
    )
    return "\n\n".join(lines)


def run_cpu(args) -> int:
    """The reference step on the CPU: what the GPU step computes, without graphs (under
    DCP, the group of every rank: run_cpu_group)."""
    import torch

    if args.dcp > 1:
        return run_cpu_group(args)

    from .reference import reference_step
    from .state import LayerState

    shape = rank_shape(args)
    batch, context = args.cpu_batch, args.cpu_context
    started = time.perf_counter()
    state = LayerState(shape, max_batch=batch, max_context=context, seed=args.seed)
    inputs = state.inputs(batch, context_lens=None, seed=args.seed + 1)
    out = reference_step(state, inputs)
    elapsed = time.perf_counter() - started
    picked = (out.slots >= 0).sum(dim=1).tolist()
    tokens = [
        dict(
            token=b,
            context=int(inputs.context_lens[b]),
            slots_picked=picked[b],
            q_c_rms=float(out.q_c[b].float().square().mean().sqrt()),
            out_rms=float(out.out[b].square().mean().sqrt()),
            lse_mean=float(out.lse[b].mean()),
        )
        for b in range(batch)
    ]
    if args.json:
        return _print_cpu_record(shape, seconds=elapsed, tokens=tokens)
    print(f"graphstep run: {shape.model.name} {shape.topology.name}, reference step on the CPU")
    print(
        table(
            ["token", "context", "slots picked", "q_c rms", "out rms", "lse mean"], [list(t.values()) for t in tokens]
        )
    )
    print(f"{batch} tokens in {elapsed:.2f} s on the CPU (torch {torch.__version__}).")
    print(
        "Graph capture, PDL and the CuTe DSL kernels need an sm_90 GPU (H100/H200): none was found,"
        " so no graph was built and no latency was measured."
    )
    return 0


def _print_cpu_record(shape, **fields) -> int:
    """`run --json` on the CPU: what ran (model, topology, no graphs) and its fields."""
    import torch

    record = dict(
        model=shape.model.name, topology=shape.topology.name, device="cpu", graphs=False, torch=torch.__version__
    )
    print(json.dumps({**record, **fields}, indent=1))
    return 0


def run_cpu_group(args) -> int:
    """`run --dcp d` on the CPU: a DcpGroup of d ranks (torch backend, eager), each rank's
    step and the combine of their attention into the unsharded layer's."""
    import torch

    from .dcp_group import DcpGroup

    shape = rank_shape(args)
    batch, context = args.cpu_batch, args.cpu_context
    started = time.perf_counter()
    group = DcpGroup(shape, args.dcp, capture_sizes=[batch], max_context=context, seed=args.seed)
    built = time.perf_counter() - started
    inputs = group.unsharded.inputs(batch, context_lens=None, seed=args.seed + 1)
    outputs = group.step(inputs)
    out, lse = group.combine(outputs)
    ranks = [
        dict(rank=r, slots_picked=int((o.slots >= 0).sum()), seconds=group.times[r]) for r, o in enumerate(outputs)
    ]
    tokens = [
        dict(
            token=b,
            context=int(inputs.context_lens[b]),
            out_rms=float(out[b].square().mean().sqrt()),
            lse_mean=float(lse[b].mean()),
        )
        for b in range(batch)
    ]
    if args.json:
        return _print_cpu_record(shape, build_seconds=built, group_seconds=group.group_time, ranks=ranks, tokens=tokens)
    print(f"graphstep run: {shape.model.name} {shape.topology.name}, a DCP group of {args.dcp} ranks on the CPU")
    print(table(["rank", "slots picked", "step s"], [[r["rank"], r["slots_picked"], r["seconds"]] for r in ranks]))
    print(table(["token", "context", "combined out rms", "combined lse mean"], [list(t.values()) for t in tokens]))
    print(
        f"group step: {group.group_time:.3f} s for {batch} tokens (ranks in threads, torch backend, eager; "
        f"built in {built:.1f} s, torch {torch.__version__})."
    )
    return 0


def cmd_ptx(args) -> int:
    """`graphstep ptx`: compile every kernel variant for --arch and write one .ptx each, and with
    --sass its cubin's listing with source lines (no GPU needed)."""
    from .kernels.catalog import write_ptx
    from .shapes import tiled_from

    shape, batch = rank_shape(args), args.batch_size
    tiled = None if batch is None else batch >= tiled_from(shape.heads)
    paths = write_ptx(
        args.out,
        arch=args.arch,
        shape=shape,
        batch=batch,
        tiled=tiled,
        written_one=lambda path: print(path, flush=True),
        sass=args.sass,
    )
    variants = sum(path.suffix == ".ptx" for path in paths)
    print(f"{variants} kernel variants compiled for {args.arch} into {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `graphstep` argument parser, one subcommand per job."""
    parser = argparse.ArgumentParser(prog="graphstep", description=__doc__, formatter_class=Formatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        verb = sub.add_parser(name, help=help, description=help, formatter_class=Formatter)
        add_shape_args(verb, dcps=name == "bench")
        return verb

    info = command("info", "shapes, per-stage bytes and floors")
    info.add_argument("--batch", type=batches, default=[1, 4, 16, 64], help="comma-separated batch sizes")
    info.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    info.add_argument(
        "--bandwidth", type=positive_float, default=floor.H200_COPY_BW / 1e12, help="TB/s the floors are computed at"
    )
    info.add_argument("--json", action="store_true", help="print the sizes and floors as JSON")
    info.set_defaults(func=cmd_info)

    knobs = command("knobs", "each kernel's tuning constants (--knob), their values for this run and types")
    knobs.set_defaults(func=cmd_knobs)

    run = command("run", "build, capture and replay the step (reference on the CPU without an sm_90 GPU)")
    run.add_argument(
        "--batch",
        type=batches,
        default=None,
        help=f"captured sizes, GPU run only (default: {','.join(map(str, RUN_GPU_DEFAULTS['batch']))})",
    )
    run.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help=f"tokens per sequence, GPU run only (default: {RUN_GPU_DEFAULTS['context']})",
    )
    run.add_argument(
        "--policy", default=None, help="a mode or a 'rows:mode,...' table, GPU run only (default: the tables)"
    )
    run.add_argument(
        "--replays",
        type=positive_int,
        default=None,
        help=f"timed replays per size, GPU run only (default: {RUN_GPU_DEFAULTS['replays']})",
    )
    run.add_argument(
        "--bandwidth",
        type=positive_float,
        default=None,
        help=f"TB/s the floor is computed at, GPU run only (default: {RUN_GPU_DEFAULTS['bandwidth']}, the H200's)",
    )
    run.add_argument("--seed", type=seed, default=0, help="seed of the weights and inputs")
    run.add_argument("--cpu", action="store_true", help="run the CPU reference even on a GPU machine")
    run.add_argument(
        "--cpu-batch",
        type=positive_int,
        default=None,
        help=f"tokens of the CPU reference run (default: {RUN_CPU_DEFAULTS['cpu_batch']})",
    )
    run.add_argument(
        "--cpu-context",
        type=positive_int,
        default=None,
        help=f"largest context of the CPU reference run (default: {RUN_CPU_DEFAULTS['cpu_context']})",
    )
    run.add_argument("--json", action="store_true", help="print the results as JSON (the narrative goes to stderr)")
    run.set_defaults(func=cmd_run)

    ptx = command("ptx", "compile every kernel variant and write its PTX (no GPU needed)")
    ptx.add_argument("--arch", default="sm_90a", choices=ARCHS, help="target architecture")
    ptx.add_argument("--out", default="ptx", help="folder for the .ptx files (created if missing)")
    ptx.add_argument(
        "--batch-size", type=positive_int, default=None, help="compile for this batch only (default: every batch)"
    )
    ptx.add_argument(
        "--sass",
        action="store_true",
        help="also write each variant's SASS with source lines (nvdisasm -gi -c of the cubin the DSL built, the one "
        "a GPU runs): where a compute-sanitizer or ncu offset such as +0xd90 falls, found without a GPU",
    )
    ptx.set_defaults(func=cmd_ptx)

    serve = command("serve", "replay a trace of batch sizes as a serving loop and print p50/p99")
    serve.add_argument("--batch", type=batches, default=[1, 2, 4, 8, 16, 24, 32], help="captured sizes")
    serve.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    serve.add_argument("--policy", default=None, help="a mode or a 'rows:mode,...' table (default: the tables)")
    serve.add_argument("--steps", type=positive_int, default=1000, help="steps to replay")
    serve.add_argument("--trace", default=None, help="a file of batch sizes (default: a synthetic drifting trace)")
    serve.add_argument("--seed", type=seed, default=0, help="seed of the weights, inputs and trace")
    serve.add_argument(
        "--unchecked",
        action="store_true",
        help="load without the value checks and their sync (the kernels' guards still record; raised at the end)",
    )
    serve.add_argument("--json", action="store_true", help="print the latencies as JSON")
    serve.set_defaults(func=cmd_serve)

    bench = command("bench", "cute fork / serial / no-PDL vs the torch backend and the floor, per batch")
    bench.add_argument("--batch", type=batches, default=[1, 4, 16, 64], help="captured sizes")
    bench.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    bench.add_argument("--replays", type=positive_int, default=100, help="timed replays per size and variant")
    bench.add_argument(
        "--bandwidth",
        type=positive_float,
        default=floor.H200_COPY_BW / 1e12,
        help="TB/s the floors are computed at (default: the H200's copy rate; an H100's is lower)",
    )
    bench.add_argument("--seed", type=seed, default=0, help="seed of the weights and inputs")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md and bench.png")
    bench.add_argument(
        "--group-only", action="store_true", help="with --dcp > 1: only the table of the DCP group of real ranks"
    )
    bench.set_defaults(func=cmd_bench)

    tune = command("tune", "time every overlap mode per captured size and print the policy table")
    tune.add_argument("--batch", type=batches, default=[1, 2, 4, 8, 16, 32, 64], help="captured sizes")
    tune.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    tune.add_argument("--replays", type=positive_int, default=50, help="timed replays per size and mode")
    tune.add_argument("--seed", type=seed, default=0, help="seed of the weights and inputs")
    tune.set_defaults(func=cmd_tune)

    trace = command("trace", "replay one size under torch.profiler: a Chrome trace and per-kernel times and gaps")
    trace.add_argument(
        "--batch-size", "--batch", dest="batch_size", type=positive_int, default=4, help="the size captured"
    )
    trace.add_argument("--mode", default=None, choices=MODES, help="the overlap mode (default: the policy's)")
    trace.add_argument("--context", type=positive_int, default=8192, help="tokens per sequence")
    trace.add_argument("--replays", type=positive_int, default=20, help="replays recorded")
    trace.add_argument("--seed", type=seed, default=0, help="seed of the weights and inputs")
    trace.add_argument("--out", default="graphstep-trace.json", help="the Chrome/Perfetto trace written")
    trace.add_argument("--json", action="store_true", help="print the table as JSON")
    trace.set_defaults(func=cmd_trace)

    graph = command("graph", "capture one size and print the graph's nodes and edges")
    graph.add_argument(
        "--batch-size", "--batch", dest="batch_size", type=positive_int, default=4, help="the size captured"
    )
    graph.add_argument("--mode", default="fork", choices=MODES, help="the overlap mode")
    graph.add_argument("--context", type=positive_int, default=4096, help="tokens per sequence")
    graph.set_defaults(func=cmd_graph)
    return parser


def check_dcp(dcp: int, tp: int, group: bool) -> None:
    """Refuse a --dcp above MAX_DCP ranks (every command), and for a command that builds a DCP
    group of real ranks (group: run, bench) one that does not divide --tp (the group's unsharded
    layer has tp / dcp; a simulated rank, as info or ptx build, needs no such layer)."""
    if dcp > MAX_DCP:
        raise ValueError(f"--dcp {dcp}: more than {MAX_DCP} ranks (CandidateSync has one lane per rank)")
    if group and dcp > 1 and tp % dcp:
        raise ValueError(f"--dcp {dcp}: --tp {tp} must be a multiple of it (a DCP group's layer has tp / dcp)")


def check_args(args) -> None:
    """Everything the flags alone decide, before any GPU check or allocation."""
    shape = rank_shape(args)  # topology errors (ValueError)
    for dcp in args.dcp if isinstance(args.dcp, list) else [args.dcp]:  # bench: every size of the list
        rank_shape(argparse.Namespace(**dict(vars(args), dcp=dcp)))
        check_dcp(dcp, args.tp, group=args.command in ("bench", "run"))
    for name in ("context", "cpu_context"):
        value = getattr(args, name, None)
        if value is not None and value > shape.model.max_seq_len:
            raise ValueError(
                f"--{name.replace('_', '-')} {value}: more than {shape.model.name}'s {shape.model.max_seq_len} "
                "tokens (ModelShape.max_seq_len, the positions the model is built for)"
            )
    if args.command == "run" and args.dcp > 1 and args.rank != 0:
        raise ValueError(
            f"--rank {args.rank}: run --dcp {args.dcp} runs the whole group (every rank); "
            "--rank picks the rank the other commands simulate"
        )
    if getattr(args, "group_only", False) and max(args.dcp) == 1:
        raise ValueError("--group-only: needs --dcp sizes above 1 (the group of real ranks)")
    if args.command in ("ptx", "bench"):
        writable_dir(args.out, "--out")
    if args.command == "serve":
        if args.trace is not None:  # ('' too: an error, not the synthetic trace)
            from .timing import read_trace

            try:
                trace = read_trace(args.trace)
            except ValueError as error:
                raise ValueError(f"--trace {error}") from None
            if max(trace) > max(args.batch):
                raise ValueError(
                    f"--trace {args.trace}: needs batch {max(trace)} but the largest captured size "
                    f"(--batch) is {max(args.batch)}"
                )
    if args.command in ("serve", "tune"):
        check_policy(args, shape)
    if args.command == "run" and args.policy is not None and args.dcp > 1:
        raise ValueError(
            f"--policy {args.policy!r}: run --dcp {args.dcp} times a group of real ranks, which runs its own fixed "
            "policy (graphstep.dcp_group.GROUP_POLICY); leave --policy out"
        )
    if args.command == "run" and args.policy is not None and not args.cpu:  # (--cpu: refused as GPU-only)
        batch = args.batch or RUN_GPU_DEFAULTS["batch"]
        check_policy(argparse.Namespace(command="run", batch=batch, policy=args.policy), shape)
    if args.command == "trace":
        writable_dir(str(Path(args.out).resolve().parent), "--out")
        if Path(args.out).is_dir():
            raise ValueError(f"--out {args.out}: is a folder; name the trace file")
    if args.command in ("graph", "trace"):
        from .policy import overlap_for

        topo = shape.topology
        try:
            overlap_for(args.batch_size, args.mode, dcp=topo.dcp > 1, wide=topo.wide, split=topo.split)
        except ValueError as error:
            raise ValueError(f"--mode {args.mode}: {error}") from None


def watchdog_seconds() -> float | None:
    """GRAPHSTEP_WATCHDOG as seconds (None when unset): unattended GPU runs dump their stacks and
    exit instead of hanging."""
    text = os.environ.get("GRAPHSTEP_WATCHDOG", "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"GRAPHSTEP_WATCHDOG={text!r}: expected a positive number of seconds")
    return value


def main(argv: list[str] | None = None) -> int:
    """The `graphstep` command: parse, check every flag before any GPU work, run the subcommand;
    returns the exit code."""
    args = build_parser().parse_args(argv)
    seconds = None
    try:
        try:
            seconds = watchdog_seconds()
            check_args(args)
            args.knobs = apply_knobs(args.knob)  # every knob checked before any is set
            if seconds:  # a hung GPU run dumps every thread's stack and exits instead of waiting forever
                faulthandler.dump_traceback_later(seconds, exit=True, file=_fault_file())
            return args.func(args)
        except (ValueError, OSError) as error:
            if isinstance(error, BrokenPipeError):
                raise
            print(f"graphstep {args.command}: {error}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        # the reader went away (`graphstep info | head -2`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        if seconds:  # main() called in a process that goes on (a test, a notebook): not killed later
            faulthandler.cancel_dump_traceback_later()


def _fault_file():
    """Where the watchdog writes the stacks: a file descriptor faulthandler can use (sys.stderr
    replaced by an object without one, as pytest's capture or a notebook does, has none)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


if __name__ == "__main__":
    sys.exit(main())
