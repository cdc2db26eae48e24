"""SparseCore alone (sparse MLA decode over 2048 random slots per token) in CUDA graphs,
against its bytes floor at 4.3 TB/s, its FLOPs at 800 TFLOP/s and FlashMLA's figures.

    python bench/bench_sparse_core.py [--batch 1,4,16,64] [--configs tp8-bf16,tp8-fp8,tp1-fp8,tp1-bf16,tp2-bf16,tp2-fp8]
        [--sweep]
        [--paths ws,wsx,wsh,wsr,wsxv,mws,mws10,msync,t]
        [--probes no_loads,no_math,no_math:0 --probe-batch 64 --probe-paths ws,wsx]
        [--trace --configs tp1-fp8 --probe-batch 64]

Each time is the median over graph replays of back-to-back launches, each launch with its
own slot lists over a cache several times the L2, so every selected row comes from HBM
(as in a step), and its own split partials, so they are written back to HBM as in a step
(`--reused-partials`: one set for every launch, left dirty in the L2, as before session 33).
Bytes = the selected rows + the query rows + out and lse (issue 9's floor: the split
partials' write and read-back are the kernel's own overhead, not counted). `--sweep` also times every
slots-per-CTA variant within 4x of the plan's choice and prints the best.
The launches are SparseCore's read-only variant (no q_out): the step's launch also copies
the query rows it read to q_out and re-arms them (`publish`), not timed here.
--paths: the 64-row CTAs' (TP 1) paths side by side in one process: ws = the producer
warpgroup (partial_wgmma_ws) with the module's consumers for the CTA's blocks
(sparse_core.RESHAPE_BLOCKS), wsh / wsr = with the consumers scoring half a block each /
in FlashMLA's shape at every split, wsx = the crossover with the module's constants
(sparse_core.CROSSOVER: the two head groups' CTAs of a token as a cluster of 2, each producer
loading half of every block, bf16 rows as raw chunks), and wsx + a letter = wsx with the
constants CROSSOVER_PATHS lists: v the values warpgroup's P @ V with P from registers, p / q the
fp8 producer's loads a block ahead or not, s / a the rescales skipped where no row max moved or
all done (ws / wsh / wsr: without it, whatever the module's default); and the 16-row CTAs'
(TP 8): mws = the producer warpgroup (partial_mma_ws) at every split, its rows shared between bulk
copies and cp.async as sparse_core.MMA_BULK_SIXTEENTHS says, mwsN = with N / 16
of each block's rows bulk-copied (either cache; mws16: bulk copies only, mws0: cp.async only),
msync = every thread copies (partial_mma_sync), t = the transposed path (partial_transposed_ws:
wgmma at N = 16, two producer warpgroups) wherever a CTA has 64-slot blocks; default: the
module's choice (sparse_core.CROSSOVER per cache, MMA_PRODUCER_BLOCKS, TRANSPOSED_BLOCKS).
--probes: the producer paths' device probes (sparse_core.PROBES: wrong results, times only;
partial_wgmma_ws for 64-row CTAs, partial_mma_ws for 16-row ones) at --probe-batch; NAME:N
with N / 16 of partial_mma_ws's rows bulk-copied (no_math:16 / no_math:0: the bulk-copy warp /
the cp.async warps alone); no_combine: the module's path without its combine launch
(sparse_core.COMBINE), the partial kernel's own time; combine_early: the combine's
griddepcontrol.wait at its end (sparse_core.COMBINE_EARLY), the partial grid's drain off its
chain; no_dequant (tp1-fp8, ws / wsx): the producer stores the fp8 rows' raw words, no
conversion. --probe-paths: the paths the probes run on (default ws; e.g. ws,wsx: each probe on
the producer path without and with the crossover).
FlashMLA: its sparse FP8-cache decode (SGLang kernel package 0.4.6 / vLLM 0.26), quoted as
issue 9 gives it (measured on the same kind of H200, not run by this script), beside both of
our caches; at TP 8 an engine pads 16 heads to 64, so the TP 8 rows compare with its h_q = 64
figures.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_kernels import L2_BYTES, graph_time_us, parse_args, report
from graphstep.kernels import sparse_core

from graphstep import formats
from graphstep.floor import H200_COPY_BW, MMA_RATE
from graphstep.launch import Kernels
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState

CONFIGS = {
    "tp8-bf16": ("deepseek-v3.2", Topology(tp=8)),
    "tp8-fp8": ("deepseek-v3.2", Topology(tp=8, mla_cache="fp8")),
    "tp1-fp8": ("deepseek-v3.2", Topology(tp=1, mla_cache="fp8")),
    "tp1-bf16": ("deepseek-v3.2", Topology(tp=1)),
    # 64 heads: one 64-row CTA a token and split, no crossover partner
    "tp2-bf16": ("deepseek-v3.2", Topology(tp=2)),
    "tp2-fp8": ("deepseek-v3.2", Topology(tp=2, mla_cache="fp8")),
}
# The crossover's variants (paths wsx*; CROSSOVER on for them): the sparse_core constants each sets,
# the others as the module has them (tests/test_sparse_core_gpu.py runs each that differs from the
# default).
CROSSOVER_PATHS = {
    "wsx": {},
    "wsxv": {"VALUES_RS": True},
    "wsxp": {"XOVER_PREFETCH": True},
    "wsxq": {"XOVER_PREFETCH": False},
    "wsxs": {"SKIP_UNMOVED": True},
    "wsxa": {"SKIP_UNMOVED": False},
}
# The probes of the combine launch (the module's path, not a producer path's): none, or early
COMBINE_PROBES = ("no_combine", "combine_early")
FLASH_MLA_US = {64: {1: 17.0, 4: 16.8, 16: 28.1, 64: 79.8}, 128: {1: 17.0, 4: 18.3, 16: 38.0, 64: 89.5}}


def setup(name: str) -> tuple:
    """(shape, its layer state, the launcher, the MLA cache, its rows) of a config."""
    model, topology = CONFIGS[name]
    shape = RankShape(preset(model), topology)
    state = LayerState(shape, max_batch=64, max_context=8192, seed=5, device="cuda")
    cache = state.caches.mla_cache
    return shape, state, Kernels(shape, state.weights), cache, cache.view(-1, cache.shape[-1]).shape[0]


def launch_io(shape: RankShape, batch: int) -> tuple:
    """A launch's published query rows (the mailbox of random rows) and its out and lse."""
    m = shape.model
    q = torch.randn(batch, shape.gathered, m.query_row, device="cuda") * 0.3
    mailbox = formats.arm(
        torch.empty(batch, shape.q_heads, m.query_row * shape.q_bytes, dtype=torch.uint8, device="cuda")
    )
    mailbox[:, : shape.gathered] = formats.encode_q_rows(q, shape.topology.q_format).view(batch, shape.gathered, -1)
    out = torch.empty(batch, shape.gathered, m.kv_lora_rank, device="cuda")
    return mailbox, out, torch.empty(batch, shape.gathered, device="cuda")


