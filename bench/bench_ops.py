"""Host time of one eager call of each kernel: the launcher (graphstep.launch) through CuTe
DSL's own calling path, the same launcher through TVM-FFI, and the torch op (graphstep.ops).

    python bench/bench_ops.py [--preset deepseek-v3.2] [--tp 8] [--batch 1,16] [--calls 400] [--json out.json]

Each column times `calls` calls one by one with perf_counter (synchronizing every 32 calls,
outside the timing, so that the launch queue never fills and blocks the host) and reports
the median per call in us: what a caller outside a CUDA graph pays before the kernel even
starts. The op column includes the dispatcher, the argument checks and the allocation of
its outputs; it goes through TVM-FFI where apache-tvm-ffi is installed (the `ffi` extra).
DCP kernels (QueryWait, DcpMerge) run with --dcp 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from bench_kernels import parse_args, report

from graphstep import ops
from graphstep.launch import ErrorWord, Kernels, TvmFfiKernels, tvm_ffi_available
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState

G = torch.ops.graphstep


def host_us(call, calls: int) -> float:
    """Median host time of `call()` in us."""
    for _ in range(8):
        call()  # compile, load, allocate
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        if i % 32 == 0:
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def calls_of(state: LayerState, launcher: Kernels, batch: int) -> dict:
    """{kernel: (launcher call, op call)} over one batch's inputs and preallocated outputs."""
    s, w, key = state.shape, state.weights, ops.shape_key(state.shape)
    m, k, dcp = s.model, s.model.index_topk, s.topology.dcp
    inputs = state.inputs(batch, seed=0)
    qkv, lens, slot_mapping, tables = inputs.qkv, inputs.context_lens, inputs.slot_mapping, inputs.block_tables
    caches = state.clone_caches()
    error = ErrorWord.new("cuda")
    qc = torch.zeros(batch, m.q_lora_rank, dtype=torch.bfloat16, device="cuda")
    workspace = torch.zeros(batch, s.heads, m.qk_head_dim, device="cuda")
    q = torch.zeros(batch, m.index_heads, m.index_dim, dtype=torch.uint8, device="cuda")
    head_w = torch.zeros(batch, m.index_heads, device="cuda")
    scores = torch.randn(batch, tables.shape[1] * m.page_size, device="cuda")
    slots = torch.full((batch, k), -1, dtype=torch.int32, device="cuda")
    slots[:, :64] = torch.arange(64, dtype=torch.int32, device="cuda")
    positions, own_scores = torch.full_like(slots, -1), torch.full((batch, k), float("-inf"), device="cuda")
    peers = state.peer_inputs(inputs, seed=0) if dcp > 1 else None
    out = torch.zeros(batch, s.gathered, m.kv_lora_rank, device="cuda")
    lse = torch.zeros(batch, s.gathered, device="cuda")
    partial_o, partial_ml = launcher.sparse_core_buffers(batch, "cuda")
    mla_weights = (w.gamma_q, w.gamma_kv, w.w_qb, launcher.w_uk_t, w.rope_cos, w.rope_sin)
    index_rope = (w.index_rope_cos, w.index_rope_sin)
    mailbox, mla_cache, index_cache = caches.mailbox, caches.mla_cache, caches.index_cache
    table = {
        "query_norm": (lambda: launcher.query_norm(qkv, qc, batch), lambda: G.query_norm(qkv, w.gamma_q, key)),
        "mla_query": (
            lambda: launcher.mla_query(
                qkv, lens, slot_mapping, qc, qc, workspace, mailbox, mla_cache, error, batch, True, False
            ),
            lambda: G.mla_query(qkv, lens, slot_mapping, *mla_weights, mailbox, mla_cache, error.word, key),
        ),
        "index_key": (
            lambda: launcher.index_key(qkv, lens, slot_mapping, index_cache, batch),
            lambda: G.index_key(
                qkv,
                lens,
                slot_mapping,
                w.index_norm_weight,
                w.index_norm_bias,
                *index_rope,
                index_cache,
                error.word,
                key,
            ),
        ),
        "index_query": (
            lambda: launcher.index_query(qc, qkv, lens, q, head_w, batch),
            lambda: G.index_query(qc, qkv, lens, w.wq_b_index, *index_rope, error.word, key),
        ),
        "dsa_index": (
            lambda: launcher.dsa_index(q, head_w, index_cache, tables, lens, scores, batch),
            lambda: G.dsa_index(q, head_w, index_cache, tables, lens, error.word, key),
        ),
        "top_k": (
            lambda: launcher.top_k(scores, tables, lens, positions if dcp > 1 else slots, own_scores, batch),
            lambda: G.top_k(scores, tables, lens, error.word, key),
        ),
        "sparse_core": (
            lambda: launcher.sparse_core(mailbox, slots, mla_cache, partial_o, partial_ml, out, lse, batch),
            lambda: G.sparse_core(mailbox, slots, mla_cache, error.word, key),
        ),
    }
    if dcp > 1:
        merged = torch.empty_like(slots)
        table["dcp_merge"] = (
            lambda: launcher.dcp_merge(positions, own_scores, peers.positions, peers.scores, tables, merged, batch),
            lambda: G.dcp_merge(positions, own_scores, peers.positions, peers.scores, tables, error.word, key),
        )
        # every rank's rows in place: the wait returns at once
        mailbox.zero_()
        table["query_wait"] = (
            lambda: launcher.query_wait(mailbox, error, batch),
            lambda: G.query_wait(mailbox, error.word, batch, key),
        )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--calls", type=int, default=400)
    args = parse_args(parser)
    batches = [int(b) for b in args.batch.split(",")]
    shape = RankShape(preset(args.preset), Topology(tp=args.tp, dcp=args.dcp))
    state = LayerState(shape, max_batch=max(batches), max_context=4096, seed=0, device="cuda")
    ffi = tvm_ffi_available()
    launchers = {"cute": Kernels(shape, state.weights)}
    if ffi:
        launchers["tvm_ffi"] = TvmFfiKernels(shape, state.weights)
    rows = []
    for batch in batches:
        tables = {name: calls_of(state, launcher, batch) for name, launcher in launchers.items()}
        for kernel, (cute_call, op_call) in tables["cute"].items():
            row = {"kernel": kernel, "batch": batch, "cute_us": host_us(cute_call, args.calls)}
            row["tvm_ffi_us"] = host_us(tables["tvm_ffi"][kernel][0], args.calls) if ffi else float("nan")
            row["op_us"] = host_us(op_call, args.calls)
            rows.append(row)
    path = "TVM-FFI" if ffi else "CuTe DSL's own path (apache-tvm-ffi not installed)"
    report(
        rows,
        ["kernel", "B", "launcher, cute", "launcher, TVM-FFI", "torch op"],
        [[r["kernel"], r["batch"], r["cute_us"], r["tvm_ffi_us"], r["op_us"]] for r in rows],
        f"host us per eager call (median of {args.calls}), {shape.model.name} {shape.topology.name}; "
        f"the torch ops went through {path}",
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
