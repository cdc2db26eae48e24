"""Per-kernel times of the query-stage kernels in CUDA graphs, against plain torch.

    python bench/bench_kernels.py [--heads 16,128] [--batch 1,4,16,64,128] [--json out.json]
        [--knob KERNEL.NAME=VALUE ...]  (as graphstep's; the other benchmarks that use parse_args too)

Each measurement captures a graph of `launches` back-to-back launches (PDL-chained for
the CuTe DSL kernels) over rotating copies of the weights whose total exceeds the L2
(so every launch streams its weights from HBM, as a real decode layer does), replays it
`replays` times between CUDA events, and reports the median time per launch. Effective
bandwidth = (weights + activations moved) / time, against 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys

import torch
from graphstep.kernels import mla_query

from graphstep import formats
from graphstep.cli import apply_knobs
from graphstep.floor import H200_COPY_BW, stage_costs
from graphstep.launch import ErrorWord, Kernels
from graphstep.report import table
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState
from graphstep.timing import L2_BYTES


def graph_time_us(body, launches: int, replays: int = 20) -> float:
    """Median per-launch time of `body()` (which launches `launches` times) in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


class Copies:
    """Enough weight copies that one pass over them exceeds the L2."""

    def __init__(self, state: LayerState, count: int):
        self.states = [state] + [
            LayerState(state.shape, state.max_batch, state.max_context, seed=state.seed + i + 1, device="cuda")
            for i in range(count - 1)
        ]
        self.kernels = [Kernels(s.shape, s.weights, pdl=True) for s in self.states]
        self.kernels_nopdl = [Kernels(s.shape, s.weights, pdl=False) for s in self.states]