def bench_config(
    name: str, batches: list[int], sweep: bool, profile: bool = False, reused_partials: bool = False
) -> list[dict]:
    shape, state, kernels, cache, total = setup(name)
    m, k = shape.model, shape.model.index_topk
    row_bytes = cache.view(-1, cache.shape[-1]).shape[-1] * cache.element_size()
    rows = []
    for batch in batches:
        step_bytes = batch * (k * row_bytes + shape.gathered * (m.query_row * shape.q_bytes + 4 * (m.kv_lora_rank + 1)))
        launches = min(64, max(8, int(2 * L2_BYTES / step_bytes) + 1))
        mailbox, out, lse = launch_io(shape, batch)
        slot_sets = [torch.randint(0, total, (batch, k), dtype=torch.int32, device="cuda") for _ in range(launches)]
        planned = kernels.sparse_core_plan(batch)
        choices = [planned]
        if sweep:
            choices = [s for s in (planned // 4, planned // 2, planned, planned * 2, planned * 4) if 16 <= s <= k]
        times = {}
        if profile:  # one eager launch of the plan's variant inside a profiler range (for ncu)
            n = batch * k // planned
            po, pml = (
                torch.empty(n, shape.q_heads, m.kv_lora_rank, device="cuda"),
                torch.empty(n, shape.q_heads, 2, device="cuda"),
            )
            kernels.sparse_core(mailbox, slot_sets[0], cache, po, pml, out, lse, batch)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            kernels.sparse_core(mailbox, slot_sets[1], cache, po, pml, out, lse, batch)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        for slots_per_cta in choices:
            n = batch * k // slots_per_cta
            # each launch its own split partials, as it has its own slot lists: in a step the L2 is
            # streamed over by the weights between two SparseCore launches, so its partials are
            # written back to HBM; one buffer for every launch stays dirty in the L2 and never
            # pays that (--reused-partials, the figures before session 33)
            partials = [
                (
                    torch.empty(n, shape.q_heads, m.kv_lora_rank, device="cuda"),
                    torch.empty(n, shape.q_heads, 2, device="cuda"),
                )
                for _ in range(1 if reused_partials else launches)
            ]

            def body(spc=slots_per_cta, partials=partials):
                for i, slots in enumerate(slot_sets):
                    po, pml = partials[i % len(partials)]
                    kernels.sparse_core(mailbox, slots, cache, po, pml, out, lse, batch, spc)

            print(f"  {name} B={batch} slots/CTA={slots_per_cta} ...", file=sys.stderr, flush=True)
            times[slots_per_cta] = graph_time_us(body, launches, replays=10)
        best = min(times, key=times.get)
        us = times[planned]
        flops = 2 * batch * shape.gathered * k * (m.query_row + m.kv_lora_rank)
        peer = FLASH_MLA_US[64 if shape.gathered <= 64 else 128].get(batch, float("nan"))
        rows.append(
            dict(
                config=name,
                batch=batch,
                us=us,
                slots_per_cta=planned,
                floor_us=step_bytes / H200_COPY_BW * 1e6,
                bw=step_bytes / (us * 1e-6) / H200_COPY_BW,
                tflops=flops / (us * 1e-6) / 1e12,
                mma=flops / (us * 1e-6) / MMA_RATE,
                flash_mla=peer,
                best_slots=best,
                best_us=times[best],
                sweep={str(s): t for s, t in times.items()},
            )
        )
        print(
            f"  {name} B={batch}: " + ", ".join(f"{s}: {t:.1f} us" for s, t in times.items()),
            file=sys.stderr,
            flush=True,
        )
    del state
    torch.cuda.empty_cache()
    return rows


def trace_steps(partial_o: torch.Tensor, groups: int, blocks: int) -> list[list]:
    """[step, median, 10th, 90th percentile] in SM cycles of each role's steps from the trace
    probe's words (sparse_core_wgmma.TRACE_*: int32 %clock values over the first partial_o row
    of each CTA, rows token x q_heads), over every CTA's steady blocks (the third to the last;
    the waits after a previous step from the second): %clock wraps at 2^32."""
    from graphstep.kernels import sparse_core_wgmma as W

    ctas = partial_o.shape[0] * groups
    words = partial_o.reshape(partial_o.shape[0], groups, -1).view(torch.int32)[:, :, : W.TRACE_WORDS]
    words = (words.long() & 0xFFFFFFFF).reshape(ctas, -1).cpu()

    def at(base: int, per: int, step: int) -> torch.Tensor:  # [CTAs, blocks]
        return words[:, base + step : base + per * blocks : per]

    def span(later: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
        return ((later - earlier) % (1 << 32)).double()

    sc = [at(W.TRACE_SCORER, 4, i) for i in range(4)]
    va = [at(W.TRACE_VALUES, 3, i) for i in range(3)]
    pr = [at(W.TRACE_PRODUCER, 3, i) for i in range(3)]
    start = words[:, W.TRACE_START : W.TRACE_START + 1]
    steady = slice(2, blocks)
    phases = [
        ("scorer: full waited (after its last P @ V)", span(sc[0][:, 1:], sc[3][:, :-1])[:, 1:]),
        ("scorer: scores (36 wgmma + wait)", span(sc[1], sc[0])[:, steady]),
        ("scorer: softmax, P handed over", span(sc[2], sc[1])[:, steady]),
        ("scorer: its P @ V (RS) + wait", span(sc[3], sc[2])[:, steady]),
        ("scorer: a block (full waited to full waited)", span(sc[0][:, 1:], sc[0][:, :-1])[:, 1:]),
        ("values: P ready (after its last P @ V)", span(va[0][:, 1:], va[2][:, :-1])[:, 1:]),
        ("values: rescale (and VALUES_RS: P loaded)", span(va[1], va[0])[:, steady]),
        ("values: its P @ V issued and waited", span(va[2], va[1])[:, steady]),
        ("producer: slot ids + loads issued", span(pr[0][:, 1:], pr[2][:, :-1])[:, 1:]),
        ("producer: empty waited", span(pr[1], pr[0])[:, steady]),
        ("producer: loads landed, dequantized, stored", span(pr[2], pr[1])[:, steady]),
        ("first block: entry to scorer's full waited", span(sc[0][:, :1], start)),
        ("whole CTA: entry to the last P @ V", span(sc[3][:, -1:], start)),
    ]
    return [[label] + [round(float(v.flatten().quantile(p))) for p in (0.5, 0.1, 0.9)] for label, v in phases]


def trace_config(name: str, batch: int) -> list[list]:
    """The trace probe (sparse_core.PROBE = "trace"): one eager launch after a warm-up one, each
    role's steps per block from the CTAs' %clock words (sparse_core_wgmma.TRACE_*): the median,
    10th and 90th percentile over every CTA's steady blocks (the third to the last), in SM cycles."""
    from graphstep.kernels import sparse_core_wgmma as W

    shape, state, kernels, cache, total = setup(name)
    m, k = shape.model, shape.model.index_topk
    mailbox, out, lse = launch_io(shape, batch)
    slots = torch.randint(0, total, (batch, k), dtype=torch.int32, device="cuda")
    planned = kernels.sparse_core_plan(batch)
    partial_o = torch.zeros(batch * k // planned, shape.q_heads, m.kv_lora_rank, device="cuda")
    partial_ml = torch.empty(batch * k // planned, shape.q_heads, 2, device="cuda")
    for _ in range(2):  # the first launch compiles and warms; the second is read
        kernels.sparse_core(mailbox, slots, cache, partial_o, partial_ml, out, lse, batch)
    torch.cuda.synchronize()
    blocks = planned // sparse_core.block_for(planned)  # a CTA's (one split: planned = k)
    cells = [[name, batch, *row] for row in trace_steps(partial_o, shape.q_heads // W.WG_ROWS, blocks)]
    del state
    torch.cuda.empty_cache()
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--configs", default="tp8-bf16,tp8-fp8,tp1-fp8")
    parser.add_argument("--sweep", action="store_true", help="also time slots-per-CTA variants around the plan")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only one eager launch per config and batch inside cudaProfilerStart/Stop: "
        "ncu --profile-from-start off python bench/bench_sparse_core.py --profile",
    )
    parser.add_argument(
        "--paths",
        default="",
        help=f"paths to compare: 64-row CTAs ws,wsh,wsr,{','.join(CROSSOVER_PATHS)}; 16/32-row mws,mwsN,msync,t "
        "(default: the module's)",
    )
    parser.add_argument(
        "--probes",
        default="",
        help="probes, each sparse_core.PROBES joined by + (producer paths; NAME:N: N sixteenths bulk), "
        "no_combine, combine_early",
    )
    parser.add_argument(
        "--trace",
        nargs="?",
        const="trace",
        help="only the trace probe at --probe-batch (the crossover at one split: tp1-fp8 / tp1-bf16 at B = 64): "
        "each role's SM cycles per step of a block; --trace trace+PROBE: with other probes joined "
        "(trace+no_push, trace+cta_full: wrong results)",
    )
    parser.add_argument("--probe-batch", default="64")
    parser.add_argument("--probe-paths", default="ws", help="the paths the producer probes run on: ws,wsx")
    parser.add_argument(
        "--reused-partials",
        action="store_true",
        help="every launch of a graph writes the same split partials (they stay in the L2: the figures "
        "before session 33); default: each launch its own, written back to HBM as in a step",
    )
    args = parse_args(parser)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        print("bench_sparse_core needs an sm_90 GPU (H100/H200)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batch.split(",")]
    if args.trace:
        cells = []
        if "trace" not in args.trace.split("+"):
            parser.error(f"--trace {args.trace!r}: expected trace or trace+PROBE")
        sparse_core.PROBE = args.trace  # (joined probes: wrong results)
        try:
            for name in args.configs.split(","):
                for batch in (int(b) for b in args.probe_batch.split(",")):
                    cells += trace_config(name, batch)
        finally:
            sparse_core.PROBE = ""
        headers = ["config", "B", "step", "median cycles", "p10", "p90"]
        caption = "SparseCore's trace probe: SM cycles per step of a block (medians over CTAs and blocks)"
        report([dict(zip(headers, c)) for c in cells], headers, cells, caption, args.json)
        return 0
    paths = [(p, "") for p in args.paths.split(",")] if args.paths else [("", "")]
    probe_paths = args.probe_paths.split(",")
    for probe in (p for p in args.probes.split(",") if p):
        paths += [("", probe)] if probe in COMBINE_PROBES else [(path, probe) for path in probe_paths]
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}: expected some of {', '.join(CONFIGS)}")
        for path, probe in paths:
            probe, _, probe_bulk = probe.partition(":")
            bulk = path[3:] if path.startswith("mws") else probe_bulk
            if bulk and not (bulk.isdigit() and int(bulk) <= 16):
                parser.error(f"bulk-copied sixteenths must be 0 .. 16, got {bulk!r}")
            known = ("", "ws", "wsh", "wsr", "mws", "msync", "t", *CROSSOVER_PATHS)
            probes_ok = not probe or set(probe.split("+")) <= {*sparse_core.PROBES, *COMBINE_PROBES}
            if (path not in known and not path.startswith("mws")) or not probes_ok:
                parser.error(f"unknown path {path!r} or probe {probe!r}")
            # the module's constants as they are, every one restored after this path's run
            saved = {
                constant: getattr(sparse_core, constant)
                for constant in (*sparse_core.KNOBS, "PROBE", "COMBINE", "COMBINE_EARLY")
            }
            if bulk:
                sparse_core.MMA_BULK_SIXTEENTHS = dict.fromkeys(saved["MMA_BULK_SIXTEENTHS"], int(bulk))
            if path.startswith("mws") or path == "msync":
                sparse_core.MMA_PRODUCER_BLOCKS = dict.fromkeys(
                    saved["MMA_PRODUCER_BLOCKS"], 1 if path != "msync" else 1 << 30
                )
                sparse_core.TRANSPOSED_BLOCKS = dict.fromkeys(saved["TRANSPOSED_BLOCKS"], 0)
            elif path == "t":
                sparse_core.TRANSPOSED_BLOCKS = dict.fromkeys(saved["TRANSPOSED_BLOCKS"], 1 << 30)
            elif path:
                if path in ("ws", "wsx"):  # (the probes' paths) 16-row CTAs' producer too
                    sparse_core.MMA_PRODUCER_BLOCKS = dict.fromkeys(saved["MMA_PRODUCER_BLOCKS"], 1)
                # the crossover only on wsx*, so ws* is the path without it whatever CROSSOVER says
                sparse_core.CROSSOVER = dict.fromkeys(saved["CROSSOVER"], path.startswith("wsx"))
            if path in ("wsh", "wsr"):
                sparse_core.RESHAPE_BLOCKS = 0 if path.endswith("h") else 1 << 30
            for constant, value in CROSSOVER_PATHS.get(path, {}).items():
                setattr(sparse_core, constant, value)
            sparse_core.PROBE = "" if probe in COMBINE_PROBES else probe
            sparse_core.COMBINE = probe != "no_combine"
            sparse_core.COMBINE_EARLY = probe == "combine_early"
            try:
                probe_batches = [int(b) for b in args.probe_batch.split(",")] if probe else batches
                found = bench_config(name, probe_batches, args.sweep, args.profile, args.reused_partials)
            finally:
                for constant, value in saved.items():
                    setattr(sparse_core, constant, value)
            for row in found:
                row["path"] = (
                    (path or "default") + (f"+{probe}" if probe else "") + (f":{probe_bulk}" if probe_bulk else "")
                )
            rows += found
    if args.profile:
        return 0
    headers = [
        "config",
        "path",
        "B",
        "us",
        "slots/CTA",
        "floor us",
        "%BW",
        "TFLOP/s",
        "FlashMLA us (quoted)",
        "FlashMLA/ours",
        "best slots/CTA",
        "best us",
    ]
    report(
        rows,
        headers,
        [
            [
                r["config"],
                r["path"],
                r["batch"],
                r["us"],
                r["slots_per_cta"],
                r["floor_us"],
                round(100 * r["bw"], 1),
                round(r["tflops"]),
                r["flash_mla"],
                round(r["flash_mla"] / r["us"], 2),
                r["best_slots"],
                r["best_us"],
            ]
            for r in rows
        ],
        "SparseCore us per launch (median of graph replays); %BW of 4.3 TB/s; FlashMLA: quoted from issue 9 "
        "(its FP8-cache sparse decode, not run here), h_q 64 (TP 8) / 128 (TP 1), beside both caches",
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
