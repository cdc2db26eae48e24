"""The cost of the fork's join in the captured step, and whether the type of its edges moves it.

In fork mode the sparse core's kernel node has two predecessors: TopK on the main stream and
MlaQuery's last kernel on the side stream, both programmatic (PDL) edges as captured. Session
15's trace (`graphstep trace`, 32K, B = 1 / 4) showed SparseCore's partial kernel starting
1.4-1.7 us after TopK ended, where every single-predecessor kernel of the chain started under
its predecessor. This script times the same step's graph (captured with keep_graph, edited
before its first replay, so each variant is instantiated once) as captured, with the side
stream's edge into the join turned into a full (default) edge, and with both join edges full;
fork_poll (the sparse core polls its query rows and the side stream joins after it: no join
before it), fork_poll with one stream's kernel nodes at the device's highest scheduling
priority (--first main: IndexQuery's CTAs placed before MlaQuery's pending ones; --first side:
MlaQuery's first, the longer branch at TP 1), and the serial mode (no side stream) beside them.
`--variant` instead times fork_poll as captured against fork_poll edited: some kernel nodes at
the highest priority, the side stream started after a main-stream kernel, or both.
Run on an sm_90 GPU:

    python3 bench/bench_join.py --context 32768 --batch 1,4,16,64
    python3 bench/bench_join.py --tp 1 --mla-cache fp8 --batch 1,4 --variant side-after=index_query
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from cuda.bindings import driver as cu

from graphstep.graphs import PROGRAMMATIC, _ok, kernel_name
from graphstep.report import table
from graphstep.shapes import RankShape, Topology, preset
from graphstep.step import DecodeStep
from graphstep.timing import load_batch, replay_us

SIDE = ("mla_query", "query_wait")  # the side stream's kernels (by name fragment)
SIDE_NORM = "query_norm_"  # in the fork modes QueryNorm's own kernel is MlaQuery's (the main stream's is KeyAndNorm)


def _edge(type_: int):
    data = cu.CUgraphEdgeData()
    data.type = type_
    return data


def _with_edge_data(name: str):
    """The driver call that takes edge data: `name` in CUDA 13's bindings, `name`_v2 in 12's."""
    return getattr(cu, name + "_v2", None) or getattr(cu, name)


def retype_join(graph, which: str) -> list[str]:
    """Turn edges into each join node (a kernel node with several predecessors) into full
    edges: which = "side" (only those from the side stream's kernels) or "both". Returns the
    edited edges as 'src -> dst' names."""
    handle = cu.CUgraph(graph.raw_cuda_graph())
    _, _, _, count = _ok(cu.cuGraphGetEdges(handle, 0))
    src, dst, data, _ = _ok(cu.cuGraphGetEdges(handle, count))

    def name(node) -> str:
        if _ok(cu.cuGraphNodeGetType(node)) != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            return "-"
        return kernel_name(node).removeprefix("kernel_cutlass_")[:40]

    into: dict[int, list[int]] = {}
    for i, b in enumerate(dst):
        into.setdefault(int(b), []).append(i)
    edited = []
    for edges in into.values():
        if len(edges) < 2:
            continue
        for i in edges:
            if int(data[i].type) != PROGRAMMATIC:
                continue
            if which == "side" and not any(s in name(src[i]) for s in SIDE):
                continue
            _ok(_with_edge_data("cuGraphRemoveDependencies")(handle, [src[i]], [dst[i]], [data[i]], 1))
            _ok(_with_edge_data("cuGraphAddDependencies")(handle, [src[i]], [dst[i]], [_edge(0)], 1))
            edited.append(f"{name(src[i])} -> {name(dst[i])}")
    return edited


def _kernel_nodes(graph):
    handle = cu.CUgraph(graph.raw_cuda_graph())
    _, count = _ok(cu.cuGraphGetNodes(handle, 0))
    nodes, _ = _ok(cu.cuGraphGetNodes(handle, count))
    for node in nodes:
        if _ok(cu.cuGraphNodeGetType(node)) == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            yield node, kernel_name(node).removeprefix("kernel_cutlass_")


def raise_nodes(graph, chosen) -> list[str]:
    """Give the kernel nodes whose names `chosen(name)` picks the device's highest scheduling
    priority (the rest keep the default, the lowest); returns the names raised."""
    _, _, greatest = cu.cuCtxGetStreamPriorityRange()
    value = cu.CUkernelNodeAttrValue()
    value.priority = greatest
    raised = []
    for node, name in _kernel_nodes(graph):
        if chosen(name):
            _ok(cu.cuGraphKernelNodeSetAttribute(node, cu.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_PRIORITY, value))
            raised.append(name[:24])
    return raised


def prioritize(graph, first: str) -> list[str]:
    """Raise one stream's kernel nodes (first: "main" or "side") over the other's."""

    def on_side(name: str) -> bool:
        return any(s in name for s in SIDE) or name.startswith(SIDE_NORM)

    return raise_nodes(graph, lambda name: on_side(name) == (first == "side"))


def delay_side(graph, after: str = "index_query") -> list[str]:
    """Make the side stream start after the kernel node named `after` (a prefix): a full edge
    from it to the side stream's first kernel (its QueryNorm). after = "index_query": MlaQuery's
    Q_B stream no longer shares HBM with IndexQuery's weight stream (levers.md L.4 C3).
    Returns the edges added."""
    nodes = list(_kernel_nodes(graph))
    src = [node for node, name in nodes if name.startswith(after)]
    dst = [node for node, name in nodes if name.startswith(SIDE_NORM)]
    if len(src) != 1 or len(dst) != 1:
        raise SystemExit(f"delay_side: expected one {after} and one side QueryNorm node, got {len(src)}, {len(dst)}")
    handle = cu.CUgraph(graph.raw_cuda_graph())
    _ok(_with_edge_data("cuGraphAddDependencies")(handle, src, dst, [_edge(0)], 1))
    return [f"{kernel_name(src[0])[:40]} -> {kernel_name(dst[0])[:40]}"]


def edit(graph, variant: str) -> list[str]:
    """Apply a --variant to a fork_poll graph: ";"-joined items "raise=PREFIX,PREFIX" (those
    kernel nodes at the highest priority) and "side-after=PREFIX" (delay_side)."""
    done = []
    for item in filter(None, variant.split(";")):
        key, _, value = item.partition("=")
        if key == "raise":
            prefixes = tuple(p for p in value.split(",") if p)
            raised = raise_nodes(graph, lambda name: name.startswith(prefixes))
            if not raised:
                raise SystemExit(f"--variant {variant}: no kernel node starts with {value}")
            done += [f"raised {name}" for name in raised]
        elif key == "side-after":
            done += delay_side(graph, value)
        else:
            raise SystemExit(f"--variant item {item!r}: expected raise=PREFIX,... or side-after=PREFIX")
    return done


def interleaved(graphs: dict, size: int, context: int, runs: int, replays: int) -> dict[str, list[float]]:
    """Median us per replay of each labelled (step, mode) graph at batch `size`, the graphs
    taken in turn `runs` times (a drift of the card shows as a spread)."""
    for step in {id(step): step for step, _ in graphs.values()}.values():
        load_batch(step, size, context)
    times = {label: [] for label in graphs}
    for _ in range(runs):
        for label, (step, mode) in graphs.items():
            times[label].append(statistics.median(replay_us(step, size, mode, replays)))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--first", choices=("main", "side"), default="main", help="the stream prioritized")
    parser.add_argument("--mla-cache", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="SPEC",
        help="only fork_poll as captured against fork_poll edited so (repeatable: one variant each): ';'-joined "
        "'raise=PREFIX,PREFIX' (those kernel nodes at the highest priority) and 'side-after=PREFIX' (the side "
        "stream's first kernel after that node), e.g. 'side-after=key_and_query_norm;raise=index_query'",
    )
    parser.add_argument("--late-side", action="store_true", help="the same as --variant side-after=index_query")
    args = parser.parse_args()
    if args.late_side:
        args.variant.append("side-after=index_query")
    if args.variant:
        return main_variants(args)
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=args.tp, mla_cache=args.mla_cache))
    variants = {"as captured": None, "side edge full": "side", "both join edges full": "both"}
    steps = {}
    for label, which in variants.items():
        step = DecodeStep(shape, capture_sizes=args.batch, policy="fork", max_context=args.context)
        step.capture(modes=("serial", "fork_poll"), keep_graph=True)
        for size in args.batch:
            if which:
                edited = retype_join(step.graph(size, "fork"), which)
                print(f"{label}, B = {size}: {edited}", file=sys.stderr)
            if label == "side edge full":  # this step's fork_poll graphs: one stream first
                print(f"{args.first} first, B = {size}: {prioritize(step.graph(size, 'fork_poll'), args.first)}")
        steps[label] = step
    first = f"fork_poll, {args.first} first"
    graphs = {label: (step, "fork") for label, step in steps.items()}
    graphs |= {"fork_poll": (steps["as captured"], "fork_poll"), first: (steps["side edge full"], "fork_poll")}
    graphs["serial"] = (steps["as captured"], "serial")
    rows = []
    for size in args.batch:
        # interleaved twice, so a drift of the card shows as a spread
        times = interleaved(graphs, size, args.context, 2, args.replays)
        rows.append([size, *[" / ".join(f"{t:.1f}" for t in found) for found in times.values()]])
    print(table(["B", *[f"fork, {label}" for label in variants], "fork_poll", first, "serial"], rows))
    print(f"TP {args.tp}, context {args.context}, us per replay (median of {args.replays}), two interleaved runs each")
    return 0


def main_variants(args) -> int:
    """fork_poll as captured against fork_poll edited by each --variant, each graph
    instantiated once, replays interleaved three times. Session 34's trace (TP 1 fp8, B = 1):
    MlaQuery's streamed project (384 CTAs, two an SM) is placed first and holds every SM, so
    the main stream's KeyAndNorm starts ~10 us into the step and IndexQuery at ~21."""
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=args.tp, mla_cache=args.mla_cache))
    steps = {}
    for label in ("as captured", *args.variant):
        step = DecodeStep(shape, capture_sizes=args.batch, policy="fork_poll", max_context=args.context)
        step.capture(modes=("fork_poll",), keep_graph=True)
        if label != "as captured":
            for size in args.batch:
                print(f"{label}, B = {size}: {edit(step.graph(size, 'fork_poll'), label)}", file=sys.stderr)
        steps[label] = step
    graphs = {label: (step, "fork_poll") for label, step in steps.items()}
    rows = []
    for size in args.batch:
        times = interleaved(graphs, size, args.context, 3, args.replays)
        rows.append([size, *[" / ".join(f"{t:.1f}" for t in found) for found in times.values()]])
    print(table(["B", *[f"fork_poll, {label}" for label in steps]], rows))
    print(
        f"TP {args.tp} {args.mla_cache} cache, context {args.context}, us per replay (median of {args.replays}), "
        "three interleaved runs"
    )
    return 0


if __name__ == "__main__":
    torch.cuda.init()
    sys.exit(main())
