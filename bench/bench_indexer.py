"""The indexer path's kernels (IndexQuery's wq_b, DsaIndex scoring, TopK) against plain
torch (cuBLAS GEMM, fp32 bmm over the dequantized cache, torch.topk), in CUDA graphs.

    python bench/bench_indexer.py [--batch 1,4,16,64] [--context 4096,32768,131072] [--json out.json]
                                  [--runs 2,4,8,16,32]

"score" times DsaIndex with the host's pages-per-CTA pick (`dsa_index.pages_per_cta`, the
"run" column); --runs also times every listed run and prints them in a second table, to
tune the host's table on the device.
    python bench/bench_indexer.py --top-k-sweep [--batch ...] [--context ...] [--splits ...]   # TopK variants
    python bench/bench_indexer.py --rotation [--batch ...]   # IndexQuery, IndexKey with / without the rotation
    python bench/bench_indexer.py --dsa-probes no_widen,no_mma,ring4,ring8 [--batch ...] [--context ...]
    python bench/bench_indexer.py --dsa-trace [--batch ...] [--context ...]   # DsaIndex CTA timelines
    python bench/bench_indexer.py --dsa-trace-step [--batch ...] [--context ...]   # the same inside the step

Each time is the median over graph replays of `launches` back-to-back launches. wq_b
rotates over enough weight copies, and scoring over enough disjoint pages (other sequences'
block tables, then cache copies; a graph of at least as many launches: `dsa_sources`), that
each graph reads more than 2x L2 and each launch streams from HBM; top-k reads the scores
the scorer just wrote (L2-warm when they fit, as in a step), with the variant the launcher
picks for that width and batch
(`Kernels.top_k_split`, named in the `split` column). Bandwidth = bytes the stage must
move / time, against 4.3 TB/s. `--top-k-sweep` times only TopK, every variant that holds
the row (each ClusterTopK split and the one-CTA kernel), on the same scores: the data for
`kernels/top_k.py`'s `PICKS` table. `--rotation` times IndexQuery (wq_b from HBM) and
IndexKey as DeepSeek-V3.2 runs them (the Hadamard rotation of q and k, ue8m0 scales), without
the rotation, and with neither: the cost of the rotation in the two kernels. `--dsa-probes`
times only DsaIndex, as it runs and once per listed probe (`dsa_index.PROBES`: wrong scores,
times only; ringN: as it runs with an N-stage ring), on the same inputs: what each left-out
part costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch
from bench_kernels import L2_BYTES, graph_time_us, parse_args, report
from graphstep.kernels import dsa_index
from graphstep.kernels import top_k as top_k_kernels
from graphstep.kernels.dsa_index import pages_per_cta

from graphstep import reference as ref
from graphstep import torch_stages
from graphstep.floor import H200_COPY_BW, stage_costs
from graphstep.launch import Kernels
from graphstep.report import table
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState


def copies_for(nbytes: int) -> int:
    return max(1, int(2 * L2_BYTES // nbytes) + 1)


def dsa_sources(state: LayerState, batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(indexer cache, block tables) pairs whose pages are pairwise disjoint, as many as a graph
    must cycle over to read more than 2x L2 (copies_for): first the state's other sequences'
    tables (other pages of the same cache: no memory), then whole-cache copies (at most 8).
    A graph of DsaIndex launches takes max(launches, len(sources)) launches, one source each."""
    need = copies_for(batch * context * state.shape.model.index_token_bytes)
    tables = state.caches.block_tables
    groups = [tables[g * batch : (g + 1) * batch] for g in range(tables.shape[0] // batch)]
    copies = min(-(-need // len(groups)), 8)
    caches = [state.caches.index_cache] + [state.caches.index_cache.clone() for _ in range(copies - 1)]
    return [(cache, group) for cache in caches for group in groups][:need]


def bench_context(
    shape: RankShape, context: int, batches: list[int], launches: int = 8, runs: tuple[int, ...] = ()
) -> list[dict]:
    m = shape.model
    state = LayerState(shape, max_batch=max(batches), max_context=context, seed=3, device="cuda")
    w = state.weights
    weight_sets = [w] + [dataclasses.replace(w, wq_b_index=w.wq_b_index.clone()) for _ in range(copies_for(25e6) - 1)]
    kernel_sets = [Kernels(shape, ws) for ws in weight_sets]
    rows = []
    for batch in batches:
        inputs = state.inputs(batch, context_lens=context)
        sources = dsa_sources(state, batch, context)
        score_launches = max(launches, len(sources))
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
            for i in range(score_launches):
                k0.dsa_index(q8, hw, *sources[i % len(sources)], lens, scores, batch)

        def ours_top_k():
            for _ in range(launches):
                k0.top_k(scores, tables, lens, slots, unused, batch)

        def ours_path():
            for i in range(launches):
                k = kernel_sets[i % len(kernel_sets)]
                k.index_query(qc, inputs.qkv, lens, q8, hw, batch)
                k.dsa_index(q8, hw, *sources[i % len(sources)], lens, scores, batch)
                k.top_k(scores, tables, lens, slots, unused, batch)

        def torch_wq_b():
            for i in range(launches):
                torch.nn.functional.linear(qc, weight_sets[i % len(weight_sets)].wq_b_index)

        def torch_score():
            for i in range(min(launches, 2)):
                cache, group = sources[i % len(sources)]
                cs = dataclasses.replace(state.caches, index_cache=cache)
                torch_stages.index_scores(state, cs, dataclasses.replace(inputs, block_tables=group), q8, hw)

        def torch_top_k():
            for _ in range(launches):
                torch_stages.topk_indices(scores, m.index_topk)

        def torch_path():
            for i in range(min(launches, 2)):
                cache, group = sources[i % len(sources)]
                cs = dataclasses.replace(state.caches, index_cache=cache)
                q = torch.nn.functional.linear(qc, weight_sets[i % len(weight_sets)].wq_b_index)
                qf, hwf = ref.index_query_from(state, inputs, q)
                s = torch_stages.index_scores(state, cs, dataclasses.replace(inputs, block_tables=group), qf, hwf)
                ref.to_slots(torch_stages.topk_indices(s, m.index_topk), tables, m.page_size)

        t = {}
        for name, body, n in [
            ("wq_b", ours_wq_b, launches),
            ("score", ours_score, score_launches),
            ("top_k", ours_top_k, launches),
            ("path", ours_path, launches),
            ("torch_wq_b", torch_wq_b, launches),
            ("torch_score", torch_score, min(launches, 2)),
            ("torch_top_k", torch_top_k, launches),
            ("torch_path", torch_path, min(launches, 2)),
        ]:
            print(f"  ctx={context} B={batch} {name} ...", file=sys.stderr, flush=True)
            t[name] = graph_time_us(body, n, replays=10)
        for run in runs:  # DsaIndex at a forced pages-per-CTA run

            def score_at(run=run):
                for i in range(score_launches):
                    k0.dsa_index(q8, hw, *sources[i % len(sources)], lens, scores, batch, pages_per_cta=run)

            print(f"  ctx={context} B={batch} score run={run} ...", file=sys.stderr, flush=True)
            t[f"score_run{run}"] = graph_time_us(score_at, score_launches, replays=10)
        cost = {c.name: c for c in stage_costs(shape, batch, context)}
        wq_b_bytes = cost["index_query"].bytes
        score_bytes = cost["index_score"].bytes
        split = k0.top_k_split(width, batch, torch.device("cuda"))
        rows.append(
            dict(
                context=context,
                batch=batch,
                run=pages_per_cta(batch, tables.shape[1]),
                split=split.name if split else "one-cta",
                wq_b_bw=wq_b_bytes / (t["wq_b"] * 1e-6) / H200_COPY_BW,
                score_bw=score_bytes / (t["score"] * 1e-6) / H200_COPY_BW,
                **t,
            )
        )
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()), file=sys.stderr, flush=True)
    return rows


def bench_top_k_variants(
    shape: RankShape, context: int, batches: list[int], launches: int = 8, names: set | None = None
) -> list[dict]:
    """TopK alone, every variant that holds the row (of `names`, if given), over the scores
    DsaIndex writes."""
    m = shape.model
    state = LayerState(shape, max_batch=max(batches), max_context=context, seed=3, device="cuda")
    kernels = Kernels(shape, state.weights)
    width = state.pages_per_seq * m.page_size
    variants = [s for s in top_k_kernels.SPLITS if s.capacity >= width] + [None]
    variants = [s for s in variants if names is None or (s.name if s else "one-cta") in names]
    rows = []
    for batch in batches:
        inputs = state.inputs(batch, context_lens=context)
        tables, lens = inputs.block_tables, inputs.context_lens
        qc = torch.randn(batch, m.q_lora_rank, device="cuda").bfloat16()
        q8 = torch.empty(batch, m.index_heads, m.index_dim, dtype=torch.uint8, device="cuda")
        hw = torch.empty(batch, m.index_heads, device="cuda")
        scores = torch.empty(batch, width, device="cuda")
        kernels.index_query(qc, inputs.qkv, lens, q8, hw, batch)
        kernels.dsa_index(q8, hw, state.caches.index_cache, tables, lens, scores, batch)
        slots = torch.empty(batch, m.index_topk, dtype=torch.int32, device="cuda")
        unused = torch.empty(batch, m.index_topk, device="cuda")
        expect = ref.to_slots(ref.topk_indices(scores, m.index_topk), tables, m.page_size)
        picked = kernels.top_k_split(width, batch, scores.device)
        row = dict(context=context, batch=batch, picked=picked.name if picked else "one-cta")
        for split in variants:
            name = split.name if split else "one-cta"

            def body(split=split):
                for _ in range(launches):
                    kernels.top_k(scores, tables, lens, slots, unused, batch, split=split)

            print(f"  ctx={context} B={batch} top_k {name} ...", file=sys.stderr, flush=True)
            try:
                slots.fill_(-7)
                row[name] = graph_time_us(body, launches, replays=10)
                row[name + "_exact"] = bool(torch.equal(slots, expect))
            except Exception as e:  # a launch the device refuses (e.g. a cluster size) is a result too
                print(f"  {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                torch.cuda.synchronize()
                row[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr, flush=True)
    return rows


def main_top_k_sweep(args, shape: RankShape) -> int:
    batches = [int(b) for b in args.batch.split(",")]
    chosen = set(args.splits.split(",")) if args.splits else None
    known = [s.name for s in top_k_kernels.SPLITS] + ["one-cta"]  # the table's columns, in order
    if chosen and not chosen <= set(known):
        raise SystemExit(f"unknown --splits {sorted(chosen - set(known))}; known: {known}")
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        rows += bench_top_k_variants(shape, context, batches, names=chosen)
        torch.cuda.empty_cache()
    names = [n for n in known if chosen is None or n in chosen]
    cells = []

    def cell(r, n):
        if n + "_error" in r:
            return "error"
        return f"{r[n]:.2f}{'' if r[n + '_exact'] else ' WRONG'}" if n in r else "-"

    for r in rows:
        timed = {n: r[n] for n in names if n in r and r[n + "_exact"]}
        best = min(timed, key=timed.get) if timed else "-"
        cells.append(
            [
                r["context"],
                r["batch"],
                r["picked"],
                cell(r, r["picked"]),
                best,
                timed.get(best, "-"),
                *[cell(r, n) for n in names],
            ]
        )
    report(
        rows,
        ["ctx", "B", "picked", "picked us", "best", "best us", *names],
        cells,
        "TopK us per launch (median of graph replays of 8 launches) per variant; WRONG: not the reference's slots",
        args.json,
    )
    return 0


ROTATION_MODELS = {
    "rotated": preset("deepseek-v3.2"),
    "unrotated": dataclasses.replace(preset("deepseek-v3.2"), index_rotation=False),
    "plain": dataclasses.replace(preset("deepseek-v3.2"), index_rotation=False, fp8_scale_format="fp32"),
}


def bench_rotation(batches: list[int], launches: int = 8) -> list[dict]:
    """IndexQuery and IndexKey of each ROTATION_MODELS variant at each batch (positions
    below 4096: neither kernel's work depends on the context)."""
    rows = {batch: dict(batch=batch) for batch in batches}
    for name, model in ROTATION_MODELS.items():
        shape = RankShape(model, Topology(tp=8))
        m = shape.model
        state = LayerState(shape, max_batch=max(batches), max_context=4096, seed=3, device="cuda")
        w = state.weights
        weight_sets = [w] + [
            dataclasses.replace(w, wq_b_index=w.wq_b_index.clone()) for _ in range(copies_for(25e6) - 1)
        ]
        kernel_sets = [Kernels(shape, ws) for ws in weight_sets]
        for batch in batches:
            inputs = state.inputs(batch, context_lens=4096)
            qc = torch.randn(batch, m.q_lora_rank, device="cuda").bfloat16()
            q8 = torch.empty(batch, m.index_heads, m.index_dim, dtype=torch.uint8, device="cuda")
            hw = torch.empty(batch, m.index_heads, device="cuda")

            def query():
                for i in range(launches):
                    kernel_sets[i % len(kernel_sets)].index_query(qc, inputs.qkv, inputs.context_lens, q8, hw, batch)

            def key():
                for _ in range(launches):
                    kernel_sets[0].index_key(
                        inputs.qkv, inputs.context_lens, inputs.slot_mapping, state.caches.index_cache, batch
                    )

            for kernel, body in (("index_query", query), ("index_key", key)):
                print(f"  B={batch} {kernel} {name} ...", file=sys.stderr, flush=True)
                rows[batch][f"{kernel}_{name}"] = graph_time_us(body, launches, replays=10)
    return list(rows.values())


def main_rotation(args) -> int:
    rows = bench_rotation([int(b) for b in args.batch.split(",")])
    kernels = ("index_query", "index_key")
    report(
        rows,
        ["B"] + [f"{k} {name}" for k in kernels for name in ROTATION_MODELS] + [f"{k} rotation +" for k in kernels],
        [
            [r["batch"]]
            + [r[f"{k}_{name}"] for k in kernels for name in ROTATION_MODELS]
            + [round(r[f"{k}_rotated"] - r[f"{k}_unrotated"], 2) for k in kernels]
            for r in rows
        ],
        "us per launch (median of graph replays of 8 launches); rotated: DeepSeek-V3.2 (Hadamard "
        "rotation, ue8m0 scales), unrotated: ue8m0 only, plain: neither; rotation +: rotated - unrotated",
        args.json,
    )
    return 0


def dsa_inputs(state: LayerState, kernels: Kernels, batch: int, context: int) -> tuple:
    """DsaIndex's inputs for `batch` tokens at `context`: (dsa_sources: (cache, block tables)
    pairs enough to stream from HBM, IndexQuery's e4m3 rows and head weights of random q_c,
    lengths)."""
    m = state.shape.model
    inputs = state.inputs(batch, context_lens=context)
    qc = torch.randn(batch, m.q_lora_rank, device="cuda").bfloat16()
    q8 = torch.empty(batch, m.index_heads, m.index_dim, dtype=torch.uint8, device="cuda")
    hw = torch.empty(batch, m.index_heads, device="cuda")
    kernels.index_query(qc, inputs.qkv, inputs.context_lens, q8, hw, batch)
    return dsa_sources(state, batch, context), q8, hw, inputs.context_lens


def bench_dsa_probes(shape: RankShape, context: int, batches: list[int], probes: list[str], launches: int = 8):
    """DsaIndex as it runs ("") and under each probe, at each batch: {probe: us}. A probe
    named ringN is the kernel as it runs with an N-stage ring (dsa_index.RINGS) forced."""
    m = shape.model
    state = LayerState(shape, max_batch=max(batches), max_context=context, seed=3, device="cuda")
    kernels = Kernels(shape, state.weights)
    rows = []
    for batch in batches:
        sources, q8, hw, lens = dsa_inputs(state, kernels, batch, context)
        n = max(launches, len(sources))
        scores = torch.empty(batch, state.pages_per_seq * m.page_size, device="cuda")
        row = dict(context=context, batch=batch, run=pages_per_cta(batch, state.pages_per_seq))

        def body(ring=None):
            for i in range(n):
                kernels.dsa_index(q8, hw, *sources[i % len(sources)], lens, scores, batch, ring=ring)

        for probe in ["", *probes]:
            if probe.startswith("ring"):
                print(f"  ctx={context} B={batch} dsa_index {probe} ...", file=sys.stderr, flush=True)
                row[probe] = graph_time_us(lambda ring=int(probe[4:]): body(ring), n, replays=10)
                continue
            dsa_index.PROBE = probe
            try:
                print(f"  ctx={context} B={batch} dsa_index {probe or 'as it runs'} ...", file=sys.stderr, flush=True)
                row[probe] = graph_time_us(body, n, replays=10)
            finally:
                dsa_index.PROBE = ""
        rows.append(row)
    return rows


def dsa_timeline(trace: torch.Tensor, run: int) -> dict:
    """Summary of one traced DsaIndex launch (dsa_index.TRACE_SLOTS in each CTA's first
    positions of `trace` [B, width] fp32, NaN where no CTA wrote): times in us from the
    launch's first CTA start, per-CTA phases in us (medians over CTAs), %clock converted at
    the median clock rate (cycles over globaltimer ns between a CTA's entry and exit)."""
    slots = len(dsa_index.TRACE_SLOTS)
    words = trace.view(torch.int32).reshape(trace.shape[0], -1, run * 64)[:, :, : slots + dsa_index.TRACE_PAGES]
    words = words.reshape(-1, words.shape[-1]).cpu().long()
    ok = words[:, 7] != torch.tensor([float("nan")]).view(torch.int32).long()
    words = words[ok]
    start = (words[:, 0] & 0xFFFFFFFF) | (words[:, 1] << 32)
    end = (words[:, 2] & 0xFFFFFFFF) | (words[:, 3] << 32)
    clk_end, clk_wait, clk_query, live = words[:, 4], words[:, 5], words[:, 6], words[:, 7]
    ghz = (clk_end.double() / (end - start).clamp_min(1).double()).median().item()
    us = 1e-3 / ghz  # us per clock

    def med(x):
        return float(x.double().median()) if len(x) else float("nan")

    t0 = start.min()
    rel = (start - t0).double() / 1e3
    wait = rel + clk_wait.double() * us
    finish = rel + clk_end.double() * us
    pages = [words[i, slots : slots + min(int(live[i]), dsa_index.TRACE_PAGES)] for i in range(len(words))]
    first = torch.stack([p[0] for p in pages])
    last = torch.stack([p[-1] for p in pages])
    per_page = torch.tensor([(p[-1] - p[0]).item() / (len(p) - 1) for p in pages if len(p) > 1] or [float("nan")])
    return dict(
        t0_ns=int(t0),
        ctas=len(words),
        ghz=ghz,
        start_p50=med(rel),
        start_max=float(rel.max()),
        wait_min=float(wait.min()),
        wait_max=float(wait.max()),
        query=med(clk_query - clk_wait) * us,
        first_page=med(first - clk_query) * us,
        per_page=med(per_page) * us,
        tail=med(clk_end - last) * us,
        end_p50=med(finish),
        end_max=float(finish.max()),
    )


def launch_gaps(timelines: list[dict]) -> dict:
    """Between consecutive traced launches (dsa_timeline's, in launch order), medians in us:
    `start_after_trigger` (a launch's first CTA start after the previous launch's first PDL
    wait returned, where its CTAs trigger their dependents), `wait_after_end` (a launch's
    first wait return after the previous launch's last CTA exit: the boundary the chain
    pays), `period` (between first wait returns)."""

    def at(t, key):  # absolute ns
        return t["t0_ns"] + t[key] * 1e3

    pairs = list(zip(timelines, timelines[1:]))
    gaps = dict(
        start_after_trigger=[(b["t0_ns"] - at(a, "wait_min")) / 1e3 for a, b in pairs],
        wait_after_end=[(at(b, "wait_min") - at(a, "end_max")) / 1e3 for a, b in pairs],
        period=[(at(b, "wait_min") - at(a, "wait_min")) / 1e3 for a, b in pairs],
    )
    return {k: statistics.median(v) for k, v in gaps.items()}


def main_dsa_trace(args, shape: RankShape, launches: int = 8) -> int:
    """Each CTA's timeline in each of `launches` back-to-back traced DsaIndex launches in a
    graph (the trace probe: no score stores), with PDL between them and without, per context
    and batch: the last launch's phases and the medians of the gaps between launches."""
    m = shape.model
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        batches = [int(b) for b in args.batch.split(",")]
        state = LayerState(shape, max_batch=max(batches), max_context=context, seed=3, device="cuda")
        for pdl in (True, False):
            kernels = Kernels(shape, state.weights, pdl=pdl)
            for batch in batches:
                sources, q8, hw, lens = dsa_inputs(state, kernels, batch, context)
                n = max(launches, len(sources))
                width = state.pages_per_seq * m.page_size
                traces = [torch.full((batch, width), float("nan"), device="cuda") for _ in range(n)]

                def body():
                    dsa_index.PROBE = "trace"
                    try:
                        for i in range(n):
                            kernels.dsa_index(q8, hw, *sources[i % len(sources)], lens, traces[i], batch)
                    finally:
                        dsa_index.PROBE = ""

                print(f"  ctx={context} B={batch} pdl={pdl} dsa_index trace ...", file=sys.stderr, flush=True)
                per_launch = graph_time_us(body, n, replays=10)
                run = pages_per_cta(batch, state.pages_per_seq)
                timelines = [dsa_timeline(t, run) for t in traces]
                row = dict(context=context, batch=batch, pdl=pdl, run=run, us=per_launch, **timelines[-1])
                rows.append({**row, **launch_gaps(timelines)})
        del state
        torch.cuda.empty_cache()
    keys = ["ctas", "ghz", "start_max", "wait_min", "query", "first_page", "per_page", "tail", "end_max"]
    keys += ["start_after_trigger", "wait_after_end", "period"]
    report(
        rows,
        ["ctx", "B", "PDL", "run", "us/launch", *keys],
        [
            [r["context"], r["batch"], "on" if r["pdl"] else "off", r["run"], r["us"], *(round(r[k], 2) for k in keys)]
            for r in rows
        ],
        "DsaIndex traced (dsa_index PROBE trace: no score stores), 8 launches in a graph. The last launch, us from"
        " its first CTA start: start_max, wait_min (first PDL wait return), end_max (last CTA exit); medians over"
        " its CTAs: query (wait -> query rows staged), first_page (staged -> page 0 full), per_page (between full"
        " waits), tail (last page -> exit); ghz: the median %clock rate. Between launches (medians):"
        " start_after_trigger, wait_after_end (previous launch's last exit -> this one's first wait return), period",
        args.json,
    )
    return 0


def _cell(value):
    return round(value, 2) if isinstance(value, float) else value


def top_k_timeline(out: torch.Tensor, ctas: int) -> dict:
    """Summary of one traced ClusterTopK launch (top_k.TRACE_SLOTS per CTA at the start of
    each row of `out` [B, k] int32): medians over CTAs, in us, of wait (entry -> the PDL
    wait's return), load (-> the slice loaded: the start barrier), round0 (-> round 0's bin),
    round1 / round2 (over the CTAs that ran them, the share of which is `rounds_12`),
    compact (the last round's bin -> the compaction's end) and tail (-> exit); and each
    round's parts, "hist / hop1 / hop2" (-> the CTA's histogram complete, -> every CTA's
    group sums landed, -> the bin chosen; round 1's hist counts from the list written),
    with list (round 0's bin -> the candidate list written); %clock at the median clock
    rate (cycles over globaltimer ns between entry and exit)."""
    slots = len(top_k_kernels.TRACE_SLOTS)
    words = out[:, : slots * ctas].reshape(-1, slots).cpu().long()
    field = {name: words[:, i] for i, name in enumerate(top_k_kernels.TRACE_SLOTS)}
    start = (field["start"] & 0xFFFFFFFF) | (field["start_hi"] << 32)
    end = (field["end"] & 0xFFFFFFFF) | (field["end_hi"] << 32)
    ghz = (field["clk_end"].double() / (end - start).clamp_min(1).double()).median().item()
    us = 1e-3 / ghz

    def med(x):
        return float(x.double().median()) * us if len(x) else float("nan")

    rounds = [field[f"clk_round{r}"] for r in range(3)]
    last = torch.where(rounds[2] > 0, rounds[2], torch.where(rounds[1] > 0, rounds[1], rounds[0]))
    ran1, ran2 = rounds[1] > 0, rounds[2] > 0
    listed = field["clk_listed"] > 0
    starts = [field["clk_loaded"], torch.where(listed, field["clk_listed"], rounds[0]), rounds[1]]
    parts = {}
    for r, ran in enumerate((rounds[0] > 0, ran1, ran2)):
        hist, groups = field[f"clk_hist{r}"], field[f"clk_groups{r}"]
        spans = (hist - starts[r], groups - hist, rounds[r] - groups)
        parts[f"parts{r}"] = " / ".join(f"{med(x[ran]):.2f}" for x in spans)
    return dict(
        ctas=len(words),
        ghz=ghz,
        wait=med(field["clk_wait"]),
        load=med(field["clk_loaded"] - field["clk_wait"]),
        round0=med(rounds[0] - field["clk_loaded"]),
        round1=med((rounds[1] - rounds[0])[ran1]),
        round2=med((rounds[2] - rounds[1])[ran2]),
        rounds_12=f"{float(ran1.double().mean()):.2f} / {float(ran2.double().mean()):.2f}",
        compact=med(field["clk_compacted"] - last),
        tail=med(field["clk_end"] - field["clk_compacted"]),
        total=med(field["clk_end"] - field["clk_wait"]),
        list=med((field["clk_listed"] - rounds[0])[listed]),
        **parts,
    )


def main_top_k_trace_step(args, shape: RankShape, replays: int = 20) -> int:
    """ClusterTopK's CTA timelines inside the captured step (TP 8, its default mode): the
    step's graphs are captured with top_k.PROBE = "trace", so its TopK writes each CTA's marks
    over the row's first slots (the sparse core then reads those as slots: the step's times
    hold, its outputs do not). Per batch, the last of `replays` replays."""
    from graphstep.step import DecodeStep
    from graphstep.timing import load_batch, replay_us

    rows = []
    for context in (int(c) for c in args.context.split(",")):
        sizes = [int(b) for b in args.batch.split(",")]
        top_k_kernels.PROBE = "trace"
        try:
            step = DecodeStep(shape, capture_sizes=sizes, max_context=context, seed=3)
            step.capture(raise_recorded=False)  # the warm-up's marks read as slots: records, not errors
        finally:
            top_k_kernels.PROBE = ""
        width = step.state.pages_per_seq * shape.model.page_size
        for size in sizes:
            load_batch(step, size, context)
            us = statistics.median(replay_us(step, size, replays=replays))
            split = step.stages.kernels.top_k_split(width, size, step.device)
            if split is None:
                continue  # the one-CTA TopK has no trace
            timeline = top_k_timeline(step.buffers.slots[:size], split.ctas)
            rows.append(dict(context=context, batch=size, split=split.name, step_us=us, **timeline))
            step.error.reset()  # the marks read as slots: out-of-pool records, not input errors
        del step
        torch.cuda.empty_cache()
    keys = ["ctas", "ghz", "wait", "load", "round0", "round1", "round2", "rounds_12", "compact", "tail", "total"]
    keys += ["list", "parts0", "parts1", "parts2"]
    report(
        rows,
        ["ctx", "B", "split", "step us", *keys],
        [[r["context"], r["batch"], r["split"], r["step_us"], *(_cell(r[k]) for k in keys)] for r in rows],
        "ClusterTopK in the captured step (TP 8), traced: medians over CTAs in us of wait (entry -> the PDL wait's"
        " return), load (-> slice loaded), round0..2 (-> each round's bin; rounds_12: the share of CTAs that ran rounds"
        " 1 and 2), compact, tail (-> exit), total (wait's return -> exit); list (round 0's bin -> the candidate"
        " list written) and each round's parts hist / hop1 / hop2 (-> its histogram complete, -> every CTA's group"
        " sums landed, -> its bin; round 1's from the list written)",
        args.json,
    )
    return 0


TRACE_STEP_PROBES = ("trace", "trace_no_rows")  # as it runs; without the query rows' loads


def main_dsa_trace_step(args, shape: RankShape, replays: int = 20) -> int:
    """DsaIndex's CTA timelines inside the captured step (TP 8, its default mode, PDL): the
    step's graphs are captured with a trace probe, so its DsaIndex writes each CTA's marks
    over its first scores (TopK then selects from those scores: the step's times hold, its
    outputs do not). Per batch and probe (TRACE_STEP_PROBES), the last of `replays` replays;
    wait_min there is how long the CTAs that started first waited on IndexQuery."""
    from graphstep.step import DecodeStep
    from graphstep.timing import load_batch, replay_us

    rows = []
    for context in (int(c) for c in args.context.split(",")):
        sizes = [int(b) for b in args.batch.split(",")]
        for probe in TRACE_STEP_PROBES:
            dsa_index.PROBE = probe
            try:
                step = DecodeStep(shape, capture_sizes=sizes, max_context=context, seed=3)
                step.capture()
            finally:
                dsa_index.PROBE = ""
            for size in sizes:
                load_batch(step, size, context)
                us = statistics.median(replay_us(step, size, replays=replays))
                run = pages_per_cta(size, step.state.pages_per_seq)
                timeline = dsa_timeline(step.buffers.scores[:size].contiguous(), run)
                rows.append(dict(context=context, batch=size, probe=probe, run=run, step_us=us, **timeline))
            del step
            torch.cuda.empty_cache()
    keys = ["ctas", "ghz", "start_max", "wait_min", "wait_max", "query", "first_page", "per_page", "tail", "end_max"]
    report(
        rows,
        ["ctx", "B", "probe", "run", "step us", *keys],
        [[r["context"], r["batch"], r["probe"], r["run"], r["step_us"], *(round(r[k], 2) for k in keys)] for r in rows],
        "DsaIndex in the captured step (TP 8), traced: us from its first CTA's start (start_max, wait_min / max:"
        " the PDL wait's return, end_max: the last exit); medians over CTAs of query (wait -> query rows staged),"
        " first_page, per_page, tail; step us: the traced step's replay (its TopK reads the marks). trace_no_rows:"
        " the rows widened from constants, not loaded",
        args.json,
    )
    return 0


def main_dsa_probes(args, shape: RankShape) -> int:
    probes = args.dsa_probes.split(",")
    known = [*dsa_index.PROBES[1:], *(f"ring{n}" for n in dsa_index.RINGS)]
    unknown = [p for p in probes if p not in known]
    if unknown:
        raise SystemExit(f"unknown DsaIndex probes {unknown}: expected some of {known}")
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        rows += bench_dsa_probes(shape, context, batches, probes)
        torch.cuda.empty_cache()
    report(
        rows,
        ["ctx", "B", "run", "dsa_index", *probes],
        [[r["context"], r["batch"], r["run"], *(r[p] for p in ["", *probes])] for r in rows],
        "DsaIndex us per launch (median of graph replays), as it runs and under each probe (wrong scores)",
        args.json,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--context", default="4096,32768,131072")
    parser.add_argument("--runs", default="", help="also time DsaIndex at these pages-per-CTA runs")
    parser.add_argument("--top-k-sweep", action="store_true", help="time every TopK variant only")
    parser.add_argument("--splits", default="", help="--top-k-sweep: only these variants (names, comma-separated)")
    parser.add_argument(
        "--rotation", action="store_true", help="time IndexQuery and IndexKey with and without the Hadamard rotation"
    )
    parser.add_argument(
        "--dsa-probes", default="", help="time DsaIndex as it runs and under these probes (comma-separated)"
    )
    parser.add_argument("--dsa-trace", action="store_true", help="each DsaIndex CTA's timeline (the trace probe)")
    parser.add_argument(
        "--dsa-trace-step",
        action="store_true",
        help="DsaIndex's CTA timelines inside the captured step (TP 8), as it runs and without the rows' loads",
    )
    parser.add_argument(
        "--top-k-trace-step",
        action="store_true",
        help="ClusterTopK's CTA timelines inside the captured step (TP 8): where its time after the wait goes",
    )
    args = parse_args(parser)
    if args.rotation:
        return main_rotation(args)
    runs = tuple(int(r) for r in args.runs.split(",") if r)
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    if args.top_k_sweep:
        return main_top_k_sweep(args, shape)
    if args.dsa_probes:
        return main_dsa_probes(args, shape)
    if args.dsa_trace:
        return main_dsa_trace(args, shape)
    if args.dsa_trace_step:
        return main_dsa_trace_step(args, shape)
    if args.top_k_trace_step:
        return main_top_k_trace_step(args, shape)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        rows += bench_context(shape, context, batches, runs=runs)
        torch.cuda.empty_cache()
    headers = [
        "ctx",
        "B",
        "wq_b",
        "cublas",
        "wq_b %BW",
        "run",
        "score",
        "bmm",
        "score %BW",
        "top_k",
        "split",
        "torch.topk",
        "path",
        "torch path",
        "torch/ours",
    ]
    report(
        rows,
        headers,
        [
            [
                r["context"],
                r["batch"],
                r["wq_b"],
                r["torch_wq_b"],
                round(100 * r["wq_b_bw"], 1),
                r["run"],
                r["score"],
                r["torch_score"],
                round(100 * r["score_bw"], 1),
                r["top_k"],
                r["split"],
                r["torch_top_k"],
                r["path"],
                r["torch_path"],
                round(r["torch_path"] / r["path"], 1),
            ]
            for r in rows
        ],
        "times in us per launch (median of graph replays); %BW of 4.3 TB/s; run: DsaIndex pages per CTA",
        args.json,
    )
    if runs:
        print(
            table(
                ["ctx", "B", "host run"] + [f"run {r}" for r in runs],
                [[r["context"], r["batch"], r["run"]] + [r[f"score_run{x}"] for x in runs] for r in rows],
                markdown=True,
            )
        )
        print("DsaIndex us per launch at each pages-per-CTA run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
