"""The `graphstep` command line."""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

from . import floor
from .report import mb, table
from .shapes import PRESETS, RankShape, Topology, preset


def sm90_device() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def add_shape_args(parser: argparse.ArgumentParser, tp: int = 8) -> None:
    parser.add_argument("--preset", default="deepseek-v3.2", choices=sorted(PRESETS))
    parser.add_argument("--tp", type=int, default=tp, help="tensor-parallel size (heads per rank = heads / tp)")
    parser.add_argument("--dcp", type=int, default=1, help="decode context-parallel size")
    parser.add_argument("--rank", type=int, default=0, help="the DCP rank simulated")
    parser.add_argument("--wide", action="store_true", help="TP1's split query")
    parser.add_argument("--split", action="store_true", help="the split query under DCP")
    parser.add_argument("--q-format", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--mla-cache", default="bf16", choices=["bf16", "fp8"])


def rank_shape(args) -> RankShape:
    topology = Topology(tp=args.tp, dcp=args.dcp, wide=args.wide, split=args.split, rank=args.rank,
                        q_format=args.q_format, mla_cache=args.mla_cache)
    return RankShape(preset(args.preset), topology)


def batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return values


def cmd_info(args) -> int:
    shape = rank_shape(args)
    m, t = shape.model, shape.topology
    print(f"{m.name} ({t.name}); assumed: {', '.join(m.assumed) or 'nothing'}")
    print(table(["size", "value"], [
        ["heads per rank / gathered / q_heads", f"{shape.heads} / {shape.gathered} / {shape.q_heads}"],
        ["q_lora / kv_lora / nope / rope", f"{m.q_lora_rank} / {m.kv_lora_rank} / {m.qk_nope_dim} / {m.qk_rope_dim}"],
        ["query row / q_bytes / mailbox chunks per row", f"{m.query_row} / {shape.q_bytes} / {shape.mailbox_row_chunks}"],
        ["packed row P", m.packed_width],
        ["indexer heads x dim, top-k", f"{m.index_heads} x {m.index_dim}, {m.index_topk}"],
        ["indexer / MLA cache bytes per token", f"{m.index_token_bytes} / {shape.mla_token_bytes}"],
    ]))
    for batch in args.batch:
        step = floor.step_floor(shape, batch, args.context, args.bandwidth * 1e12)
        print(f"\nbatch {batch}, context {args.context}, {args.bandwidth} TB/s")
        rows = [[c.name, c.stream, round(mb(c.weight_bytes), 2), round(mb(c.io_bytes), 2),
                 round(c.flops / 1e9, 3), c.floor_us(step.bandwidth)] for c in step.costs]
        rows.append(["step (each tensor once)", "", "", round(mb(step.bytes), 2), "", step.us])
        rows.append(["indexer floor (wq_b + cache)", "main", "", round(mb(step.indexer_bytes), 2), "", step.indexer_us])
        print(table(["stage", "stream", "weights MB", "io MB", "GFLOP", "floor us"], rows))
    return 0


def cmd_run(args) -> int:
    if sm90_device() and not args.cpu:
        from .timing import run_gpu

        return run_gpu(args)
    return run_cpu(args)


def _needs_gpu(command: str) -> None:
    if not sm90_device():
        raise SystemExit(f"graphstep {command}: needs an sm_90 GPU (H100/H200) for graph capture; none was found")


def cmd_serve(args) -> int:
    _needs_gpu("serve")
    from .timing import serve

    return serve(args)


def cmd_bench(args) -> int:
    _needs_gpu("bench")
    from .timing import bench

    return bench(args)


def cmd_tune(args) -> int:
    _needs_gpu("tune")
    from .timing import tune

    return tune(args)


def cmd_graph(args) -> int:
    _needs_gpu("graph")
    from .graphs import describe, inspect
    from .step import DecodeStep

    step = DecodeStep(rank_shape(args), capture_sizes=[args.batch_size], policy=args.mode, max_context=args.context)
    step.capture(keep_graph=True)
    print(f"batch {args.batch_size}, mode {step.modes[args.batch_size]}, backend {step.backend}")
    print(describe(inspect(step.graph(args.batch_size))))
    return 0


def run_cpu(args) -> int:
    """The reference step on the CPU: what the GPU step computes, without graphs."""
    import torch

    from .reference import reference_step
    from .state import LayerState

    shape = rank_shape(args)
    batch, context = args.cpu_batch, args.cpu_context
    started = time.perf_counter()
    state = LayerState(shape, max_batch=batch, max_context=context, seed=args.seed)
    inputs = state.inputs(batch, context_lens=None, seed=args.seed + 1)
    peers = state.peer_inputs(inputs, seed=args.seed + 2) if shape.topology.dcp > 1 else None
    out = reference_step(state, inputs, peers=peers)
    elapsed = time.perf_counter() - started
    picked = (out.slots >= 0).sum(dim=1).tolist()
    print(f"graphstep run: {shape.model.name} {shape.topology.name}, reference step on the CPU")
    print(table(["token", "context", "slots picked", "q_c rms", "out rms", "lse mean"], [
        [b, int(inputs.context_lens[b]), picked[b], float(out.q_c[b].float().square().mean().sqrt()),
         float(out.out[b].square().mean().sqrt()), float(out.lse[b].mean())] for b in range(batch)
    ]))
    print(f"{batch} tokens in {elapsed:.2f} s on the CPU (torch {torch.__version__}).")
    print("Graph capture, PDL and the CuTe DSL kernels need an sm_90 GPU (H100/H200): none was found,"
          " so no graph was built and no latency was measured.")
    return 0


def cmd_ptx(args) -> int:
    from .kernels.catalog import write_ptx

    paths = write_ptx(args.out, arch=args.arch, shape=rank_shape(args), batch=args.batch_size)
    for path in paths:
        print(path)
    print(f"{len(paths)} kernel variants compiled for {args.arch} into {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphstep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="shapes, per-stage bytes and floors")
    add_shape_args(info)
    info.add_argument("--batch", type=batches, default=[1, 4, 16, 64], help="comma-separated batch sizes")
    info.add_argument("--context", type=int, default=32768)
    info.add_argument("--bandwidth", type=float, default=floor.H200_COPY_BW / 1e12, help="TB/s")
    info.set_defaults(func=cmd_info)

    run = sub.add_parser("run", help="build, capture and replay the step (reference on the CPU without an sm_90 GPU)")
    add_shape_args(run)
    run.add_argument("--batch", type=batches, default=[1, 4, 16, 64])
    run.add_argument("--context", type=int, default=32768)
    run.add_argument("--policy", default=None, help="a mode or a 'rows:mode,...' table")
    run.add_argument("--replays", type=int, default=200)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--cpu", action="store_true", help="run the CPU reference even on a GPU machine")
    run.add_argument("--cpu-batch", type=int, default=4)
    run.add_argument("--cpu-context", type=int, default=4096)
    run.set_defaults(func=cmd_run)

    ptx = sub.add_parser("ptx", help="compile every kernel variant and write its PTX (no GPU needed)")
    add_shape_args(ptx)
    ptx.add_argument("--arch", default="sm_90a")
    ptx.add_argument("--out", default="ptx")
    ptx.add_argument("--batch-size", type=int, default=None, help="compile for this batch only")
    ptx.set_defaults(func=cmd_ptx)

    serve = sub.add_parser("serve", help="replay a trace of batch sizes as a serving loop and print p50/p99")
    add_shape_args(serve)
    serve.add_argument("--batch", type=batches, default=[1, 2, 4, 8, 16, 24, 32], help="captured sizes")
    serve.add_argument("--context", type=int, default=32768)
    serve.add_argument("--policy", default=None)
    serve.add_argument("--steps", type=int, default=1000)
    serve.add_argument("--trace", default=None, help="a file of batch sizes (default: a synthetic drifting trace)")
    serve.add_argument("--seed", type=int, default=0)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="cute fork / serial / no-PDL vs the torch backend and the floor, per batch")
    add_shape_args(bench)
    bench.add_argument("--batch", type=batches, default=[1, 4, 16, 64])
    bench.add_argument("--context", type=int, default=32768)
    bench.add_argument("--replays", type=int, default=100)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md and bench.png")
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser("tune", help="time every overlap mode per captured size and print the policy table")
    add_shape_args(tune)
    tune.add_argument("--batch", type=batches, default=[1, 2, 4, 8, 16, 32, 64])
    tune.add_argument("--context", type=int, default=32768)
    tune.add_argument("--replays", type=int, default=50)
    tune.add_argument("--seed", type=int, default=0)
    tune.set_defaults(func=cmd_tune)

    graph = sub.add_parser("graph", help="capture one size and print the graph's nodes and edges")
    add_shape_args(graph)
    graph.add_argument("--batch-size", "--batch", dest="batch_size", type=int, default=4)
    graph.add_argument("--mode", default="fork", help="serial, fork or fork_poll")
    graph.add_argument("--context", type=int, default=4096)
    graph.set_defaults(func=cmd_graph)

    args = parser.parse_args(argv)
    watchdog = os.environ.get("GRAPHSTEP_WATCHDOG")
    if watchdog:  # a hung GPU run dumps every thread's stack and exits instead of waiting forever
        faulthandler.dump_traceback_later(float(watchdog), exit=True)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"graphstep {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
