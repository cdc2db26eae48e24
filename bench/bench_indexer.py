"""The indexer path's kernels (IndexQuery's wq_b, DsaIndex scoring, TopK) against plain
torch (cuBLAS GEMM, fp32 bmm over the dequantized cache, torch.topk), in CUDA graphs.

    python bench/bench_indexer.py [--batch 1,4,16,64] [--context 4096,32768,131072] [--json out.json]
                                  [--runs 2,4,8,16,32]

"score" times DsaIndex with the host's pages-per-CTA pick (`dsa_index.pages_per_cta`, the
"run" column); --runs also times every listed run and prints them in a second table, to
tune the host's table on the device.

Each time is the median over graph replays of `launches` back-to-back launches. wq_b
rotates over enough weight copies and scoring over enough cache copies that each launch
streams from HBM, not L2; top-k reads the scores the scorer just wrote (L2-warm when they
fit, as in a step). Bandwidth = bytes the stage must move / time, against 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from bench_kernels import L2_BYTES, graph_time_us, parse_args, report
from graphstep import reference as ref, torch_stages
from graphstep.floor import H200_COPY_BW, stage_costs
from graphstep.kernels.dsa_index import pages_per_cta
from graphstep.launch import Kernels
from graphstep.report import table
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState


def copies_for(nbytes: int) -> int:
    return max(1, int(2 * L2_BYTES // nbytes) + 1)


def bench_context(shape: RankShape, context: int, batches: list[int], launches: int = 8,
                  runs: tuple[int, ...] = ()) -> list[dict]:
    m = shape.model
    state = LayerState(shape, max_batch=max(batches), max_context=context, seed=3, device="cuda")
    w = state.weights
    weight_sets = [w] + [dataclasses.replace(w, wq_b_index=w.wq_b_index.clone()) for _ in range(copies_for(25e6) - 1)]
    kernel_sets = [Kernels(shape, ws) for ws in weight_sets]
    rows = []
    for batch in batches:
        inputs = state.inputs(batch, context_lens=context)
        cache_bytes = batch * context * m.index_token_bytes
        caches = [state.caches.index_cache] + [state.caches.index_cache.clone()
                                              for _ in range(min(copies_for(cache_bytes), 8) - 1)]
        width = state.pages_per_seq * m.page_size
        qc = torch.randn(batch, m.q_lora_rank, device="cuda").bfloat16()
        q8 = torch.empty(batch, m.index_heads, m.index_dim, dtype=torch.uint8, device="cuda")
        hw = torch.empty(batch, m.index_heads, device="cuda")
        scores = torch.empty(batch, width, device="cuda")
        slots = torch.empty(batch, m.index_topk, dtype=torch.int32, device="cuda")
        unused = torch.empty(batch, m.index_topk, device="cuda")
        tables, lens = inputs.block_tables, inputs.context_lens
        k0 = kernel_sets[0]

        def ours_wq_b():
            for i in range(launches):
                kernel_sets[i % len(kernel_sets)].index_query(qc, inputs.qkv, lens, q8, hw, batch)

        def ours_score():
            for i in range(launches):
                k0.dsa_index(q8, hw, caches[i % len(caches)], tables, lens, scores, batch)

        def ours_top_k():
            for _ in range(launches):
                k0.top_k(scores, tables, lens, slots, unused, batch)

        def ours_path():
            for i in range(launches):
                k = kernel_sets[i % len(kernel_sets)]
                k.index_query(qc, inputs.qkv, lens, q8, hw, batch)
                k.dsa_index(q8, hw, caches[i % len(caches)], tables, lens, scores, batch)
                k.top_k(scores, tables, lens, slots, unused, batch)

        def torch_wq_b():
            for i in range(launches):
                torch.nn.functional.linear(qc, weight_sets[i % len(weight_sets)].wq_b_index)

        def torch_score():
            for i in range(min(launches, 2)):
                cs = dataclasses.replace(state.caches, index_cache=caches[i % len(caches)])
                torch_stages.index_scores(state, cs, inputs, q8, hw)

        def torch_top_k():
            for _ in range(launches):
                torch_stages.topk_indices(scores, m.index_topk)

        def torch_path():
            for i in range(min(launches, 2)):
                cs = dataclasses.replace(state.caches, index_cache=caches[i % len(caches)])
                q = torch.nn.functional.linear(qc, weight_sets[i % len(weight_sets)].wq_b_index)
                qf, hwf = ref.index_query_from(state, inputs, q)
                s = torch_stages.index_scores(state, cs, inputs, qf, hwf)
                ref.to_slots(torch_stages.topk_indices(s, m.index_topk), tables, m.page_size)

        t = {}
        for name, body, n in [("wq_b", ours_wq_b, launches), ("score", ours_score, launches),
                              ("top_k", ours_top_k, launches), ("path", ours_path, launches),
                              ("torch_wq_b", torch_wq_b, launches), ("torch_score", torch_score, min(launches, 2)),
                              ("torch_top_k", torch_top_k, launches), ("torch_path", torch_path, min(launches, 2))]:
            print(f"  ctx={context} B={batch} {name} ...", file=sys.stderr, flush=True)
            t[name] = graph_time_us(body, n, replays=10)
        for run in runs:  # DsaIndex at a forced pages-per-CTA run
            def score_at(run=run):
                for i in range(launches):
                    k0.dsa_index(q8, hw, caches[i % len(caches)], tables, lens, scores, batch, pages_per_cta=run)

            print(f"  ctx={context} B={batch} score run={run} ...", file=sys.stderr, flush=True)
            t[f"score_run{run}"] = graph_time_us(score_at, launches, replays=10)
        cost = {c.name: c for c in stage_costs(shape, batch, context)}
        wq_b_bytes = cost["index_query"].bytes
        score_bytes = cost["index_score"].bytes
        rows.append(dict(context=context, batch=batch, run=pages_per_cta(batch, tables.shape[1]),
                         wq_b_bw=wq_b_bytes / (t["wq_b"] * 1e-6) / H200_COPY_BW,
                         score_bw=score_bytes / (t["score"] * 1e-6) / H200_COPY_BW, **t))
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()), file=sys.stderr, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--context", default="4096,32768,131072")
    parser.add_argument("--runs", default="", help="also time DsaIndex at these pages-per-CTA runs")
    args = parse_args(parser)
    runs = tuple(int(r) for r in args.runs.split(",") if r)
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        rows += bench_context(shape, context, batches, runs=runs)
        torch.cuda.empty_cache()
    headers = ["ctx", "B", "wq_b", "cublas", "wq_b %BW", "run", "score", "bmm", "score %BW", "top_k", "torch.topk",
               "path", "torch path", "torch/ours"]
    report(rows, headers, [[r["context"], r["batch"], r["wq_b"], r["torch_wq_b"], round(100 * r["wq_b_bw"], 1),
                            r["run"], r["score"], r["torch_score"], round(100 * r["score_bw"], 1), r["top_k"],
                            r["torch_top_k"],
                            r["path"], r["torch_path"], round(r["torch_path"] / r["path"], 1)] for r in rows],
           "times in us per launch (median of graph replays); %BW of 4.3 TB/s; run: DsaIndex pages per CTA",
           args.json)
    if runs:
        print(table(["ctx", "B", "host run"] + [f"run {r}" for r in runs],
                    [[r["context"], r["batch"], r["run"]] + [r[f"score_run{x}"] for x in runs] for r in rows],
                    markdown=True))
        print("DsaIndex us per launch at each pages-per-CTA run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