def bench_shape(heads_tp: int, batches: list[int], launches_per_copy: int = 4) -> list[dict]:
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=128 // heads_tp))
    max_batch = max(batches)
    state = LayerState(shape, max_batch=max_batch, max_context=4096, seed=1, device="cuda")
    weight_bytes = next(c for c in stage_costs(shape, 1, 4096) if c.name == "mla_query").weight_bytes
    copies = Copies(state, max(2, int(2 * L2_BYTES // weight_bytes) + 1))
    for k in copies.kernels + copies.kernels_nopdl:
        k.warm()
    rows = []
    n = len(copies.states) * launches_per_copy
    for batch in batches:
        inputs = state.inputs(batch, context_lens=4096)
        qc = torch.empty(batch, 1536, dtype=torch.bfloat16, device="cuda")
        qc_private = torch.empty_like(qc)
        ws = torch.empty(batch, shape.heads, 192, device="cuda")
        q_rows = formats.arm(torch.empty(batch, shape.q_heads, 1152, dtype=torch.uint8, device="cuda"))
        cache = state.caches.mla_cache
        error = ErrorWord.new("cuda")

        def norm(kset):
            def body():
                for i in range(n):
                    kset[i % len(kset)].query_norm(inputs.qkv, qc, batch)

            return body

        def mla(kset):
            def body():
                for i in range(n):
                    kset[i % len(kset)].mla_query(
                        inputs.qkv,
                        inputs.context_lens,
                        inputs.slot_mapping,
                        qc,
                        qc_private,
                        ws,
                        q_rows,
                        cache,
                        error,
                        batch,
                        store_qc=False,
                        poll=False,
                    )

            return body

        def mla_streamed(kset):
            """MlaQuery with the streamed project (mla_query_stream) wherever the batch allows
            (<= 64 tokens; kernels/mla_query.py STREAM_FROM_HEADS), captured with it forced on."""
            plain = mla(kset)

            def body():
                saved, mla_query.STREAM_FROM_HEADS = mla_query.STREAM_FROM_HEADS, 1
                try:
                    plain()
                finally:
                    mla_query.STREAM_FROM_HEADS = saved

            return body

        def torch_mla():
            pos = inputs.positions
            w_sets = [s.weights for s in copies.states]
            out = torch.empty(batch, shape.heads, 576, dtype=torch.bfloat16, device="cuda")
            flat = cache.view(-1, 576)
            slots = inputs.slot_mapping.long()

            def body():
                for i in range(n):
                    w = w_sets[i % len(w_sets)]
                    x = inputs.qkv[:, :1536]
                    q_c = torch.nn.functional.rms_norm(x, (1536,), w.gamma_q, 1e-6)
                    q = torch.nn.functional.linear(q_c, w.w_qb).view(batch, shape.heads, 192)
                    latent = torch.bmm(q[..., :128].transpose(0, 1), w.w_uk).transpose(0, 1)
                    rope = formats.rope_interleaved(
                        q[..., 128:].float(), w.rope_cos[pos][:, None], w.rope_sin[pos][:, None]
                    )
                    out[..., :512] = latent
                    out[..., 512:] = rope
                    kv = torch.nn.functional.rms_norm(inputs.qkv[:, 1536:2048], (512,), w.gamma_kv, 1e-6)
                    k_pe = formats.rope_interleaved(inputs.qkv[:, 2048:2112].float(), w.rope_cos[pos], w.rope_sin[pos])
                    flat.index_copy_(0, slots, torch.cat([kv, k_pe.bfloat16()], dim=-1))

            return body

        def cublas_qb_uk():
            """The bar of issue 3: cuBLAS Q_B GEMM + the W_UK bmm alone."""
            w_sets = [s.weights for s in copies.states]

            def body():
                for i in range(n):
                    w = w_sets[i % len(w_sets)]
                    q = torch.nn.functional.linear(qc, w.w_qb).view(batch, shape.heads, 192)
                    torch.bmm(q[..., :128].transpose(0, 1), w.w_uk)

            return body

        def torch_norm():
            w_sets = [s.weights for s in copies.states]

            def body():
                for i in range(n):
                    torch.nn.functional.rms_norm(inputs.qkv[:, :1536], (1536,), w_sets[i % len(w_sets)].gamma_q, 1e-6)

            return body

        cost = next(c for c in stage_costs(shape, batch, 4096) if c.name == "mla_query")
        bodies = {
            "query_norm_pdl": norm(copies.kernels),
            "query_norm_nopdl": norm(copies.kernels_nopdl),
            "torch_rmsnorm": torch_norm(),
            "mla_query_pdl": mla(copies.kernels),
            "mla_query_nopdl": mla(copies.kernels_nopdl),
            "mla_query_streamed": mla_streamed(copies.kernels),
            "torch_mla_query": torch_mla(),
            "cublas_qb_uk": cublas_qb_uk(),
        }
        t = {}
        for name, body in bodies.items():
            print(f"  H={shape.heads} B={batch} {name} ...", file=sys.stderr, flush=True)
            t[name] = graph_time_us(body, n)
        floor_us = cost.bytes / H200_COPY_BW * 1e6
        rows.append(
            dict(
                heads=shape.heads,
                batch=batch,
                floor_us=floor_us,
                mla_bw_frac=cost.bytes / (t["mla_query_pdl"] * 1e-6) / H200_COPY_BW,
                **t,
            )
        )
        print(
            f"  H={shape.heads} B={batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()),
            file=sys.stderr,
            flush=True,
        )
    return rows


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmarks' shared flags (--json, --watchdog, --knob), parsed; the knobs set on
    their kernel modules (printed), the watchdog started."""
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--watchdog", type=float, default=0, help="seconds before dumping stacks and exiting")
    parser.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="KERNEL.NAME=VALUE",
        help="set a kernel module's tuning constant for this run, as graphstep's --knob "
        "(e.g. sparse_core.COMBINE_WARP_SPLITS=2; repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        knobs = apply_knobs(args.knob)
    except ValueError as error:
        parser.error(str(error))
    if knobs:
        print("knobs: " + ", ".join(f"{name}={value!r}" for name, value in knobs.items()))
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    return args


def report(rows: list[dict], headers: list[str], cells: list[list], caption: str, json_path: str | None) -> None:
    """Print a benchmark's markdown table and caption; write its rows as JSON if asked."""
    print(table(headers, cells, markdown=True))
    print(caption)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--batch", default="1,4,16,64,128")
    args = parse_args(parser)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        rows += bench_shape(heads, batches)
    headers = [
        "H",
        "B",
        "norm pdl",
        "norm no-pdl",
        "torch norm",
        "mla pdl",
        "mla no-pdl",
        "mla streamed",
        "cublas qb+uk",
        "torch mla",
        "mla floor",
        "mla %4.3TB/s",
        "cublas/mla",
        "torch/mla",
    ]
    report(
        rows,
        headers,
        [
            [
                r["heads"],
                r["batch"],
                r["query_norm_pdl"],
                r["query_norm_nopdl"],
                r["torch_rmsnorm"],
                r["mla_query_pdl"],
                r["mla_query_nopdl"],
                r["mla_query_streamed"],
                r["cublas_qb_uk"],
                r["torch_mla_query"],
                r["floor_us"],
                round(100 * r["mla_bw_frac"], 1),
                round(r["cublas_qb_uk"] / r["mla_query_pdl"], 2),
                round(r["torch_mla_query"] / r["mla_query_pdl"], 2),
            ]
            for r in rows
        ],
        "times in us per launch (median of graph replays); mla streamed: MlaQuery with its streamed project "
        "(kernels/mla_query.py mla_query_stream) at B <= 64, the register kernel above",
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
