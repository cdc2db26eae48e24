"""DcpMerge alone: us per launch in a CUDA graph, against the reference's set.

    python bench/bench_dcp_merge.py [--preset kimi-k3.1] [--dcp 2,4] [--batch 1,4,16,64]
        [--context 32768] [--launches 10] [--json out.json]

Inputs as the step's: this rank's candidates are TopK's output over random scores of its
local length (ascending positions, -inf padded), the other ranks' are `LayerState.peer_inputs`
(the simulated peers of `graphstep bench --dcp`). Each row also checks the merged slots
against `graphstep.reference.merge_ranks` (exact, `torch.equal`) before timing, so a fast wrong variant
cannot produce a number. The trace of the Kimi K3.1 DCP 2 step placed ~13 us of DcpMerge's
own time on the B = 1 chain (H100, session 40: bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_kernels import graph_time_us, parse_args, report

from graphstep.launch import Kernels
from graphstep.reference import Candidates, merge_ranks
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState, local_lens


def bench_one(model: str, dcp: int, batch: int, context: int, launches: int) -> dict:
    shape = RankShape(preset(model), Topology(tp=8, dcp=dcp, rank=0))
    state = LayerState(shape, max_batch=batch, max_context=context, seed=1, device="cuda")
    kernels = Kernels(shape, state.weights, pdl=True)
    inputs = state.inputs(batch, context_lens=context, seed=0)
    tables, lens, k = inputs.block_tables, inputs.context_lens, shape.model.index_topk
    scores = torch.randn(batch, tables.shape[1] * shape.model.page_size, device="cuda")
    local = local_lens(lens, dcp, shape.topology.rank)
    scores[torch.arange(scores.shape[1], device="cuda")[None] >= local[:, None]] = float("-inf")
    positions = torch.full((batch, k), -1, dtype=torch.int32, device="cuda")
    own_scores = torch.full((batch, k), float("-inf"), device="cuda")
    kernels.top_k(scores, tables, lens, positions, own_scores, batch)
    peers = state.peer_inputs(inputs, seed=0)
    merged = torch.full((batch, k), -7, dtype=torch.int32, device="cuda")  # poisoned: every element is written

    def body(n: int = 1) -> None:
        for _ in range(n):
            kernels.dcp_merge(positions, own_scores, peers.positions, peers.scores, tables, merged, batch)

    body()
    torch.cuda.synchronize()
    want = merge_ranks(state, Candidates(positions, own_scores), peers.positions, peers.scores, tables)
    exact = torch.equal(merged.cpu(), want.cpu())
    us = graph_time_us(lambda: body(launches), launches) if exact else float("nan")
    return {"model": model, "dcp": dcp, "batch": batch, "context": context, "us": us, "exact": exact}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="kimi-k3.1")
    parser.add_argument("--dcp", default="2,4")
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--launches", type=int, default=10)
    args = parse_args(parser)
    rows = [
        bench_one(args.preset, int(d), int(b), args.context, args.launches)
        for d in args.dcp.split(",")
        for b in args.batch.split(",")
    ]
    cells = [[r["dcp"], r["batch"], f"{r['us']:.2f}", "yes" if r["exact"] else "NO"] for r in rows]
    report(
        rows,
        ["dcp", "batch", "us per launch", "exact"],
        cells,
        f"DcpMerge, {args.preset}, context {args.context}, {torch.cuda.get_device_name()} "
        f"(graph of {args.launches} PDL-chained launches; rank 0)",
        args.json,
    )
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
