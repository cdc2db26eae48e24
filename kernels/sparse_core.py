"""SparseCore: sparse MLA decode over each token's selected cache slots, flash-decoding style.

    out[b, h] = softmax_k(scale x q[b, h] . row[slot_k]) @ row[slot_k][:512],  lse[b, h]

Launches
partial  grid (splits, q_heads / heads_per_cta, tokens). A CTA owns `heads_per_cta` query rows
         (16, 32 or 64) of one token and a run of `slots_per_cta` consecutive entries of its
         slot list, walked in blocks of `block` slots, each block's cache rows copied into
         shared memory once and used for both the scores and P @ V. Online softmax in the log2
         domain. It writes the split's unnormalized output and (max, sum), max in log2 units;
         with one split (slots_per_cta = k) it normalizes and writes out and lse itself.
combine  grid (4 quarters of the 512 latent dims, ceil(gathered heads / heads a CTA), tokens), 128
         threads: the splits' (max, sum) -> weights 2^(max_s - max), the weighted sum of their
         partial outputs (lane l: dims 4l .. 4l + 3 of the quarter; every load issued before
         the weights), out = sum / total, lse = (max + log2(total)) x ln 2 (natural log). Up
         to COMBINE_WARP_SPLITS splits a warp takes a (quarter, head), four heads a CTA, and
         reduces the (max, sum) by shuffles, no barrier (combine_warp); above it the CTA's four
         warps share one (quarter, head), warp w splits w, w + 4, ..., and meet in shared
         memory (combine_cta). Not launched with one split, nor where partial_mma_ws has 2 ..
         CLUSTER_SPLITS splits: there a token's split CTAs form one cluster and combine
         through distributed shared memory (cluster_combine).

The partial kernel's paths (the constructor picks one from the rows per CTA and the cache):
16 / 32 rows  mma.sync m16n8k16 warps (kernels/sparse_core_mma.py): partial_mma_sync, every
              warp copying, or partial_mma_ws, a producer warpgroup copying behind mbarriers
              (16 rows, from MMA_PRODUCER_BLOCKS[cache] blocks a CTA).
16 rows       or partial_transposed_ws (kernels/sparse_core_transposed.py): wgmma at N = 16,
              scores and P @ V transposed, two producer warpgroups dequantizing each 64-slot
              block once (1 .. TRANSPOSED_BLOCKS[cache] blocks a CTA: the fp8 cache, as at TP 8
              B = 2 .. 32).
64 rows       two warpgroups of wgmma (kernels/sparse_core_wgmma.py): partial_wgmma_ws, a
              producer warpgroup loading (and dequantizing) behind mbarriers, its head-group
              pairs sharing each block as a cluster of 2 (CROSSOVER).
Why each default is what it is (the alternatives as measured): docs/levers.md Part S.

poll (the step's fork_poll mode on one rank): before its PDL wait each partial CTA spins until
the query rows it reads are published in the mailbox (every 16-byte chunk off the sentinel,
`primitives.poll_mailbox`, bounded by budget_ns: a chunk still missing is recorded and the
step raises MailboxTimeout), so the step joins MlaQuery's side stream after the sparse core
rather than before it: a graph node with two predecessors is not launched early under PDL
(it started 1.4-1.7 us after TopK's end at TP 8 32K; bench/RESULTS.md, session 15). The rows'
publisher ran after MlaQuery's KV insert, so rows seen published (then an acquire fence) mean
the new tokens' cache rows are in place too. A launch polls only where its grid has at most
POLL_MAX_CTAS CTAs and the device's SMs less POLL_FREE_SMS (graphstep's launcher refuses more),
so some SMs always stay free for
MlaQuery's kernels.

publish (the step's launch): the kernel that reads the query rows last also copies them to
q_out and re-arms them in the mailbox (0xFF) -- the partial kernel with one split (each CTA
its rows' only reader), else the combine (after every partial CTA; clustered: split 0's CTA
after the cluster barrier) -- so no torch copy and fill follow the launch.

`plan(batch, q_heads, k, mla_cache)` picks slots_per_cta on the host so that a launch is about
one wave of CTAs, or half of one at small batch (heads_per_cta follows q_heads).

Slot -1 scores -inf and loads nothing; a token with no slot gets out 0 and lse -inf, as
graphstep.reference.sparse_attention. So does any slot outside [0, pool_slots) (one
unsigned compare where -1 was tested), recorded in the error word (kernels/guards.py).
Query rows: bf16, or e4m3 widened exactly to bf16; rows past `gathered` (the 16-row padding
of the mailbox, never published) are zeros.
Caches: bf16 [576] rows, or the fp8 656-byte rows (512 e4m3 x their per-128 fp32 scale,
rounded to bf16; 64 bf16 rope).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32

from . import primitives as P
from .sparse_core_layout import FP8_ROW, LATENT, PRODUCER_THREADS, ROW, STRIDE
from .sparse_core_mma import COLS, MmaPaths, ring_stages, ws_stages
from .sparse_core_transposed import T_ROWS, TransposedPaths
from .sparse_core_wgmma import TRACE_BLOCKS, WG_ROWS, WS_THREADS, WgmmaPaths

# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"kv_lora_rank": (LATENT,), "qk_rope_dim": (ROW - LATENT,)}
SENTINEL_WORD = 0xFFFFFFFF  # an unpublished mailbox chunk (graphstep/formats.py)
WAVE = 128  # CTAs a plan aims for (132 SMs, one CTA each)
# The tuning constants and device probes of the kernel. Each comment says what the constant is
# and why it has its value; the docs/levers.md Part S section it names (or bench/RESULTS.md) has
# the alternatives' figures. graphstep's --knob changes the ones KNOBS lists.
#
# Up to this many tokens a launch, by (rows per CTA, MLA cache), a plan aims at half a wave
# (WAVE // 2 CTAs, each twice the slots): at small batch the split partials' write and read-back
# cost more than the SMs half a wave leaves idle. 0: a whole wave at every batch. Measured at
# TP 8 and TP 1 (S.8); other shapes of the same rows follow these entries unmeasured.
PLAN_HALF_WAVE_TOKENS = {
    (16, "bf16"): 16,
    (16, "fp8"): 4,
    (32, "bf16"): 0,
    (32, "fp8"): 0,
    (64, "bf16"): 0,
    (64, "fp8"): 4,
}
# partial_wgmma_ws's consumers in FlashMLA's shape (consume_blocks' roles 0 and 1) up to this many
# blocks a CTA, else the half-block scorers (role None): FlashMLA's keeps every row max in one
# warpgroup but overlaps the producer less, so it wins only at 1-2 blocks (S.6).
RESHAPE_BLOCKS = 2
# The crossover per cache (a token's two head groups' CTAs as a cluster of 2, each producer loading
# half of every block; produce_blocks in kernels/sparse_core_wgmma.py has the protocol), with
# FlashMLA's consumer shape at every block count (with the half-block scorers past RESHAPE_BLOCKS
# the crossover was no faster than without it: 117.9 against 115.3 us at TP 1 fp8 B = 64, S.7).
CROSSOVER = {"fp8": True, "bf16": True}
# True: the values warpgroup loads P into registers and takes it as its P @ V's A operand (wgmma
# RS), False: it reads P from shared memory (SS). Alone a few percent either way, the step
# unchanged (S.9; re-measured in session 39, bench/RESULTS.md).
VALUES_RS = False
# The crossover's shape, as measured (S.9-S.10; the variants are in git history): each producer
# pushes its half of a block into the peer's tile by st.async as it stores it (512-byte bulk
# copies after the producer's barrier were slower: 136.5 against 105.8 us at TP 1 fp8 B = 64);
# every consumer warp waits for the full barrier itself (one warp a warpgroup passing it on by a
# named barrier was no faster); and each consumer warp releases a buffer to the peer's producer
# at CTA scope (at cluster scope ptxas adds MEMBAR.ALL.GPU and ERRBAR: 7-9% slower at TP 1 B = 64).
# The crossover's fp8 producer issues block b + 1's loads before it dequantizes block b, so a
# load's latency overlaps a whole block (two blocks' registers live): -4% at TP 1 fp8 B = 64 (S.10).
XOVER_PREFETCH = True
# How the wgmma paths' fp8 dequantizing threads load a row's latent, by path ("transposed": TP 8's
# two producer warpgroups; "wgmma": the 64-row CTAs' producers): "8B" one 8-byte load a bf16
# chunk, "16B" FlashMLA's map (a 16-byte load of two chunks: half the requests). The same bits
# under either form; "16B" wins on the transposed path (TP 8 fp8 B = 64 -9%) and loses a little on
# the crossover (S.12). (FlashMLA's L2 prefetch sizes on the 16-byte loads changed nothing: Part X.)
FP8_ROW_LOADS = {"transposed": "16B", "wgmma": "8B"}
FP8_ROW_LOAD_FORMS = ("8B", "16B")
FP8_ROW_LOAD_PATHS = ("transposed", "wgmma")  # FP8_ROW_LOADS' keys
# FlashMLA's consumer shape rescales its 128 output accumulators a block only where some row max
# of the warp moved (a warp vote; the factors are then exactly 1, so skipping is exact): -2% at
# TP 1 fp8 B = 64, the same bits (S.10).
SKIP_UNMOVED = True
# Device probes of the producer paths (bench/bench_sparse_core.py --probes; wrong results):
# "no_loads": the producer loads nothing (every slot a hole) but dequantizes and stores as
# usual (partial_mma_ws: copies nothing, every block computed); "no_math": the consumers only
# wait for each block and release it; "no_dequant" (partial_wgmma_ws over the fp8 cache): the
# producer stores each latent piece's raw e4m3 words twice over as its bf16 chunk (the same
# loads and stores, no conversion or scale): what the dequantization's instructions cost;
# "trace" (the crossover at one split): each role's %clock at each step of each block, written
# over the unused partial_o (sparse_core_wgmma.TRACE_WORDS; bench_sparse_core.py --trace);
# "no_push" (the crossover): each producer stores its half of a block into its own tile only,
# none into the peer's (whose full barrier then expects no bytes): what the pushes cost, the
# other half of every tile stale; "cta_full" (the crossover): the consumers wait for full at
# CTA scope, not the cluster's (no L1 invalidation a wait; the peer's st.async writes are then
# not acquired as the memory model asks): what the cluster-scope acquire costs. PROBE may join
# several with "+" (e.g. "trace+no_push").
PROBES = ("no_loads", "no_math", "no_dequant", "trace", "no_push", "cta_full")
PROBE = ""
# A device probe of any path (bench_sparse_core.py --probes no_combine): False launches no
# combine kernel, so a split token's out and lse are never written (wrong results): the
# partial kernel's own time in a graph, against which the combine's share is judged.
COMBINE = True
# A device probe of the combine (bench_sparse_core.py --probes combine_early): True moves its
# griddepcontrol.wait to its end (the publish after it), so it loads and combines partials while
# the partial grid may still run (wrong results): the most a combine released token by token
# (docs/levers.md Part Z) could take off the partial grid's drain.
COMBINE_EARLY = False
# 16-row CTAs take partial_mma_ws from this many blocks a CTA, per MLA cache, else
# partial_mma_sync: with the bf16 cache always; with fp8 from 8 blocks (TP 8, B >= 32), below
# which the two tie or the plain kernel wins (S.2; bench_sparse_core.py --paths msync,mws
# compares them).
MMA_PRODUCER_BLOCKS = {"bf16": 1, "fp8": 8}
# 16-row CTAs take partial_transposed_ws (kernels/sparse_core_transposed.py: wgmma at N = 16,
# each row dequantized once by two producer warpgroups) at 1 .. TRANSPOSED_BLOCKS[cache] 64-slot
# blocks a CTA; 0: never (the mma.sync paths above). Over fp8 it is 3-12% faster up to 8 blocks
# (TP 8 B <= 32) and slower at 16; over bf16 slower where measured (B = 16, 64; S.12).
TRANSPOSED_BLOCKS = {"bf16": 0, "fp8": 8}
# partial_mma_ws with 2 .. CLUSTER_SPLITS splits a token (TP 8: B = 64) launches each token's
# split CTAs as one cluster and combines there (cluster_combine): each CTA leaves its
# unnormalized rows and (max, sum) in its own shared memory, and after a cluster barrier CTA
# s combines latent dims [512 s / splits, 512 (s + 1) / splits) of every row from all the
# cluster's CTAs (DSMEM): no partials in global memory, no combine launch. Not past 2: 4- and
# 8-CTA clusters do not all fit one wave (whole GPCs only; S.4).
CLUSTER_SPLITS = 2
# The combine gives each (quarter, head) one warp up to this many splits (combine_warp: no shared
# memory, no barrier), above it the CTA's four (combine_cta): one warp a head is 11-21% faster at
# TP 1 B = 16 / 32 (4 / 2 splits), mixed at TP 8 B = 32, and 0.4-1.0 us slower at 8 to 64 splits
# (S.11).
COMBINE_WARP_SPLITS = 4
# partial_mma_ws's producer warpgroup copies each block's rows two ways at once, both
# completing on the stage's full mbarrier: its first MMA_BULK_SIXTEENTHS[cache] / 16 by warp
# 0's cp.async.bulk (one per row: the SM's bulk-copy unit), the rest by warps 1-3's 16-byte
# cp.async.cg (the load/store path: separate hardware). The shares make the two finish
# together at the rates each showed alone (S.3; bench_sparse_core.py --paths mws<N> sets N
# sixteenths).
MMA_BULK_SIXTEENTHS = {"bf16": 10, "fp8": 9}
# The constants above a run may change, and the types each takes (graphstep's --knob; the
# probes PROBE and COMBINE give wrong results and stay for the benchmarks' own flags).
KNOBS = {
    "RESHAPE_BLOCKS": int,
    "CROSSOVER": dict,
    "VALUES_RS": bool,
    "XOVER_PREFETCH": bool,
    "FP8_ROW_LOADS": dict,
    "SKIP_UNMOVED": bool,
    "MMA_PRODUCER_BLOCKS": dict,
    "TRANSPOSED_BLOCKS": dict,
    "CLUSTER_SPLITS": int,
    "MMA_BULK_SIXTEENTHS": dict,
    "COMBINE_WARP_SPLITS": int,
    "PLAN_HALF_WAVE_TOKENS": dict,
}


def heads_per_cta(q_heads: int) -> int:
    """Query rows per CTA: 64 where they divide (KV rows read once per 64 heads), else 32 or 16."""
    for m in (64, 32, 16):
        if q_heads % m == 0:
            return m
    raise ValueError(f"SparseCore needs q_heads % 16 == 0, got {q_heads}")


def block_for(slots_per_cta: int) -> int:
    """Slots per shared-memory block: 64 (at most slots_per_cta)."""
    return min(64, slots_per_cta)


def min_slots(q_heads: int) -> int:
    """The fewest slots per CTA a plan picks: 32, or 64 for 64-row CTAs, whose partials are
    4x a 16-row CTA's (TP 1, B = 1 on the H200: 13.9 us at 64 slots against 18.8 at 32, the
    combine reading 16.8 MB of partials; bench/RESULTS.md)."""
    return 64 if heads_per_cta(q_heads) == WG_ROWS else 32


def plan(batch: int, q_heads: int, k: int, mla_cache: str) -> int:
    """slots_per_cta for a launch of `batch` tokens over the `mla_cache` cache ("bf16" or
    "fp8"): the largest power of two >= min_slots that still gives about one wave (>= WAVE
    CTAs; half of one up to PLAN_HALF_WAVE_TOKENS' batch), at most k. (16 slots per CTA fill
    the GPU at B = 1 but double the partials the combine reads: 7.9 us against 6.5 us at 32 on
    the H200, bench/RESULTS.md.)"""
    rows = heads_per_cta(q_heads)
    groups = q_heads // rows
    wave = WAVE // 2 if batch <= PLAN_HALF_WAVE_TOKENS[(rows, mla_cache)] else WAVE
    slots = min(min_slots(q_heads), k)
    while slots * 2 <= k and k % (slots * 2) == 0 and batch * groups * (k // (slots * 2)) >= wave:
        slots *= 2
    return slots


# poll: the most partial CTAs one launch may have spinning on the mailbox before their PDL wait.
# Each can hold a whole SM (its ring fills the shared memory), so at most the device's SMs less
# POLL_FREE_SMS, and at most POLL_MAX_CTAS (4 of an H100 SXM / H200's 132 SMs free), leave SMs to
# MlaQuery's kernels whatever the timing: the rows' publisher always progresses (on an sm_90 part
# with fewer SMs, an H100 PCIe's 114 or an H20's 78, a full-wave poll would hold them all until
# its budget ran out). Larger launches (B = 24, 40, 48, 56 by `plan` on 132 SMs) join the side
# stream instead. A lower bound lost at TP 1 fp8 B = 8 / 16 (64: +2.5 / +3.6 us, the poll's gain,
# no starvation; session 34).
SMS = P.SMS  # the part WAVE and POLL_MAX_CTAS are measured on
POLL_FREE_SMS = 4
POLL_MAX_CTAS = SMS - POLL_FREE_SMS  # 128


def partial_ctas(batch: int, q_heads: int, k: int, slots_per_cta: int) -> int:
    """The partial kernel's CTAs for a launch of `batch` tokens: splits x row groups x tokens."""
    return batch * (q_heads // heads_per_cta(q_heads)) * (k // slots_per_cta)


def may_poll(batch: int, q_heads: int, k: int, slots_per_cta: int, sms: int = SMS) -> bool:
    """Whether a launch of `batch` tokens on a device of `sms` SMs may poll the mailbox: its
    partial CTAs, each of which may hold an SM while it spins, leave some SMs to the rows'
    publisher (POLL_MAX_CTAS, POLL_FREE_SMS)."""
    return partial_ctas(batch, q_heads, k, slots_per_cta) <= min(POLL_MAX_CTAS, sms - POLL_FREE_SMS)


def partial_rows(batch: int, q_heads: int, k: int, slots_per_cta: int) -> int:
    """Partial-output rows (token x split) a launch of `batch` tokens needs (0: one split, the
    partial kernel writes out and lse itself)."""
    splits = k // slots_per_cta
    return batch * splits if splits > 1 else 0


class SparseCore(MmaPaths, WgmmaPaths, TransposedPaths):
    """The op: its configuration (the constructor), its two launches (`__call__`), the
    partial kernel's entry, which runs one of the paths of the mixins, and the combine kernel,
    with what every path shares (the mailbox poll, the rows' publish, the softmax's end)."""

    def __init__(
        self,
        q_heads: int,
        gathered: int,
        k: int,
        q_fp8: bool,
        mla_fp8: bool,
        softmax_scale: float,
        slots_per_cta: int,
        pdl: bool = True,
        publish: bool = False,
        producer: bool | None = None,
        poll: bool = False,
        crossover: bool | None = None,
        transposed: bool | None = None,
    ):
        """publish: also copy the query rows read to q_out and re-arm them in q_rows (the
        step's mailbox) once every reader is done: the step's last touch of the mailbox,
        folded in here instead of a torch copy and fill after the launch.
        poll: each partial CTA first waits, before its PDL wait, until the query rows it
        reads are published (the module docstring): its rows below `gathered` (the padding
        rows above are never published), so gathered must fit one CTA or fill every CTA.
        producer: 16 rows: a producer warpgroup loads the rows (partial_mma_ws), or every warp
        does (partial_mma_sync); None: partial_mma_ws from MMA_PRODUCER_BLOCKS[cache] blocks
        per CTA. 64-row CTAs always have a producer warpgroup (partial_wgmma_ws; the kernel
        without it was slower over fp8 and tied over bf16, docs/levers.md S.5 and Part X).
        crossover: partial_wgmma_ws's two head-group CTAs of a (split, token) as a cluster of 2,
        each producer loading half of every block (None: the module's CROSSOVER for the
        cache); only where it applies (64-row CTAs in pairs with a producer, 64-slot blocks),
        else today's kernel.
        transposed: 16-row CTAs on partial_transposed_ws (None: up to TRANSPOSED_BLOCKS[cache]
        blocks a CTA where producer is None too); only at 64-slot blocks and with a producer
        (producer not False)."""
        if slots_per_cta % 16 or k % slots_per_cta:
            raise ValueError(f"SparseCore needs slots_per_cta % 16 == 0 dividing k, got {slots_per_cta}, k={k}")
        self.q_heads, self.gathered, self.k, self.q_fp8, self.mla_fp8 = q_heads, gathered, k, q_fp8, mla_fp8
        self.softmax_scale, self.slots_per_cta, self.pdl, self.publish = softmax_scale, slots_per_cta, pdl, publish
        self.heads = heads_per_cta(q_heads)
        self.poll = poll
        if poll and gathered > self.heads and gathered % self.heads:
            raise ValueError(f"SparseCore's poll: gathered {gathered} neither fits nor fills {self.heads}-row CTAs")
        self.cols = COLS
        self.block = block_for(slots_per_cta)
        self.splits = k // slots_per_cta
        # 64-row CTAs: two warpgroups of wgmma and a producer (partial_wgmma_ws); 16 / 32 rows: mma.sync warps
        self.wgmma = self.heads == WG_ROWS
        if self.wgmma and producer is False:
            raise ValueError("SparseCore's 64-row CTAs always have a producer warpgroup (producer=False: 16 rows only)")
        most = TRANSPOSED_BLOCKS["fp8" if mla_fp8 else "bf16"]
        by_default = producer is None and 1 <= slots_per_cta // self.block <= most  # (producer=True: partial_mma_ws)
        wanted = by_default if transposed is None else transposed
        self.transposed = bool(wanted) and self.heads == T_ROWS and self.block == WG_ROWS and producer is not False
        if self.transposed or self.wgmma:
            self.producer = True
        else:  # partial_mma_ws: 16 rows only
            if producer and self.heads != 16:
                raise ValueError("SparseCore's mma.sync producer path needs 16 rows per CTA")
            least = MMA_PRODUCER_BLOCKS["fp8" if mla_fp8 else "bf16"]
            default = self.heads == 16 and slots_per_cta // self.block >= least
            self.producer = default if producer is None else producer
        self.mma_ws = self.producer and not (self.wgmma or self.transposed)
        self.clustered = self.mma_ws and 1 < self.splits <= CLUSTER_SPLITS  # the combine in the cluster
        # partial_mma_ws: rows 0 .. bulk_rows - 1 of each block by bulk copies, the rest by cp.async
        self.bulk_rows = 0
        if self.mma_ws:
            sixteenths = MMA_BULK_SIXTEENTHS["fp8" if mla_fp8 else "bf16"]
            if not 0 <= sixteenths <= 16:
                raise ValueError(f"sparse_core.MMA_BULK_SIXTEENTHS must be 0 .. 16, got {sixteenths}")
            self.bulk_rows = self.block * sixteenths // 16
        self.consumers = self.heads // 16 * self.cols * 32  # the mma.sync paths' computing threads
        if self.wgmma or self.transposed:
            self.stages = 2
        elif self.mma_ws:
            self.stages = ws_stages(self.block, mla_fp8)
            ring = self.stages * self.block * (FP8_ROW if mla_fp8 else STRIDE)
            if self.clustered and ring < 16 * LATENT * 4 + 16 * 8:  # cluster_combine's staging
                raise ValueError(f"SparseCore's ring ({ring} B) cannot stage a split's 16 rows for the cluster")
        else:
            self.stages = ring_stages(self.heads, self.block, slots_per_cta, mla_fp8)
        want = CROSSOVER["fp8" if mla_fp8 else "bf16"] if crossover is None else crossover
        paired = self.wgmma and (q_heads // self.heads) % 2 == 0  # the head-group axis pairs up
        self.crossover = bool(want) and paired and self.block == WG_ROWS
        # FlashMLA's consumer shape: under the crossover always, else up to RESHAPE_BLOCKS blocks
        reshaped = self.crossover or slots_per_cta // self.block <= RESHAPE_BLOCKS
        self.reshape = self.wgmma and reshaped
        self.values_rs = self.reshape and bool(VALUES_RS)
        self.probe = PROBE if self.producer else ""
        self.probes = frozenset(p for p in self.probe.split("+") if p)
        self.combine = COMBINE
        self.combine_early = bool(COMBINE_EARLY)
        if not self.probes <= set(PROBES):
            raise ValueError(f"sparse_core.PROBE must join some of {PROBES} by '+', got {self.probe!r}")
        if self.probing("no_dequant") and not ((self.wgmma or self.transposed) and mla_fp8):
            raise ValueError("sparse_core.PROBE 'no_dequant' probes the dequantizing producers over the fp8 cache only")
        traced = self.crossover and self.reshape and self.splits == 1 and slots_per_cta // self.block <= TRACE_BLOCKS
        if self.probing("trace") and not traced:
            raise ValueError("sparse_core.PROBE 'trace' traces the crossover at one split only (its partial_o is free)")
        # (the transposed path's two producer warpgroups load one share each, as crossover CTAs)
        self.prefetch = (self.crossover or self.transposed) and mla_fp8 and bool(XOVER_PREFETCH)
        self.skip_unmoved = (self.reshape or self.transposed) and bool(SKIP_UNMOVED)
        for path in FP8_ROW_LOAD_PATHS:
            name, value, allowed = f"FP8_ROW_LOADS[{path!r}]", FP8_ROW_LOADS.get(path), FP8_ROW_LOAD_FORMS
            if value not in allowed:
                raise ValueError(f"sparse_core.{name} must be one of {allowed}, got {value!r}")
        # the fp8 rows' loads of the wgmma paths' producers at 64-slot blocks (fetch_rows; the
        # mma.sync paths copy raw rows, and smaller blocks map a row's chunks over more threads)
        wide_map = (self.wgmma or self.transposed) and self.block == WG_ROWS
        form = FP8_ROW_LOADS["transposed" if self.transposed else "wgmma"]
        self.fp8_row_loads = form if wide_map and mla_fp8 else "8B"
        self.wide_fp8 = self.fp8_row_loads != "8B"
        for probe in ("no_push", "cta_full"):
            if self.probing(probe) and not self.crossover:
                raise ValueError(f"sparse_core.PROBE {probe!r} probes the crossover only")
        if self.wgmma or self.transposed:
            self.threads = WS_THREADS
        else:
            self.threads = self.consumers + (PRODUCER_THREADS if self.mma_ws else 0)
        # the combine: warps per (quarter, head), and heads per CTA
        if not 0 <= COMBINE_WARP_SPLITS <= 32:  # (combine_warp: split s's (max, sum) in lane s)
            raise ValueError(f"sparse_core.COMBINE_WARP_SPLITS must be 0 .. 32, got {COMBINE_WARP_SPLITS}")
        self.combine_warps = 1 if self.splits <= COMBINE_WARP_SPLITS else 4
        self.combine_heads = 4 // self.combine_warps
        self.q_bytes = ROW * (1 if q_fp8 else 2)
        self.row_bytes = FP8_ROW if mla_fp8 else 2 * ROW
        # one 16-row tile: its A fragments of all 36 k steps stay in registers (144 per thread)
        self.q_in_registers = self.heads == 16

    def probing(self, probe: str) -> bool:
        """Whether sparse_core.PROBE (one probe, or several joined by "+") holds `probe`."""
        return probe in self.probes

    @cute.jit
    def __call__(
        self,
        q_rows: cute.Pointer,
        slots: cute.Pointer,
        cache: cute.Pointer,
        partial_o: cute.Pointer,
        partial_ml: cute.Pointer,
        out: cute.Pointer,
        lse: cute.Pointer,
        q_out: cute.Pointer,
        batch: Int32,
        error: cute.Pointer,
        pool_slots: Int32,
        budget_ns: Int64,
        stream: cuda.CUstream,
    ):
        self.sparse_core_partial(
            q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots, budget_ns
        ).launch(
            grid=[self.splits, self.q_heads // self.heads, batch],
            block=[self.threads, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
            # the producer path: ptxas gives it the most registers a 384-thread CTA may have
            # (168), the pool its setmaxnreg re-deals (left to itself it may take fewer, and
            # the consumers' setmaxnreg.inc would wait forever)
            min_blocks_per_mp=1 if self.producer else 0,
            # clustered: a token's split CTAs; crossover: the two head groups' CTAs of a
            # (split, token), along the grid's y (q_heads / 64 even, so 2 divides it)
            cluster=[self.splits, 1, 1] if self.clustered else ([1, 2, 1] if self.crossover else [1, 1, 1]),
        )
        if cutlass.const_expr(self.splits > 1 and self.combine and not self.clustered):
            self.sparse_core_combine(partial_o, partial_ml, out, lse, q_rows, q_out).launch(
                grid=[LATENT // 128, (self.gathered + self.combine_heads - 1) // self.combine_heads, batch],
                block=[128, 1, 1],
                stream=stream,
                use_pdl=self.pdl,
            )

    # -- partial --------------------------------------------------------------------------

    @cute.kernel
    def sparse_core_partial(
        self,
        q_rows: cute.Pointer,
        slots: cute.Pointer,
        cache: cute.Pointer,
        partial_o: cute.Pointer,
        partial_ml: cute.Pointer,
        out: cute.Pointer,
        lse: cute.Pointer,
        q_out: cute.Pointer,
        error: cute.Pointer,
        pool_slots: Int32,
        budget_ns: Int64,
    ):
        if cutlass.const_expr(self.poll):
            self.await_query_rows(q_rows, error, budget_ns)
        if cutlass.const_expr(self.wgmma):
            self.partial_wgmma_ws(q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots)
        elif cutlass.const_expr(self.transposed):
            self.partial_transposed_ws(q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots)
        elif cutlass.const_expr(self.mma_ws):
            self.partial_mma_ws(q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots)
        else:
            self.partial_mma_sync(q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots)

    @cute.jit
    def await_query_rows(self, q_rows, error, budget_ns):
        """poll: spin until every chunk of the CTA's query rows is published, then an acquire
        fence and a CTA barrier (each thread polled a share). Before the PDL wait: the rows
        come from the side stream, not the kernel before this one. A chunk missing past the
        budget is recorded as its index over [batch, gathered, row chunks], the form
        MailboxTimeout names."""
        tid, _, _ = cute.arch.thread_idx()
        _, group, token = cute.arch.block_idx()
        head0 = group * self.heads
        row_chunks = self.q_bytes // 16
        P.poll_mailbox(
            q_rows + (token * self.q_heads + head0) * self.q_bytes,
            error,
            tid,
            Int32(self.threads),
            Int32(1),
            P.globaltimer() + budget_ns,
            min(self.heads, self.gathered),
            self.q_heads,
            row_chunks,
            0,
            0,
            (token * self.gathered + head0) * row_chunks,
        )
        # acquire: the rows seen published (relaxed volatile loads) order the reads after this,
        # of the rows and of the cache rows MlaQuery inserted before publishing them
        P.fence_acq_rel_gpu()
        cute.arch.sync_threads()

    @cute.jit
    def publish_rows(self, q_rows, q_out, token, head0, rows: int, tid, threads: int):
        """Query rows head0 .. head0 + rows - 1 (those below `gathered`) of a token: copied to
        q_out [token, gathered, q_bytes] and re-armed (sentinel 0xFF bytes) in q_rows. Every
        load is issued first; each thread re-arms only the chunks it read itself."""
        chunks = self.q_bytes // 16
        moves = []
        for i in cutlass.range_constexpr((rows * chunks + threads - 1) // threads):
            index = tid + i * threads
            h, c = index // chunks, index % chunks
            live = index < rows * chunks and head0 + h < self.gathered
            src = q_rows + (token * self.q_heads + head0 + h) * self.q_bytes + 16 * c
            dst = q_out + (token * self.gathered + head0 + h) * self.q_bytes + 16 * c
            moves.append((P.load_u32x4_if(src, live), live, src, dst))
        for words, live, src, dst in moves:
            if live:
                P.store_u32x4(dst, words)
                P.store_u32x4(src, [Uint32(SENTINEL_WORD)] * 4)

    @cute.jit
    def publish_quarter(self, q_rows, q_out, token, head, quarter, thread):
        """Quarter `quarter` of query row (token, head): copied to q_out and re-armed, a 16-byte
        chunk by each caller whose `thread` (its tid or lane) is below 18 (bf16 rows) or 9 (e4m3)."""
        chunks = self.q_bytes // 16 // 4  # 18 (bf16 rows) or 9 (e4m3)
        if thread < chunks:
            offset = quarter * chunks * 16 + 16 * thread
            src = q_rows + (token * self.q_heads + head) * self.q_bytes + offset
            words = P.load_u32x4(src)
            P.store_u32x4(q_out + (token * self.gathered + head) * self.q_bytes + offset, words)
            P.store_u32x4(src, [Uint32(SENTINEL_WORD)] * 4)

    @cute.jit
    def begin_combine(self, q_rows, q_out, token, head, quarter, thread, live):
        """The combine's opening: its wait for the partial grid, its dependents launched, and,
        every partial CTA (the query rows' readers) having finished, the rows' publish
        (publish_quarter; `live`: a real head). Under the combine_early probe only the launch:
        the wait and the publish move to end_combine."""
        if cutlass.const_expr(not self.combine_early):
            cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.publish and not self.combine_early):
            if live:
                self.publish_quarter(q_rows, q_out, token, head, quarter, thread)

    @cute.jit
    def end_combine(self, q_rows, q_out, token, head, quarter, thread, live):
        """Under the combine_early probe, the wait and the publish begin_combine left."""
        if cutlass.const_expr(self.combine_early):
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.publish):
                if live:
                    self.publish_quarter(q_rows, q_out, token, head, quarter, thread)

    @cute.jit
    def merge_max(self, top) -> Float32:
        """The max the splits' weights 2^(max_s - max) are taken against: 0 where every split
        is empty (max -inf), so each weight is 0, not NaN."""
        return P.select(top == Float32(-math.inf), Float32(0), top)

    @cute.jit
    def inverse_of(self, total) -> Float32:
        """1 / the softmax sum, 0 for a row with no live slot (its out is 0)."""
        return P.select(total > Float32(0), Float32(1) / total, Float32(0))

    @cute.jit
    def lse_of(self, top, total) -> Float32:
        """Natural-log lse from the log2-unit max and the sum at that max (-inf: no slot)."""
        return P.select(total > Float32(0), (top + cute.math.log2(total)) * Float32(math.log(2.0)), Float32(-math.inf))

    # -- combine --------------------------------------------------------------------------

    @cute.kernel
    def sparse_core_combine(
        self,
        partial_o: cute.Pointer,
        partial_ml: cute.Pointer,
        out: cute.Pointer,
        lse: cute.Pointer,
        q_rows: cute.Pointer,
        q_out: cute.Pointer,
    ):
        tid, _, _ = cute.arch.thread_idx()
        quarter, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        if cutlass.const_expr(self.combine_warps == 1):
            head = group * self.combine_heads + warp
            self.combine_warp(partial_o, partial_ml, out, lse, q_rows, q_out, quarter, head, token, lane)
        else:
            smem = cutlass.memory.SmemAllocator()
            weights = smem.allocate_tensor(Float32, cute.make_layout(self.splits), byte_alignment=16)
            red = smem.allocate_tensor(Float32, cute.make_layout(4 * 128), byte_alignment=16)
            self.combine_cta(
                partial_o, partial_ml, out, lse, q_rows, q_out, quarter, group, token, tid, lane, warp, weights, red
            )

    @cute.jit
    def combine_warp(self, partial_o, partial_ml, out, lse, q_rows, q_out, quarter, head, token, lane):
        """One warp combines (quarter, head) of a token: no shared memory, no barrier."""
        live_head = head < self.gathered  # (the last CTA of four heads may have fewer)
        row = cutlass.min(head, self.gathered - 1)
        self.begin_combine(q_rows, q_out, token, row, quarter, lane, live_head)
        first = token * self.splits * self.q_heads + row  # split s at first + s x q_heads
        # every load first: each split's partial output (lane l: dims 4l .. 4l + 3 of the
        # quarter), then its (max, sum) in lane s
        dims = quarter * 128 + 4 * lane
        outputs = []
        for s in cutlass.range_constexpr(self.splits):
            outputs.append(P.load_f32x4(partial_o + (first + s * self.q_heads) * LATENT + dims))
        live = lane < self.splits
        ml = P.load_f32x2_if(partial_ml + 2 * (first + cutlass.min(lane, self.splits - 1) * self.q_heads), live)
        split_max = P.select(live, ml[0], Float32(-math.inf))
        top = P.warp_max(split_max)
        w = P.exp2_approx(split_max - self.merge_max(top))  # 0 past the splits or for an empty split
        total = P.warp_sum(w * ml[1])
        sums = [Float32(0)] * 4
        for s in cutlass.range_constexpr(self.splits):
            weight = cute.arch.shuffle_sync(w, offset=s)
            for d in cutlass.range_constexpr(4):
                sums[d] = sums[d] + weight * outputs[s][d]
        if live_head:
            self.store_combined(sums, top, total, out, lse, token, row, quarter, lane)
        self.end_combine(q_rows, q_out, token, row, quarter, lane, live_head)

    @cute.jit
    def combine_cta(
        self, partial_o, partial_ml, out, lse, q_rows, q_out, quarter, head, token, tid, lane, warp, weights, red
    ):
        """The CTA's four warps combine (quarter, head) of a token, warp w splits w, w + 4, ...,
        meeting in shared memory (the splits' weights, the block reductions, the sums)."""
        self.begin_combine(q_rows, q_out, token, head, quarter, tid, True)
        first = token * self.splits * self.q_heads + head  # split s at first + s x q_heads
        # every load first: warp w's partial outputs (splits w, w + 4, ...; lane l dims
        # 4l .. 4l + 3 of the quarter) and the splits' (max, sum) over the CTA's threads
        dims = quarter * 128 + 4 * lane
        mine = (self.splits + 3) // 4
        outputs = []
        for u in cutlass.range_constexpr(mine):
            s = 4 * u + warp
            outputs.append(
                P.load_f32x4_if(
                    partial_o + (first + cutlass.min(s, self.splits - 1) * self.q_heads) * LATENT + dims,
                    s < self.splits,
                )
            )
        stats = []
        for s0 in cutlass.range_constexpr(0, self.splits, 128):
            live = s0 + tid < self.splits
            ml = P.load_f32x2_if(partial_ml + 2 * (first + cutlass.min(s0 + tid, self.splits - 1) * self.q_heads), live)
            stats.append((P.select(live, ml[0], Float32(-math.inf)), ml[1], live))
        # the global max and the weights 2^(max_s - max)
        top = Float32(-math.inf)
        for i in cutlass.range_constexpr(len(stats)):
            top = cute.arch.fmax(top, stats[i][0])
        top = self.block_reduce(top, red, lane, warp, True)
        use = self.merge_max(top)
        total = Float32(0)
        for i in cutlass.range_constexpr(len(stats)):
            split_max, split_sum, live = stats[i]
            w = P.exp2_approx(split_max - use)  # 0 for a split with no live slot, or past the splits
            if live:
                weights[128 * i + tid] = w
            total = total + w * split_sum
        total = self.block_reduce(total, red, lane, warp, False)  # (its barriers publish the weights)

        sums = [Float32(0)] * 4
        for u in cutlass.range_constexpr(mine):
            s = 4 * u + warp
            w = P.select(s < self.splits, weights[cutlass.min(s, self.splits - 1)], Float32(0))
            for d in cutlass.range_constexpr(4):
                sums[d] = sums[d] + w * outputs[u][d]
        for d in cutlass.range_constexpr(4):
            red[warp * 128 + 4 * lane + d] = sums[d]
        cute.arch.sync_threads()
        if warp == 0:
            for d in cutlass.range_constexpr(4):
                sums[d] = red[4 * lane + d]
                for peer in cutlass.range_constexpr(1, 4):
                    sums[d] = sums[d] + red[128 * peer + 4 * lane + d]
            self.store_combined(sums, top, total, out, lse, token, head, quarter, lane)
        self.end_combine(q_rows, q_out, token, head, quarter, tid, True)

    @cute.jit
    def store_combined(self, sums, top, total, out, lse, token, head, quarter, lane):
        """Quarter `quarter` of out (token, head) from the splits' weighted sums (lane l: dims
        4l .. 4l + 3) over their total, and (quarter 0, lane 0) its lse."""
        inverse = self.inverse_of(total)
        dst = out + (token * self.gathered + head) * LATENT + quarter * 128 + 4 * lane
        P.store_f32x2(dst, sums[0] * inverse, sums[1] * inverse)
        P.store_f32x2(dst + 2, sums[2] * inverse, sums[3] * inverse)
        if quarter == 0 and lane == 0:
            P.store_f32(lse + token * self.gathered + head, self.lse_of(top, total))

    @cute.jit
    def block_reduce(self, value, red, lane, warp, is_max: bool) -> Float32:
        """Max or sum of `value` over the CTA's 128 threads (every thread gets it)."""
        for offset in P.BUTTERFLY:
            other = cute.arch.shuffle_sync_bfly(value, offset=offset)
            value = cute.arch.fmax(value, other) if is_max else value + other
        if lane == 0:
            red[warp] = value
        cute.arch.sync_threads()
        result = red[0]
        for w in cutlass.range_constexpr(1, 4):
            result = cute.arch.fmax(result, red[w]) if is_max else result + red[w]
        cute.arch.sync_threads()
        return result


def compile_args():
    f32 = P.gmem_ptr(Float32)
    return (
        P.gmem_ptr(Uint8),
        P.gmem_ptr(Int32),
        P.gmem_ptr(Uint8),
        f32,
        P.gmem_ptr(Float32, align=8),
        f32,
        P.gmem_ptr(Float32, align=4),
        P.gmem_ptr(Uint8),
        Int32(1),
        P.gmem_ptr(Int32, align=8),
        Int32(1),
        Int64(1),
    )
