"""SparseCore: sparse MLA decode over each token's selected cache slots, flash-decoding style.

    out[b, h] = softmax_k(scale x q[b, h] . row[slot_k]) @ row[slot_k][:512],  lse[b, h]

Launches
partial  grid (splits, q_heads / heads_per_cta, tokens). A CTA owns `heads_per_cta` query rows
         (16, 32 or 64) of one token and a run of `slots_per_cta` consecutive entries of its
         slot list, walked in blocks of `block` slots, each block's cache rows copied into
         shared memory once and used for both the scores and P @ V. Online softmax in the log2
         domain. It writes the split's unnormalized output and (max, sum), max in log2 units;
         with one split (slots_per_cta = k) it normalizes and writes out and lse itself.
combine  grid (4 quarters of the 512 latent dims, gathered heads, tokens), 128 threads: the
         splits' (max, sum) -> weights 2^(max_s - max), the weighted sum of their partial
         outputs (warp w takes splits w, w + 4, ..., every load issued before the weights),
         out = sum / total, lse = (max + log2(total)) x ln 2 (natural log). Not launched with
         one split, nor where partial_mma_ws has 2 .. CLUSTER_SPLITS splits: there a token's
         split CTAs form one cluster and combine through distributed shared memory
         (cluster_combine).

The partial kernel's paths (the constructor picks one from the rows per CTA and the cache):
16 / 32 rows: warps of mma.sync m16n8k16 (fp32 accumulators), one 16-row M tile per row of
  warps, COLS column warps per tile; warp (mt, c) scores the block's 8-slot tiles c x per ..
  c x per + per - 1 and owns latent dims 512 / COLS x [c, c + 1) of P @ V, rescaled when the
  row max moves.
  partial_mma_sync  every warp copies: cp.async 16-byte chunks (-1 slots zero-filled) into a
                    ring of `ring_stages` blocks, fp8 rows dequantized to bf16 in shared memory
                    once a block; CTA barriers between a block's phases (copies landed, row
                    maxima, P written, buffers free). Query rows as A (registers at 16 rows),
                    the block's rows as B by ldmatrix, P as bf16 through shared memory, the rows
                    again by ldmatrix.trans for P @ V.
  partial_mma_ws    16 rows only, from MMA_PRODUCER_BLOCKS[cache] blocks a CTA: a producer
                    warpgroup fills the ring behind full / empty mbarriers (no CTA barrier in
                    the loop), warp 0 by one cp.async.bulk per row for
                    MMA_BULK_SIXTEENTHS[cache] / 16 of the block, warps 1-3 by 16-byte cp.async
                    for the rest. Over the fp8 cache the consumers widen the raw e4m3 words
                    straight into f16 operands, each 128-dim group's scale applied to its
                    partial score and to P (f16, consume_ring).
64 rows (TP 1; DCP 4 at TP 8): two warpgroups of wgmma on shared operands in the no-swizzle
  canonical layout, P @ V at m64n256k16 (each warpgroup 256 of the 512 latent dims).
  partial_wgmma     256 threads that copy and compute (PRODUCER off); each warpgroup scores
                    half the block (m64n(block / 2)k16).
  partial_wgmma_ws  PRODUCER: a third warpgroup loads (and dequantizes) the blocks behind full /
                    empty mbarriers (384 threads, setmaxnreg). Past RESHAPE_BLOCKS blocks a CTA
                    the consumers score half-blocks as partial_wgmma does; up to it they take
                    FlashMLA's shape: warpgroup 0 scores whole blocks (m64n(block)k16) and does
                    P @ V on dims 0 .. 255 with P from registers, warpgroup 1 dims 256 .. 511.
  crossover         CROSSOVER (with the producer): a token's two 64-row CTAs (head groups 2 i,
                    2 i + 1) of a split launch as a cluster of 2; each producer loads half of
                    every block's rows (XOVER_ROWS) into its own tile and, by st.async completing
                    on the peer's full mbarrier, into the peer's, so each SM moves and
                    dequantizes half the rows (produce_blocks has the protocol); FlashMLA's
                    consumer shape at every block count. A cluster launch puts the CTA's rank in
                    its shared addresses' high bits, so every wgmma descriptor masks the address
                    to its 18-bit field (primitives.smem_desc_lines). Without a partner
                    (q_heads / 64 odd) or under 64-slot blocks: partial_wgmma_ws.
Why each default is what it is (the alternatives as measured): docs/levers.md Part S.

poll (the step's fork_poll mode on one rank): before its PDL wait each partial CTA spins until
the query rows it reads are published in the mailbox (every 16-byte chunk off the sentinel,
`primitives.poll_mailbox`, bounded by budget_ns: a chunk still missing is recorded and the
step raises MailboxTimeout), so the step joins MlaQuery's side stream after the sparse core
rather than before it: a graph node with two predecessors is not launched early under PDL
(it started 1.4-1.7 us after TopK's end at TP 8 32K; bench/RESULTS.md, session 15). The rows'
publisher ran after MlaQuery's KV insert, so rows seen published (then an acquire fence) mean
the new tokens' cache rows are in place too. A launch polls only where its grid has at most
POLL_MAX_CTAS CTAs (graphstep's launcher refuses more), so some SMs always stay free for
MlaQuery's kernels.

publish (the step's launch): the kernel that reads the query rows last also copies them to
q_out and re-arms them in the mailbox (0xFF) -- the partial kernel with one split (each CTA
its rows' only reader), else the combine (after every partial CTA; clustered: split 0's CTA
after the cluster barrier) -- so no torch copy and fill follow the launch.

`plan(batch, q_heads, k)` picks slots_per_cta on the host so that a launch is about one wave
of CTAs (heads_per_cta follows q_heads).

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

from . import guards
from . import primitives as P

ROW, LATENT = 576, 512
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"kv_lora_rank": (LATENT,), "qk_rope_dim": (ROW - LATENT,)}
STRIDE = 2 * ROW + 16  # bytes per bf16 row in shared memory (+16: ldmatrix rows hit distinct banks)
FP8_ROW = 656  # 512 e4m3 | 4 fp32 scales | 64 bf16 rope
BF16_CHUNKS, FP8_CHUNKS = 2 * ROW // 16, FP8_ROW // 16  # 16-byte chunks per cache row
K_STEPS = ROW // 16  # MMA k steps of a score
SMEM_BYTES = 232448  # the H100/H200 per-CTA opt-in limit (227 KB)
LOG2E = 1.4426950408889634
SENTINEL_WORD = 0xFFFFFFFF  # an unpublished mailbox chunk (graphstep/formats.py)
WAVE = 128  # CTAs a plan aims for (132 SMs, one CTA each)
# 64-row CTAs (wgmma): shared operands in the no-swizzle canonical layout, 16-byte chunks of
# 8 dims; chunk c of row r at c x CHUNK + r x 16 (64 rows: 8-row core matrices 128 B apart)
WG_ROWS, WG_THREADS = 64, 256  # two consumer warpgroups
CHUNK = WG_ROWS * 16  # bytes between k chunks (the K-major LBO)
TILE_BYTES = (ROW // 8) * CHUNK  # 64 rows x 576 dims as bf16: the query rows, or a block of cache rows
TILE_CHUNKS = ROW // 8  # 72
# The default path of 64-row CTAs by cache format: True = partial_wgmma_ws (a producer
# warpgroup loads and dequantizes, 2 x CONSUMER_REGS + PRODUCER_REGS by setmaxnreg out of
# 3 x 168), False = partial_wgmma. Faster over the fp8 cache; over bf16 it ties the plain
# kernel, and is on because the crossover needs it (levers.md S.5).
PRODUCER = {"fp8": True, "bf16": True}
WS_THREADS = 3 * 128
CONSUMER_REGS, PRODUCER_REGS = 184, 136
CONSUMER_BAR = 1  # the named barrier of the two consumer warpgroups (bar.sync 1, 256)
# partial_wgmma_ws's consumers in FlashMLA's shape (consume_blocks' roles 0 and 1) for at most
# this many blocks a CTA, else the half-block scorers (role None): FlashMLA's keeps every row
# max in warpgroup 0 (no max crosses warpgroups) but overlaps the producer less, so it wins
# only at 1-2 blocks (levers.md S.6). setmaxnreg scorer / values / producer below.
RESHAPE_BLOCKS = 2
SCORER_REGS, VALUES_REGS, RESHAPE_PRODUCER_REGS = 200, 160, 144
P_READY, P_FREE = 2, 3  # named barriers (256 threads): P and the factors written / read
# The crossover per cache format (the module docstring; produce_blocks has the protocol),
# with FlashMLA's consumer shape at every block count (XOVER_RESHAPE_BLOCKS). Measured in
# levers.md S.7.
CROSSOVER = {"fp8": True, "bf16": True}
XOVER_RESHAPE_BLOCKS = 1 << 30  # under the crossover: FlashMLA's consumer shape at every block count
XOVER_ROWS = WG_ROWS // 2  # the rows of a block each CTA of the pair loads
XOVER_BYTES = XOVER_ROWS * TILE_CHUNKS * 16  # what one producer pushes into the peer a block: 36,864
# Device probes of the producer paths (bench/bench_sparse_core.py --probes; wrong results):
# "no_loads": the producer loads nothing (every slot a hole) but dequantizes and stores as
# usual (partial_mma_ws: copies nothing, every block computed); "no_math": the consumers only
# wait for each block and release it.
PROBES = ("", "no_loads", "no_math")
PROBE = ""
# A device probe of any path (bench_sparse_core.py --probes no_combine): False launches no
# combine kernel, so a split token's out and lse are never written (wrong results): the
# partial kernel's own time in a graph, against which the combine's share is judged.
COMBINE = True
# 16-row CTAs take partial_mma_ws from this many blocks a CTA, per MLA cache, else
# partial_mma_sync: with the bf16 cache always; with fp8 from 8 blocks (TP 8, B >= 32), below
# which the two tie or the plain kernel wins (levers.md S.2; bench_sparse_core.py --paths
# msync,mws compares them).
MMA_PRODUCER_BLOCKS = {"bf16": 1, "fp8": 8}
PRODUCER_THREADS = 128  # setmaxnreg acts on whole warpgroups
# partial_mma_ws with 2 .. CLUSTER_SPLITS splits a token (TP 8: B = 64) launches each token's
# split CTAs as one cluster and combines there (cluster_combine): each CTA leaves its
# unnormalized rows and (max, sum) in its own shared memory, and after a cluster barrier CTA
# s combines latent dims [512 s / splits, 512 (s + 1) / splits) of every row from all the
# cluster's CTAs (DSMEM): no partials in global memory, no combine launch. Not past 2: 4- and
# 8-CTA clusters do not all fit one wave (whole GPCs only; levers.md S.4).
CLUSTER_SPLITS = 2
# partial_mma_ws's producer warpgroup copies each block's rows two ways at once, both
# completing on the stage's full mbarrier: its first MMA_BULK_SIXTEENTHS[cache] / 16 by warp
# 0's cp.async.bulk (one per row: the SM's bulk-copy unit), the rest by warps 1-3's 16-byte
# cp.async.cg (the load/store path: separate hardware). The shares make the two finish
# together at the rates each showed alone (levers.md S.3; bench_sparse_core.py --paths
# mws<N> sets N sixteenths).
MMA_BULK_SIXTEENTHS = {"bf16": 10, "fp8": 9}
# partial_mma_ws's setmaxnreg: 384 threads launch at 168 registers, re-dealt as 2 x 232 + 40
# (the consumers hold 32 (fp8) or 36 (bf16) k steps of A fragments; the producer only issues
# copies: bulk copies and 16-byte cp.async).
MMA_CONSUMER_REGS, MMA_PRODUCER_REGS = 232, 40
# partial_mma_ws over the fp8 cache: f16 MMA operands (e4m3 widens into f16 exactly), each
# brought under f16's 65504 by a power of two undone in fp32 (consume_ring): bf16 query rows
# x 2^(Q_F16_TOP - E_row) (E_row: the exponent of the row's largest latent element; P.pow2_fit),
# P x scale x 2^(P_F16_TOP - E_row) (E_row: the exponent of the row's largest P x scale so
# far; P.pow2_ceil).
Q_F16_TOP, P_F16_TOP = 15, 14


def heads_per_cta(q_heads: int) -> int:
    """Query rows per CTA: 64 where they divide (KV rows read once per 64 heads), else 32 or 16."""
    for m in (64, 32, 16):
        if q_heads % m == 0:
            return m
    raise ValueError(f"SparseCore needs q_heads % 16 == 0, got {q_heads}")


# Column warps per 16-row M tile of the mma.sync path (16- and 32-row CTAs), 64 latent dims
# each; 64-row CTAs take the wgmma path and have none.
COLS = 8


def block_for(slots_per_cta: int) -> int:
    """Slots per shared-memory block: 64 (at most slots_per_cta)."""
    return min(64, slots_per_cta)


def min_slots(q_heads: int) -> int:
    """The fewest slots per CTA a plan picks: 32, or 64 for 64-row CTAs, whose partials are
    4x a 16-row CTA's (TP 1, B = 1 on the H200: 13.9 us at 64 slots against 18.8 at 32, the
    combine reading 16.8 MB of partials; bench/RESULTS.md)."""
    return 64 if heads_per_cta(q_heads) == WG_ROWS else 32


def plan(batch: int, q_heads: int, k: int) -> int:
    """slots_per_cta for a launch of `batch` tokens: the largest power of two >= min_slots
    that still gives about one wave (>= WAVE CTAs), at most k. (16 slots per CTA fill the
    GPU at B = 1 but double the partials the combine reads: 7.9 us against 6.5 us at 32 on
    the H200, bench/RESULTS.md.)"""
    groups = q_heads // heads_per_cta(q_heads)
    slots = min(min_slots(q_heads), k)
    while slots * 2 <= k and k % (slots * 2) == 0 and batch * groups * (k // (slots * 2)) >= WAVE:
        slots *= 2
    return slots


def ring_stages(heads: int, block: int, slots_per_cta: int, mla_fp8: bool) -> int:
    """Blocks in the shared-memory ring: as many as fit (2 .. 4, at most the CTA's blocks,
    at least 2), the rest of shared memory being the query rows (unless they live in
    registers: then they share the ring's first stage), P, the slot ids and a scratch row."""
    stage = block * (FP8_ROW if mla_fp8 else STRIDE)
    fixed = heads * (2 * block + 16) + 4 * slots_per_cta + 4 * 8 * heads + 1024  # P, ids, scratch, alignment
    fixed += block * STRIDE if mla_fp8 else 0  # the dequantized block
    fixed += 0 if heads == 16 else heads * STRIDE
    fit = (SMEM_BYTES - fixed) // stage
    return max(2, min(4, fit, slots_per_cta // block))


def producer_map(ptid, v, block: int) -> tuple:
    """(row r of the block, first chunk group cg0, quarter q4) of partial_wgmma_ws's producer
    thread ptid (0 .. 127), share v (0 or 1: the shares of partial_wgmma's threads ptid and
    ptid + 128): its 16-byte chunks 4 (cg0 + step j) + q4 of row r, step = 8 / (block / 8).
    At 64-slot blocks share v is rows 32 v .. 32 v + 31: the crossover's CTA rank v loads
    that share alone. (Python ints on the host, the kernel's Int32 on the device.)"""
    groups = block // 8
    vwarp, vlane = ptid // 32 + 4 * v, ptid % 32
    return 8 * (vwarp % groups) + vlane % 8, vwarp // groups, vlane // 8


def ws_stages(block: int, mla_fp8: bool) -> int:
    """Blocks in partial_mma_ws's ring (2 .. 4, as many as fit): cache rows as they are in HBM
    (bf16 at STRIDE, raw fp8 rows) with their slot ids and live flag, beside P (four copies
    with the fp8 cache), the row maxima and the mbarriers; the fp8 cache's query rows have
    their own space (with their f16 powers of two, and P x scale's bounds beside the row
    maxima), the bf16 cache's pass through the last stage into registers (three 64-row bf16
    stages fit only so)."""
    stage = block * ((FP8_ROW if mla_fp8 else STRIDE) + 4) + 4
    fixed = 16 * (2 * block + 16) * (4 if mla_fp8 else 1) + 4 * 8 * 16 + 64 + 1024
    fixed += 16 * STRIDE + 4 * 16 * (1 + COLS) if mla_fp8 else 0  # (+ the rows' powers of two, P x scale's bounds)
    return max(2, min(4, (SMEM_BYTES - fixed) // stage))


# poll: the most partial CTAs one launch may have spinning on the mailbox before their PDL wait.
# Each can hold a whole SM (its ring fills the shared memory), so at most this many leave 4 of
# an H100 / H200's 132 SMs to MlaQuery's kernels, whatever the timing: the rows' publisher always
# progresses. Larger launches (B = 24, 40, 48, 56 by `plan`) join the side stream instead.
POLL_MAX_CTAS = 128


def partial_ctas(batch: int, q_heads: int, k: int, slots_per_cta: int | None = None) -> int:
    """The partial kernel's CTAs for a launch of `batch` tokens (at the plan's slots_per_cta
    unless given): splits x row groups x tokens."""
    return batch * (q_heads // heads_per_cta(q_heads)) * (k // (slots_per_cta or plan(batch, q_heads, k)))


def may_poll(batch: int, q_heads: int, k: int, slots_per_cta: int | None = None) -> bool:
    """Whether a launch of `batch` tokens (at the plan's slots_per_cta unless given) may poll
    the mailbox: its partial CTAs, each of which may hold an SM while it spins, leave some SMs
    to the rows' publisher (POLL_MAX_CTAS)."""
    return partial_ctas(batch, q_heads, k, slots_per_cta) <= POLL_MAX_CTAS


def partial_rows(batch: int, q_heads: int, k: int, slots_per_cta: int | None = None) -> int:
    """Partial-output rows (token x split) a launch of `batch` tokens (at the plan's
    slots_per_cta unless given) needs (0: one split, the partial kernel writes out and lse
    itself)."""
    splits = k // (slots_per_cta or plan(batch, q_heads, k))
    return batch * splits if splits > 1 else 0


# -- wgmma (64-row CTAs) ----------------------------------------------------------------------
# Descriptor bits besides the start address (PTX ISA, "Matrix Descriptor"; no swizzle):
# K-major ((8, m), (T, 2k)) : ((T, SBO), (1, LBO)): SBO between 8-row groups, LBO between
# k chunks. MN-major ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO)): SBO between 8-element
# groups along N, LBO between 8-row groups along K.
DESC_K = (128 >> 4) << 32 | (CHUNK >> 4) << 16  # Q, K and P: 8-row groups 128 B apart, k chunks CHUNK
DESC_V = (CHUNK >> 4) << 32 | (128 >> 4) << 16  # V (MN-major): 8-dim groups CHUNK apart, 8-slot groups 128 B


def wgmma_scores(q_addr, k_addr, n: int) -> list:
    """S[64 rows, n slots] = Q (shared, K-major) x K^T (shared rows, K-major B), bf16, FP32
    accumulation over the 36 k steps of 16 dims; issued, committed and waited for in one
    asm block. Thread (warp w of the warpgroup, g, t) gets s[4 j + 2 r + e] = row 16 w + g
    + 8 r, slot 8 j + 2 t + e."""
    d = ", ".join(f"{{$w{i}}}" for i in range(n // 2))
    lines = ["{", ".reg .b64 a0, b0, a, b;", ".reg .pred first, more;"]
    lines += P.smem_desc_lines("a0", "{$r0}", DESC_K) + P.smem_desc_lines("b0", "{$r1}", DESC_K)
    lines += ["setp.ne.b32 first, 0, 0;", "setp.eq.b32 more, 0, 0;", "wgmma.fence.sync.aligned;"]
    for s in range(K_STEPS):
        lines.append(f"add.s64 a, a0, {2 * CHUNK * s >> 4};")
        lines.append(f"add.s64 b, b0, {2 * CHUNK * s >> 4};")
        lines.append(
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, a, b, "
            f"{'first' if s == 0 else 'more'}, 1, 1, 0, 0;"
        )
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return list(
        cute.arch.inline_ptx("\n\t".join(lines), write_only_types=[Float32] * (n // 2), read_only_args=[q_addr, k_addr])
    )


def wgmma_wait(acc) -> list:
    """Wait for this warpgroup's wgmmas in flight (wgmma_values(..., wait=False)); the
    accumulators pass through, so nothing reads them before the wait."""
    count = len(acc)
    lines = ["wgmma.wait_group.sync.aligned 0;"] + [f"mov.f32 {{$w{i}}}, {{$r{i}}};" for i in range(count)]
    return list(cute.arch.inline_ptx("\n\t".join(lines), write_only_types=[Float32] * count, read_only_args=list(acc)))


def wgmma_values(acc, p_addr, v_addr, k_steps: int, wait: bool = True) -> list:
    """O[64 rows, 256 dims] += P (shared bf16, K-major: rows x slots) x V (the same shared
    cache rows read MN-major: slots x dims, transposed B), k_steps steps of 16 slots.
    acc: 128 FP32 in the accumulator layout (acc[4 j + 2 r + e]: row 16 w + g + 8 r, dim
    8 j + 2 t + e); returned updated."""
    count = len(acc)
    d = ", ".join(f"{{$w{i}}}" for i in range(count))
    lines = ["{", ".reg .b64 a0, b0, a, b;", ".reg .pred more;"]
    lines += P.smem_desc_lines("a0", f"{{$r{count}}}", DESC_K) + P.smem_desc_lines("b0", f"{{$r{count + 1}}}", DESC_V)
    lines += ["setp.eq.b32 more, 0, 0;"]
    lines += [f"mov.f32 {{$w{i}}}, {{$r{i}}};" for i in range(count)]
    lines += ["wgmma.fence.sync.aligned;"]
    for s in range(k_steps):
        lines.append(f"add.s64 a, a0, {2 * CHUNK * s >> 4};")
        lines.append(f"add.s64 b, b0, {16 * 16 * s >> 4};")
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{2 * count}k16.f32.bf16.bf16 {{{d}}}, a, b, more, 1, 1, 0, 1;")
    lines += ["wgmma.commit_group.sync.aligned;"] + (["wgmma.wait_group.sync.aligned 0;"] if wait else []) + ["}"]
    return list(
        cute.arch.inline_ptx(
            "\n\t".join(lines), write_only_types=[Float32] * count, read_only_args=list(acc) + [p_addr, v_addr]
        )
    )


class SparseCore:
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
    ):
        """publish: also copy the query rows read to q_out and re-arm them in q_rows (the
        step's mailbox) once every reader is done: the step's last touch of the mailbox,
        folded in here instead of a torch copy and fill after the launch.
        poll: each partial CTA first waits, before its PDL wait, until the query rows it
        reads are published (the module docstring): its rows below `gathered` (the padding
        rows above are never published), so gathered must fit one CTA or fill every CTA.
        producer: a producer loads the rows (64 rows: partial_wgmma_ws; 16 rows:
        partial_mma_ws), or every thread does (partial_wgmma, partial_mma_sync); None: the
        module's PRODUCER for the cache (64 rows), or partial_mma_ws from
        MMA_PRODUCER_BLOCKS[cache] blocks per CTA.
        crossover: partial_wgmma_ws's two head-group CTAs of a (split, token) as a cluster of 2,
        each producer loading half of every block (None: the module's CROSSOVER for the
        cache); only where it applies (64-row CTAs in pairs with a producer, 64-slot blocks),
        else today's kernel."""
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
        # 64-row CTAs: two warpgroups of wgmma (partial_wgmma); 16 / 32 rows: mma.sync warps
        self.wgmma = self.heads == WG_ROWS
        if self.wgmma:
            self.producer = PRODUCER["fp8" if mla_fp8 else "bf16"] if producer is None else producer
        else:  # partial_mma_ws: 16 rows only
            if producer and self.heads != 16:
                raise ValueError("SparseCore's mma.sync producer path needs 16 rows per CTA")
            least = MMA_PRODUCER_BLOCKS["fp8" if mla_fp8 else "bf16"]
            default = self.heads == 16 and slots_per_cta // self.block >= least
            self.producer = default if producer is None else producer
        self.mma_ws = self.producer and not self.wgmma
        self.clustered = self.mma_ws and 1 < self.splits <= CLUSTER_SPLITS  # the combine in the cluster
        # partial_mma_ws: rows 0 .. bulk_rows - 1 of each block by bulk copies, the rest by cp.async
        self.bulk_rows = 0
        if self.mma_ws:
            sixteenths = MMA_BULK_SIXTEENTHS["fp8" if mla_fp8 else "bf16"]
            if not 0 <= sixteenths <= 16:
                raise ValueError(f"sparse_core.MMA_BULK_SIXTEENTHS must be 0 .. 16, got {sixteenths}")
            self.bulk_rows = self.block * sixteenths // 16
        self.consumers = self.heads // 16 * self.cols * 32  # the mma.sync paths' computing threads
        if self.wgmma:
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
        self.crossover = bool(want) and paired and self.producer and self.block == WG_ROWS
        reshape_blocks = XOVER_RESHAPE_BLOCKS if self.crossover else RESHAPE_BLOCKS
        self.reshape = self.wgmma and self.producer and slots_per_cta // self.block <= reshape_blocks
        self.probe = PROBE if self.producer else ""
        self.combine = COMBINE
        if self.probe not in PROBES:
            raise ValueError(f"sparse_core.PROBE must be one of {PROBES}, got {self.probe!r}")
        if self.wgmma:
            self.threads = WS_THREADS if self.producer else WG_THREADS
        else:
            self.threads = self.consumers + (PRODUCER_THREADS if self.mma_ws else 0)
        self.q_bytes = ROW * (1 if q_fp8 else 2)
        self.row_bytes = FP8_ROW if mla_fp8 else 2 * ROW
        # one 16-row tile: its A fragments of all 36 k steps stay in registers (144 per thread)
        self.q_in_registers = self.heads == 16

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
                grid=[LATENT // 128, self.gathered, batch], block=[128, 1, 1], stream=stream, use_pdl=self.pdl
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
        if cutlass.const_expr(self.wgmma and self.producer):
            self.partial_wgmma_ws(q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots)
        elif cutlass.const_expr(self.wgmma):
            self.partial_wgmma(q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots)
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
    def partial_mma_sync(self, q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots):
        """16- and 32-row CTAs: warps of mma.sync m16n8k16 (the module docstring)."""
        tid, _, _ = cute.arch.thread_idx()
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        cols = self.cols
        mt, col = warp // cols, warp % cols
        m, block = self.heads, self.block
        smem = cutlass.memory.SmemAllocator()
        stage_bytes = block * (FP8_ROW if self.mla_fp8 else STRIDE)
        ring = smem.allocate_tensor(
            Uint8, cute.make_layout(max(self.stages * stage_bytes, m * STRIDE)), byte_alignment=128
        ).iterator  # bf16 rows, or raw fp8 rows
        q_s = ring  # query rows held in registers only pass through the ring's first stage
        if cutlass.const_expr(not self.q_in_registers):
            q_s = smem.allocate_tensor(Uint8, cute.make_layout(m * STRIDE), byte_alignment=128).iterator
        kv_s = ring
        if cutlass.const_expr(self.mla_fp8):
            kv_s = smem.allocate_tensor(Uint8, cute.make_layout(block * STRIDE), byte_alignment=128).iterator
        p_stride = 2 * block + 16
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(m * p_stride), byte_alignment=128).iterator
        ids_t = smem.allocate_tensor(Int32, cute.make_layout(self.slots_per_cta), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(cols * m), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # the slot ids and the query rows: every copy in flight at once
        head0 = group * m
        ids_chunks = self.slots_per_cta // 4
        for i in cutlass.range_constexpr((ids_chunks + self.threads - 1) // self.threads):
            c = tid + i * self.threads
            if c < ids_chunks:
                P.cp_async_16(ids_t.iterator + 4 * c, slots + token * self.k + split * self.slots_per_cta + 4 * c, True)
        self.load_queries(q_rows + (token * self.q_heads + head0) * self.q_bytes, head0, q_s, tid, self.threads)
        P.cp_async_commit()
        P.cp_async_wait(0)
        cute.arch.sync_threads()

        # lane -> ldmatrix row address parts (matrix i = lane / 8, row j = lane % 8)
        mi, mj = lane // 8, lane % 8
        a_row, a_col = mj + 8 * (mi % 2), 8 * (mi // 2)  # A tiles: (rows 0-7 | 8-15) x (k 0-7 | 8-15)
        q_lane = q_s + (mt * 16 + a_row) * STRIDE + 2 * a_col
        p_lane = p_s + (mt * 16 + a_row) * p_stride + 2 * a_col
        q_frags = []
        if cutlass.const_expr(self.q_in_registers):
            for ks in cutlass.range_constexpr(K_STEPS):
                q_frags.append(P.ldmatrix_x4(q_lane + 2 * 16 * ks))
            cute.arch.sync_threads()  # every warp holds its fragments: the ring may be overwritten
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        ntiles = LATENT // cols // 8  # P @ V n-tiles of 8 dims per warp
        per = max(1, block // 8 // cols)  # score tiles of 8 slots per warp

        acc_o = [[Float32(0)] * 4 for _ in range(ntiles)]
        row_max = [neg_inf, neg_inf]  # rows g, g + 8 (log2 units)
        row_sum = [Float32(0), Float32(0)]  # this thread's share
        blocks, stages = self.slots_per_cta // block, self.stages
        for b in cutlass.range_constexpr(stages - 1):  # the ring's first stages-1 blocks in flight
            self.issue_block(cache, ids_t, ring + b * stage_bytes, b * block, tid, pool_slots, error, token)
            P.cp_async_commit()
        if cutlass.const_expr(self.publish and self.splits == 1):  # this CTA is its rows' only reader
            self.publish_rows(q_rows, q_out, token, head0, self.heads, tid, self.threads)
        for b in range(blocks):
            ahead = b + stages - 1
            if ahead < blocks:  # into the stage block b - 1 used (freed by its closing barrier)
                self.issue_block(
                    cache, ids_t, ring + ahead % stages * stage_bytes, ahead * block, tid, pool_slots, error, token
                )
            P.cp_async_commit()
            P.cp_async_wait(stages - 1)  # block b's copies (this thread's) have landed
            cute.arch.sync_threads()
            kv = ring + b % stages * stage_bytes
            if cutlass.const_expr(self.mla_fp8):
                self.dequantize_block(kv, kv_s, tid)
                cute.arch.sync_threads()
                kv = kv_s

            # scores: column warp c takes 8-slot tiles c * per .. c * per + per - 1
            scores = [[neg_inf] * 4 for _ in range(per)]
            if col * per < block // 8:
                scores = self.score_tiles(q_lane, q_frags, kv, col * per, per, mi, mj)
                for j in cutlass.range_constexpr(per):
                    for q in cutlass.range_constexpr(4):
                        live = P.in_range(ids_t[b * block + (col * per + j) * 8 + 2 * t + q % 2], pool_slots)
                        scores[j][q] = P.select(live, scores[j][q] * scale, neg_inf)
            # the block's row max over the column warps
            for r in cutlass.range_constexpr(2):
                top = scores[0][2 * r]
                for j in cutlass.range_constexpr(per):
                    top = cute.arch.fmax(top, cute.arch.fmax(scores[j][2 * r], scores[j][2 * r + 1]))
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1))
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=2))
                if t == 0:
                    red[col * m + mt * 16 + g + 8 * r] = top
            cute.arch.sync_threads()
            alpha = [Float32(0), Float32(0)]
            use = [Float32(0), Float32(0)]
            for r in cutlass.range_constexpr(2):
                top = row_max[r]
                for c in cutlass.range_constexpr(cols):
                    top = cute.arch.fmax(top, red[c * m + mt * 16 + g + 8 * r])
                use[r] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
                alpha[r] = P.exp2_approx(row_max[r] - use[r])
                row_max[r] = top
                row_sum[r] = row_sum[r] * alpha[r]
            if col * per < block // 8:
                for j in cutlass.range_constexpr(per):
                    p = [P.exp2_approx(scores[j][q] - use[q // 2]) for q in range(4)]
                    row_sum[0] = row_sum[0] + p[0] + p[1]
                    row_sum[1] = row_sum[1] + p[2] + p[3]
                    at = p_s + (mt * 16 + g) * p_stride + 2 * ((col * per + j) * 8 + 2 * t)
                    P.st_shared_u32(at, P.pack_bf16x2(p[0], p[1]))
                    P.st_shared_u32(at + 8 * p_stride, P.pack_bf16x2(p[2], p[3]))
            cute.arch.sync_threads()

            for n in cutlass.range_constexpr(ntiles):
                for q in cutlass.range_constexpr(4):
                    acc_o[n][q] = acc_o[n][q] * alpha[q // 2]
            acc_o = self.values_block(
                acc_o, p_lane, kv + (mj + 8 * (mi % 2)) * STRIDE + 2 * (8 * ntiles * col + 8 * (mi // 2)), ntiles
            )
            cute.arch.sync_threads()  # the block's buffers are free for the next copies

        # the row sums over the 4 lanes of a row, then over the column warps
        for r in cutlass.range_constexpr(2):
            total = row_sum[r] + cute.arch.shuffle_sync_bfly(row_sum[r], offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            if t == 0:
                red[col * m + mt * 16 + g + 8 * r] = total
        cute.arch.sync_threads()
        item = token * self.splits + split
        for r in cutlass.range_constexpr(2):
            head = head0 + mt * 16 + g + 8 * r
            total = Float32(0)
            for c in cutlass.range_constexpr(cols):
                total = total + red[c * m + mt * 16 + g + 8 * r]
            dims = 8 * ntiles * col + 2 * t
            if cutlass.const_expr(self.splits == 1):  # the whole selection: normalize here
                if head < self.gathered:
                    inverse = self.inverse_of(total)
                    row = (token * self.gathered + head) * LATENT + dims
                    for n in cutlass.range_constexpr(ntiles):
                        P.store_f32x2(out + row + 8 * n, acc_o[n][2 * r] * inverse, acc_o[n][2 * r + 1] * inverse)
                    if col == 0 and t == 0:
                        P.store_f32(lse + token * self.gathered + head, self.lse_of(row_max[r], total))
            else:
                row = (item * self.q_heads + head) * LATENT + dims
                for n in cutlass.range_constexpr(ntiles):
                    P.store_f32x2(partial_o + row + 8 * n, acc_o[n][2 * r], acc_o[n][2 * r + 1])
                if col == 0 and t == 0:
                    P.store_f32x2(partial_ml + 2 * (item * self.q_heads + head), row_max[r], total)

    @cute.jit
    def partial_mma_ws(self, q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots):
        """16-row CTAs with a producer warpgroup: the 8 consumer warps of partial_mma_sync
        (tid < 256) beside the producer's warp 0 (produce_ring: one bulk copy per cache row
        below bulk_rows, each block's slot ids and live flag) and warps 1-3 (copy_rows:
        16-byte cp.async for the rows from bulk_rows on), behind full / empty mbarriers over
        a ring of `stages` blocks of cache rows as they are in HBM (bf16 at STRIDE, or raw
        fp8 rows). The consumers meet only at their named barrier (twice a block: the row
        maxima, then P) and never wait on a copy they issued (consume_ring); over the fp8
        cache they widen the raw rows straight into their MMA operands (no dequantization
        pass). The bf16 cache's 16 query rows pass through the ring's last stage on their
        way into registers (the producer fills that stage once the consumers release it)."""
        tid, _, _ = cute.arch.thread_idx()
        split, _, token = cute.arch.block_idx()
        warp = tid // 32
        m, block, stages = self.heads, self.block, self.stages
        stage_bytes = block * (FP8_ROW if self.mla_fp8 else STRIDE)
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint8, cute.make_layout(stages * stage_bytes), byte_alignment=128).iterator
        q_s = ring + (stages - 1) * stage_bytes
        if cutlass.const_expr(self.mla_fp8):
            q_s = smem.allocate_tensor(Uint8, cute.make_layout(m * STRIDE), byte_alignment=128).iterator
        copies = 4 if self.mla_fp8 else 1  # fp8: P x each 128-dim group's scales (a column warp's 64 dims lie in one)
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(copies * m * (2 * block + 16)), byte_alignment=128).iterator
        ids_s = smem.allocate_tensor(Int32, cute.make_layout(stages * block), byte_alignment=16)
        live_s = smem.allocate_tensor(Int32, cute.make_layout(stages), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(self.cols * m), byte_alignment=16)
        q_unscale_s, peaks = None, None  # fp8: the query rows' 2^-(their f16 exponents), P x scale's bounds beside red
        if cutlass.const_expr(self.mla_fp8):
            q_unscale_s = smem.allocate_tensor(Float32, cute.make_layout(m), byte_alignment=16)
            peaks = smem.allocate_tensor(Float32, cute.make_layout(self.cols * m), byte_alignment=16)
        bars = smem.allocate_tensor(Int64, cute.make_layout(2 * stages), byte_alignment=8).iterator.toint()
        full0, empty0 = bars, bars + 8 * stages  # full[s] at full0 + 8 s, empty[s] at empty0 + 8 s
        # full[s]: the bulk warp's 32 lanes (lane 0 with the bytes), and the cp.async warps'
        # threads once their copies land (none if every row goes by bulk copy)
        copiers = PRODUCER_THREADS - 32 if self.bulk_rows < block else 0
        if tid == 0:
            for s in cutlass.range_constexpr(stages):
                P.mbar_init(full0 + 8 * s, 32 + copiers)
                P.mbar_init(empty0 + 8 * s, self.consumers // 32)  # lane 0 of each consumer warp
            P.mbar_init_fence()
        cute.arch.sync_threads()  # the mbarriers are initialized (the CTA's only full barrier)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if warp >= self.consumers // 32:
            cute.arch.setmaxregister_decrease(MMA_PRODUCER_REGS)
            if warp == self.consumers // 32:
                self.produce_ring(
                    slots, cache, ring, ids_s, live_s, full0, empty0, tid % 32, split, token, error, pool_slots
                )
            elif cutlass.const_expr(copiers > 0):
                self.copy_rows(
                    slots,
                    cache,
                    ring,
                    full0,
                    empty0,
                    tid % 32,
                    warp - self.consumers // 32 - 1,
                    split,
                    token,
                    pool_slots,
                )
            if cutlass.const_expr(self.clustered):  # cluster_combine's two barriers (every thread of the cluster)
                for _ in cutlass.range_constexpr(2):
                    cute.arch.cluster_arrive(aligned=True)
                    cute.arch.cluster_wait()
        else:
            cute.arch.setmaxregister_increase(MMA_CONSUMER_REGS)
            self.consume_ring(
                q_rows,
                q_out,
                out,
                lse,
                partial_o,
                partial_ml,
                ring,
                q_s,
                p_s,
                ids_s,
                live_s,
                red,
                q_unscale_s,
                peaks,
                full0,
                empty0,
                tid,
                pool_slots,
            )

    @cute.jit
    def produce_ring(self, slots, cache, ring, ids_s, live_s, full0, empty0, lane, split, token, error, pool_slots):
        """The producer warpgroup's warp 0: lane l owns rows l, l + 32 of each block. Once the
        consumers have released stage b % stages it writes the block's slot ids (the
        consumers' -inf mask) and live flag, lane 0 arrives with the bytes of the rows below
        bulk_rows expected (the others plainly), and each lane issues one cp.async.bulk per
        row of its own below bulk_rows, completing on the stage's full mbarrier: nothing else
        to do, no per-thread copies in flight (the rows from bulk_rows on: copy_rows). A hole
        (or a slot outside the pool, recorded here for every row of the block) copies the
        row of a live slot of the same block (the largest): its score is -inf so P is 0, and
        a row this selection reads anyway is finite wherever the output is (a stale or
        unwritten row could hold inf or NaN, and 0 x inf is NaN in P @ V). A block with no
        live slot copies nothing (0 bytes expected) and its live flag tells the consumers to
        skip it. Slot ids load a block ahead."""
        block, stages, bulk = self.block, self.stages, self.bulk_rows
        stride = FP8_ROW if self.mla_fp8 else STRIDE
        blocks = self.slots_per_cta // block
        per_lane = (block + 31) // 32
        ids = slots + token * self.k + split * self.slots_per_cta
        # row lane + 32 i, clamped for a lane past a block narrower than 32 (has: it is not);
        # copies: the row is below bulk_rows (None: no lane's is)
        whole = [32 * (i + 1) <= block for i in range(per_lane)]
        rows = [lane + 32 * i if whole[i] else cutlass.min(lane + 32 * i, block - 1) for i in range(per_lane)]
        has = [True if whole[i] else lane + 32 * i < block for i in range(per_lane)]
        copies = [
            True if 32 * (i + 1) <= bulk else lane + 32 * i < bulk if 32 * i < bulk else None for i in range(per_lane)
        ]
        slot = [P.load_i32(ids + rows[i]) for i in range(per_lane)]
        for b in range(blocks):
            s = b % stages
            ahead = cutlass.min(b + 1, blocks - 1) * block
            upcoming = [P.load_i32(ids + ahead + rows[i]) for i in range(per_lane)]
            live = [P.in_range(slot[i], pool_slots) for i in range(per_lane)]
            fill = Int32(-1)  # the block's largest live slot, or -1
            for i in cutlass.range_constexpr(per_lane):
                if has[i]:
                    if slot[i] != -1 and not live[i]:
                        P.record_range(error, guards.SPARSE_CORE_SLOT, token, slot[i])
                    fill = cutlass.max(fill, P.select_i32(live[i], slot[i], -1))
            for offset in cutlass.range_constexpr(5):
                fill = cutlass.max(fill, cute.arch.shuffle_sync_bfly(fill, offset=1 << offset))
            self.wait_release(empty0, b, s)
            for i in cutlass.range_constexpr(per_lane):
                if has[i]:
                    ids_s[s * block + rows[i]] = slot[i]
            copied = fill != -1
            flag = P.select_i32(copied, 1, 0)
            nbytes = P.select_i32(copied, bulk * self.row_bytes, 0)
            if cutlass.const_expr(self.probe == "no_loads"):  # nothing copied, every block computed
                flag, nbytes = Int32(1), Int32(0)
            if lane == 0:
                live_s[s] = flag
                P.mbar_expect(full0 + 8 * s, nbytes)
            else:
                P.mbar_arrive(full0 + 8 * s)
            cute.arch.sync_warp()  # the bytes are expected before any lane's copies land
            if cutlass.const_expr(self.probe != "no_loads"):
                if copied:
                    for i in cutlass.range_constexpr(per_lane):
                        if cutlass.const_expr(copies[i] is not None):
                            if copies[i]:
                                src = cache + Int64(P.select_i32(live[i], slot[i], fill)) * self.row_bytes
                                dst = ring + s * (block * stride) + rows[i] * stride
                                P.bulk_copy_g2s(dst, src, self.row_bytes, full0 + 8 * s)
            slot = upcoming

    @cute.jit
    def wait_release(self, empty0, b, s):
        """A producer warp's wait for stage s before block b's copies: block b - stages's
        release, or (bf16 cache) the query rows' for the last stage's first fill."""
        release = b // self.stages - 1
        if cutlass.const_expr(not self.mla_fp8):
            release = release + P.select_i32(s == self.stages - 1, 1, 0)
        if release >= 0:
            P.mbar_wait(empty0 + 8 * s, release % 2)

    @cute.jit
    def copy_rows(self, slots, cache, ring, full0, empty0, lane, w, split, token, pool_slots):
        """The producer warpgroup's warps 1-3 (w = 0 .. 2): the rows of each block from
        bulk_rows on, warp w taking rows bulk_rows + w, + w + 3, ... (lane i holds its i-th
        row's slot id), each copied by the whole warp in 16-byte cp.async.cg (warp_copy_row:
        512 contiguous bytes an instruction); a hole, or a slot outside the pool (recorded by
        produce_ring), is zero-filled (its score is -inf, its P 0; zeros are finite). Once the
        consumers have released the stage (wait_release, as produce_ring), then one
        cp.async.mbarrier.arrive.noinc on the stage's full mbarrier per thread: an arrival when
        this thread's copies have landed, which makes them visible to the consumers' wait
        (the barrier counts these 96 arrivals beside the bulk warp's 32; its expect_tx covers
        only the bulk copies' bytes). The consumers' release of a stage (fence.proxy.async,
        then mbarrier.arrive) orders their reads before either kind of write: cp.async's
        (generic proxy) by the arrive / wait pair, the bulk copies' (async proxy) by the fence.
        Slot ids load a block ahead."""
        block, stages = self.block, self.stages
        stride = FP8_ROW if self.mla_fp8 else STRIDE
        blocks = self.slots_per_cta // block
        warps = PRODUCER_THREADS // 32 - 1
        rest = block - self.bulk_rows
        first = self.bulk_rows + w  # this warp's rows: first + warps i while < block
        ids = slots + token * self.k + split * self.slots_per_cta + cutlass.min(first + warps * lane, block - 1)
        slot = P.load_i32(ids)
        for b in range(blocks):
            s = b % stages
            upcoming = P.load_i32(ids + cutlass.min(b + 1, blocks - 1) * block)
            self.wait_release(empty0, b, s)
            if cutlass.const_expr(self.probe != "no_loads"):
                stage = ring + s * (block * stride)
                for i in cutlass.range_constexpr((rest + warps - 1) // warps):
                    row = first + warps * i
                    # (known at trace time where every warp has an i-th row)
                    has = True if warps * (i + 1) <= rest else w + warps * i < rest
                    if has:
                        self.warp_copy_row(
                            cache, cute.arch.shuffle_sync(slot, i), stage + row * stride, lane, pool_slots
                        )
            P.cp_async_mbar_arrive_noinc(full0 + 8 * s)
            slot = upcoming
        P.cp_async_commit()
        P.cp_async_wait(0)  # (no thread leaves copies in flight)

    @cute.jit
    def warp_copy_row(self, cache, slot, dst, lane, pool_slots):
        """Cache row `slot` into shared `dst` by a warp's 16-byte cp.async.cg (lane l: chunks
        l, l + 32, ...), zero-filled for a slot outside the pool (-1 included)."""
        chunks = FP8_CHUNKS if self.mla_fp8 else BF16_CHUNKS
        live = P.in_range(slot, pool_slots)
        src = cache + Int64(P.select_i32(live, slot, 0)) * self.row_bytes + 16 * lane
        dst = dst + 16 * lane
        for j in cutlass.range_constexpr((chunks + 31) // 32):
            if True if 32 * (j + 1) <= chunks else lane + 32 * j < chunks:  # (static for whole rounds)
                P.cp_async_16(dst + 512 * j, src + 512 * j, live)

    @cute.jit
    def consume_ring(
        self,
        q_rows,
        q_out,
        out,
        lse,
        partial_o,
        partial_ml,
        ring,
        q_s,
        p_s,
        ids_s,
        live_s,
        red,
        q_unscale_s,
        peaks,
        full0,
        empty0,
        tid,
        pool_slots,
    ):
        """partial_mma_ws's consumer warps: partial_mma_sync's per-block math, each block
        waited for on its full mbarrier (skipped if it has no live slot) and released on its
        empty one by every warp after its P @ V, behind a proxy fence (the next bulk copies
        into the stage are the async proxy; its cp.async writes, the generic proxy, are
        ordered after these reads by the arrive and the producer's wait alone). Over the bf16
        cache all 36 k steps of Q's A fragments stay in registers.

        Over the fp8 cache the raw rows are the MMA operands' source (score_tiles_fp8,
        values_block_fp8): e4m3 widened exactly to f16, each 128-dim group's scale applied to
        its partial score and to P (four copies of P, one per group); the k order of the
        scores and the slot and dim orders of P @ V are permuted (consistently for Q, P and
        the output) so that each thread reads whole words of a row. The latent's 32 k steps
        of Q's A fragments (f16) stay in registers, the rope's 4 (bf16) are read from shared
        memory each block. f16 holds values under 65504 only, with 11 bits only from 2^-14,
        so Q and P x scale each enter it times a power of two, undone in fp32 (exact):
        - a bf16 query row's latent x 2^(Q_F16_TOP - E), E the exponent of its largest
          element (load_queries_permuted): all under 2^16 (a bf16 under 2^16 is at most
          65280), each exact in f16 unless below 2^(E - 32), then within 2^(E - 40) -- under
          2^-40 of the row's largest element, below the fp32 rounding of its scores; the
          row's latent scores are x 2^(E - Q_F16_TOP). e4m3 rows fit f16 as they are.
        - a row's P x scale x 2^(P_F16_TOP - E), E the exponent of the row's largest P x
          scale (consume_mma_block: bounded from each slot's score and largest scale's
          exponent, reduced beside the row maxima, and from the blocks consumed, theirs x
          alpha): under 2^15, never inf; 11 bits down to 2^-27 of the row's largest P x
          scale, below that within 2^-38 of it. The accumulators follow E with the
          softmax's alpha (x 2^(old E - new E)); the output is x 2^(E - P_F16_TOP) at the
          end. (A bound from the largest scale alone, whatever its P, lost every other slot
          below a slot of a 2^35 larger scale and a score far below theirs.)
        So no query element or scale gives an inf or loses its row's result, and none needs
        the error word: each result is as exact as the bf16-operand path's to fp32 rounding
        (P is finer: 11 bits against 8), query elements past 65504 and scales past f16's
        range included; only a 128-dim group whose P x scale are all under 2^-27 of its row's
        largest (over the groups) keeps fewer bits."""
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        cols = self.cols
        mt, col = warp // cols, warp % cols
        m, block, stages = self.heads, self.block, self.stages
        consumers = self.consumers
        stage_bytes = block * (FP8_ROW if self.mla_fp8 else STRIDE)
        head0 = group * m
        rows = q_rows + (token * self.q_heads + head0) * self.q_bytes
        if cutlass.const_expr(self.mla_fp8):
            self.load_queries_permuted(rows, head0, q_s, q_unscale_s, tid, consumers)
        else:
            self.load_queries(rows, head0, q_s, tid, consumers)
            P.cp_async_commit()
            P.cp_async_wait(0)
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=consumers)

        mi, mj = lane // 8, lane % 8
        a_row, a_col = mj + 8 * (mi % 2), 8 * (mi // 2)
        q_lane = q_s + (mt * 16 + a_row) * STRIDE + 2 * a_col
        q_frags = [P.ldmatrix_x4(q_lane + 2 * 16 * ks) for ks in range(LATENT // 16 if self.mla_fp8 else K_STEPS)]
        if cutlass.const_expr(not self.mla_fp8):  # the query rows' stage is the producer's
            P.fence_proxy_async()
            cute.arch.sync_warp()
            if lane == 0:
                P.mbar_arrive(empty0 + 8 * (stages - 1))
        if cutlass.const_expr(self.publish and self.splits == 1):  # this CTA is its rows' only reader
            self.publish_rows(q_rows, q_out, token, head0, self.heads, tid, consumers)
        neg_inf = Float32(-math.inf)
        ntiles = LATENT // cols // 8
        acc_o = [[Float32(0)] * 4 for _ in range(ntiles)]
        row_max = [neg_inf, neg_inf]
        row_sum = [Float32(0), Float32(0)]
        # fp8: rows g, g + 8's 2^(E - Q_F16_TOP); their P x scale's exponents E (biased, as
        # fp32; pow2_ceil's floor at first), then their 2^(E - P_F16_TOP) (consume_mma_block)
        q_unscale = [Float32(1), Float32(1)]
        p_scale = []
        if cutlass.const_expr(self.mla_fp8):
            p_scale = [Float32(P_F16_TOP + 1)] * 2 + [Float32(2.0 ** (1 - 127))] * 2
            if cutlass.const_expr(not self.q_fp8):
                q_unscale = [q_unscale_s[mt * 16 + g + 8 * r] for r in range(2)]
        blocks = self.slots_per_cta // block
        for b in range(blocks):
            s = b % stages
            kv = ring + s * stage_bytes
            P.mbar_wait(full0 + 8 * s, (b // stages) % 2)
            if cutlass.const_expr(self.probe != "no_math"):
                if live_s[s] != 0:  # (the same word for every consumer: every warp or none)
                    row_max, row_sum, acc_o, p_scale = self.consume_mma_block(
                        q_lane,
                        q_frags,
                        q_unscale,
                        p_s,
                        kv,
                        ids_s,
                        s,
                        red,
                        peaks,
                        row_max,
                        row_sum,
                        acc_o,
                        p_scale,
                        tid,
                        pool_slots,
                    )
            P.fence_proxy_async()  # this thread's reads of stage s are done before the next bulk copy
            cute.arch.sync_warp()
            if lane == 0:
                P.mbar_arrive(empty0 + 8 * s)

        # the row sums over the 4 lanes of a row, then over the column warps (red is free:
        # every warp read the last block's maxima before the last barrier)
        for r in cutlass.range_constexpr(2):
            total = row_sum[r] + cute.arch.shuffle_sync_bfly(row_sum[r], offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            if t == 0:
                red[col * m + mt * 16 + g + 8 * r] = total
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=consumers)
        item = token * self.splits + split
        for r in cutlass.range_constexpr(2):
            head = head0 + mt * 16 + g + 8 * r
            total = Float32(0)
            for c in cutlass.range_constexpr(cols):
                total = total + red[c * m + mt * 16 + g + 8 * r]
            # this thread's dims: 2t, 2t + 1 of each 8-dim tile n; over the fp8 cache (P @ V's
            # permuted n) 16t + n and 16t + 8 + n of the warp's 64
            values = [acc_o[n][2 * r + e] for n in range(ntiles) for e in range(2)]
            if cutlass.const_expr(self.mla_fp8):
                values = [acc_o[n][2 * r + e] * p_scale[2 + r] for e in range(2) for n in range(ntiles)]
            dims = 8 * ntiles * col + (16 * t if self.mla_fp8 else 2 * t)
            step = 2 if self.mla_fp8 else 8  # between this thread's dim pairs
            if cutlass.const_expr(self.splits == 1):  # the whole selection: normalize here
                if head < self.gathered:
                    inverse = self.inverse_of(total)
                    row = (token * self.gathered + head) * LATENT + dims
                    for n in cutlass.range_constexpr(ntiles):
                        P.store_f32x2(out + row + step * n, values[2 * n] * inverse, values[2 * n + 1] * inverse)
                    if col == 0 and t == 0:
                        P.store_f32(lse + token * self.gathered + head, self.lse_of(row_max[r], total))
            elif cutlass.const_expr(self.clustered):  # into the ring (free: every consumer is past the loop)
                local = mt * 16 + g + 8 * r
                for n in cutlass.range_constexpr(ntiles):
                    P.st_shared_f32x2(ring + 4 * (local * LATENT + dims + step * n), values[2 * n], values[2 * n + 1])
                if col == 0 and t == 0:
                    P.st_shared_f32x2(ring + 4 * (m * LATENT) + 8 * local, row_max[r], total)
            else:
                row = (item * self.q_heads + head) * LATENT + dims
                for n in cutlass.range_constexpr(ntiles):
                    P.store_f32x2(partial_o + row + step * n, values[2 * n], values[2 * n + 1])
                if col == 0 and t == 0:
                    P.store_f32x2(partial_ml + 2 * (item * self.q_heads + head), row_max[r], total)
        if cutlass.const_expr(self.clustered):
            self.cluster_combine(ring, out, lse, q_rows, q_out, tid)

    @cute.jit
    def cluster_combine(self, ring, out, lse, q_rows, q_out, tid):
        """The clustered combine (self.clustered): every CTA of the token's cluster has left its
        split's unnormalized rows (fp32 [16][512], true dim order) and (max, sum) [16][2] at the
        start of its ring; after a cluster barrier this CTA (split s of S) combines dims
        [512 s / S, 512 (s + 1) / S) of all 16 rows from every CTA's copy (DSMEM loads), thread
        (row = tid / 16, part = tid % 16) 512 / S / 16 contiguous dims of its row, as
        sparse_core_combine does, and writes out (and lse: split 0); split 0 also publishes
        the query rows (every reader of them is past the barrier). A second cluster barrier
        keeps every CTA's shared memory alive until the last DSMEM load."""
        split, group, token = cute.arch.block_idx()
        m, splits, consumers = self.heads, self.splits, self.consumers
        cute.arch.cluster_arrive(aligned=True)  # (release: this CTA's staged rows)
        cute.arch.cluster_wait()  # (acquire: every CTA's)
        threads_per_row = consumers // m
        local, part = tid // threads_per_row, tid % threads_per_row
        width = LATENT // splits // threads_per_row  # this thread's dims (4 .. 16)
        first = split * (LATENT // splits) + part * width
        base = ring.toint()
        stats = [P.dsmem_load(base + 4 * (m * LATENT) + 8 * local, Int32(s), Float32, 2) for s in range(splits)]
        top = stats[0][0]
        for s in cutlass.range_constexpr(1, splits):
            top = cute.arch.fmax(top, stats[s][0])
        use = self.merge_max(top)
        weights = [P.exp2_approx(stats[s][0] - use) for s in range(splits)]  # 0: a split with no live slot
        total = Float32(0)
        for s in cutlass.range_constexpr(splits):
            total = total + weights[s] * stats[s][1]
        sums = [Float32(0)] * width
        for s in cutlass.range_constexpr(splits):
            for q in cutlass.range_constexpr(width // 4):
                v = P.dsmem_load(base + 4 * (local * LATENT + first + 4 * q), Int32(s), Float32, 4)
                for e in cutlass.range_constexpr(4):
                    sums[4 * q + e] = sums[4 * q + e] + weights[s] * v[e]
        head = group * m + local
        if head < self.gathered:
            inverse = self.inverse_of(total)
            row = (token * self.gathered + head) * LATENT + first
            for q in cutlass.range_constexpr(width // 2):
                P.store_f32x2(out + row + 2 * q, sums[2 * q] * inverse, sums[2 * q + 1] * inverse)
            if split == 0 and part == 0:
                P.store_f32(lse + token * self.gathered + head, self.lse_of(top, total))
        if cutlass.const_expr(self.publish):
            if split == 0:
                self.publish_rows(q_rows, q_out, token, group * m, m, tid, consumers)
        cute.arch.cluster_arrive(aligned=True)
        cute.arch.cluster_wait()

    @cute.jit
    def consume_mma_block(
        self,
        q_lane,
        q_frags,
        q_unscale,
        p_s,
        kv,
        ids_s,
        s,
        red,
        peaks,
        row_max,
        row_sum,
        acc_o,
        p_scale,
        tid,
        pool_slots,
    ):
        """One block of consume_ring (stage s at kv): scores, the row max over the column warps
        (named barrier), P into shared memory (named barrier), P @ V. Returns (row_max,
        row_sum, acc_o, p_scale). fp8: q_unscale = rows g, g + 8's 2^(E - Q_F16_TOP); p_scale
        = rows g, g + 8's P x scale exponents E (biased, as fp32), then their 2^(E -
        P_F16_TOP): E for this block from each warp's bound on its slots' P x scale (beside
        the row maxima in `peaks`, under the same named barrier), acc_o rescaled to match;
        bf16: both unused ([])."""
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        mi, mj = lane // 8, lane % 8
        cols = self.cols
        mt, col = warp // cols, warp % cols
        m, block, consumers = self.heads, self.block, self.consumers
        p_stride = 2 * block + 16
        p_lane = p_s + (mt * 16 + mj + 8 * (mi % 2)) * p_stride + 2 * 8 * (mi // 2)  # P @ V's A rows
        if cutlass.const_expr(self.mla_fp8):
            p_lane = p_lane + (col // 2) * m * p_stride  # this warp's dims' group's copy of P
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        ntiles = LATENT // cols // 8
        per = max(1, block // 8 // cols)
        scores = [[neg_inf] * 4 for _ in range(per)]
        pairs = [[[Float32(0)] * 4 for _ in range(2)] for _ in range(per)]  # fp8: slots 2t, 2t + 1's scales
        p_up = [Float32(1), Float32(1)]  # fp8: rows g, g + 8's P x scale's 2^(P_F16_TOP - E)
        if col * per < block // 8:
            if cutlass.const_expr(self.mla_fp8):
                scores, pairs = self.score_tiles_fp8(q_lane, q_frags, q_unscale, kv, col * per, per, g, t)
            else:
                scores = self.score_tiles(q_lane, q_frags, kv, col * per, per, mi, mj)
            for j in cutlass.range_constexpr(per):
                for q in cutlass.range_constexpr(4):
                    live = P.in_range(ids_s[s * block + (col * per + j) * 8 + 2 * t + q % 2], pool_slots)
                    scores[j][q] = P.select(live, scores[j][q] * scale, neg_inf)
        spans = []  # fp8: slots 2t, 2t + 1's largest scale's biased exponent (as abs_max_exponent)
        if cutlass.const_expr(self.mla_fp8):
            spans = [[P.abs_max_exponent(pairs[j][e]) for e in range(2)] for j in range(per)]
        for r in cutlass.range_constexpr(2):
            top = scores[0][2 * r]
            for j in cutlass.range_constexpr(per):
                top = cute.arch.fmax(top, cute.arch.fmax(scores[j][2 * r], scores[j][2 * r + 1]))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=2))
            if t == 0:
                red[col * m + mt * 16 + g + 8 * r] = top
            if cutlass.const_expr(self.mla_fp8):
                # the row's largest P x scale over the warp's slots is under 2^(peak + top -
                # use - 126) (use: the row max after the barrier); slot - top, not slot +
                # span - use, so that no span is lost beside a large score
                base = P.select(top == neg_inf, Float32(0), top)
                peak = neg_inf
                for j in cutlass.range_constexpr(per):
                    for e in cutlass.range_constexpr(2):
                        peak = cute.arch.fmax(peak, scores[j][2 * r + e] - base + spans[j][e])
                peak = cute.arch.fmax(peak, cute.arch.shuffle_sync_bfly(peak, offset=1))
                peak = cute.arch.fmax(peak, cute.arch.shuffle_sync_bfly(peak, offset=2))
                if t == 0:
                    peaks[col * m + mt * 16 + g + 8 * r] = peak
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=consumers)
        alpha = [Float32(0), Float32(0)]
        use = [Float32(0), Float32(0)]
        for r in cutlass.range_constexpr(2):
            top = row_max[r]
            maxima = []  # fp8: the column warps' maxima, read once for top and for the bound
            if cutlass.const_expr(self.mla_fp8):
                maxima = [red[c * m + mt * 16 + g + 8 * r] for c in range(cols)]
            for c in cutlass.range_constexpr(cols):
                top = cute.arch.fmax(top, maxima[c] if self.mla_fp8 else red[c * m + mt * 16 + g + 8 * r])
            use[r] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
            alpha[r] = P.exp2_approx(row_max[r] - use[r])
            if cutlass.const_expr(self.mla_fp8):
                # the row's E: the largest P x scale of this block and of the blocks consumed
                # (theirs x alpha), so that P x scale x 2^(P_F16_TOP - E) < 2^15; the
                # accumulators into the new units (alpha first: 2^(old E - new E) alone may
                # overflow where alpha is 0)
                bound = p_scale[r] + (row_max[r] - use[r])
                for c in cutlass.range_constexpr(cols):
                    bound = cute.arch.fmax(bound, peaks[c * m + mt * 16 + g + 8 * r] + (maxima[c] - use[r]))
                p_scale[r], p_up[r], p_down = P.pow2_ceil(bound, P_F16_TOP)
            row_max[r] = top
            row_sum[r] = row_sum[r] * alpha[r]
            if cutlass.const_expr(self.mla_fp8):
                alpha[r] = alpha[r] * p_up[r] * p_scale[2 + r]
                p_scale[2 + r] = p_down
        if col * per < block // 8:
            for j in cutlass.range_constexpr(per):
                p = [P.exp2_approx(scores[j][q] - use[q // 2]) for q in range(4)]
                row_sum[0] = row_sum[0] + p[0] + p[1]
                row_sum[1] = row_sum[1] + p[2] + p[3]
                at = p_s + (mt * 16 + g) * p_stride
                if cutlass.const_expr(self.mla_fp8):
                    # slots n, n + 1 (n = 8 tile + 2t) at P @ V's permuted k: within a
                    # 16-slot step, slot 4u + e is k 2u + e (e < 2) or 2u + 6 + e
                    n = (col * per + j) * 8 + 2 * t
                    u = n % 16
                    at = at + 2 * (16 * (n // 16) + 2 * (u // 4) + 8 * ((u % 4) // 2))
                    pair = pairs[j]
                    up = [p[q] * p_up[q // 2] for q in range(4)]
                    for v in cutlass.range_constexpr(4):
                        where = at + v * m * p_stride
                        P.st_shared_u32(where, P.pack_f16x2(up[0] * pair[0][v], up[1] * pair[1][v]))
                        P.st_shared_u32(where + 8 * p_stride, P.pack_f16x2(up[2] * pair[0][v], up[3] * pair[1][v]))
                else:
                    at = at + 2 * ((col * per + j) * 8 + 2 * t)
                    P.st_shared_u32(at, P.pack_bf16x2(p[0], p[1]))
                    P.st_shared_u32(at + 8 * p_stride, P.pack_bf16x2(p[2], p[3]))
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=consumers)

        for n in cutlass.range_constexpr(ntiles):
            for q in cutlass.range_constexpr(4):
                acc_o[n][q] = acc_o[n][q] * alpha[q // 2]
        if cutlass.const_expr(self.mla_fp8):
            acc_o = self.values_block_fp8(acc_o, p_lane, kv + 8 * ntiles * col + 8 * g, t)
        else:
            acc_o = self.values_block(
                acc_o, p_lane, kv + (mj + 8 * (mi % 2)) * STRIDE + 2 * (8 * ntiles * col + 8 * (mi // 2)), ntiles
            )
        return row_max, row_sum, acc_o, p_scale

    @cute.jit
    def score_tiles_fp8(self, q_lane, q_frags, q_unscale, kv, first_tile, per: int, g, t):
        """score_tiles over raw fp8 rows: per 8-slot tile, the scores (c0 c1 = row g, slots 2t,
        2t + 1; c2 c3 = row g + 8) and those slots' scales (per tile: [slot][group]). Lane
        (g, t) reads 8 bytes of slot row g per 32 dims (bytes 8t .. 8t + 7: the k steps' pairs
        2t, 2t + 8 of two k steps, Q permuted to match) and widens them exactly to f16; each
        128-dim group has its own accumulators (x its scale once at the end, then the latent
        x the row's q_unscale), the interleaved groups four independent MMA chains; the bf16
        rope likewise (16 bytes per 32 dims, bf16 MMAs, Q's rope from shared memory)."""
        acc = [[[Float32(0)] * 4 for _ in range(5)] for _ in range(per)]
        rows = [kv + ((first_tile + j) * 8 + g) * FP8_ROW for j in range(per)]
        for step in cutlass.range_constexpr(4):  # the 32-dim pieces of a 128-dim group
            for j in cutlass.range_constexpr(per):
                words = [P.ld_shared_u32x2(rows[j] + 32 * (4 * grp + step) + 8 * t) for grp in range(4)]
                for h in cutlass.range_constexpr(2):
                    for grp in cutlass.range_constexpr(4):
                        kk = 2 * (4 * grp + step) + h
                        acc[j][grp] = P.mma_f16_16816(q_frags[kk], P.e4m3x4_to_f16x2(words[grp][h]), acc[j][grp])
        for i in cutlass.range_constexpr((ROW - LATENT) // 32):
            for j in cutlass.range_constexpr(per):
                words = P.ld_shared_u32x4(rows[j] + LATENT + 16 + 64 * i + 16 * t)
                for h in cutlass.range_constexpr(2):
                    kk = LATENT // 16 + 2 * i + h
                    a = P.ldmatrix_x4(q_lane + 2 * 16 * kk)
                    acc[j][4] = P.mma_bf16_16816(a, (words[2 * h], words[2 * h + 1]), acc[j][4])
        scores, pairs = [], []
        for j in cutlass.range_constexpr(per):
            pair = [P.ld_shared_f32x4(kv + ((first_tile + j) * 8 + 2 * t + e) * FP8_ROW + LATENT) for e in range(2)]
            tile = []
            for q in cutlass.range_constexpr(4):
                value = acc[j][0][q] * pair[q % 2][0]
                for grp in cutlass.range_constexpr(1, 4):
                    value = value + acc[j][grp][q] * pair[q % 2][grp]
                tile.append(acc[j][4][q] + value * q_unscale[q // 2])
            scores.append(tile)
            pairs.append([list(pair[e]) for e in range(2)])
        return scores, pairs

    @cute.jit
    def values_block_fp8(self, acc_o, p_lane, v_lane, t) -> list:
        """values_block over raw fp8 rows: P (this warp's group's copy, f16 P x scale x 2^(P_F16_TOP
        - E)) by ldmatrix; the B fragments from 8 bytes (dims 8g .. 8g + 7 of the warp's 64, at
        v_lane) of each of rows 4t .. 4t + 3 of every 16-slot step: k pair (2t, 2t + 1) is
        rows 4t, 4t + 1, pair (2t + 8, 2t + 9) rows 4t + 2, 4t + 3 (P written to match), and
        n-tile n holds dim 8g + n (the output's dims permuted to match): byte-permuted
        into pairs and widened exactly to f16."""
        for ks in cutlass.range_constexpr(self.block // 16):
            a = P.ldmatrix_x4(p_lane + 2 * 16 * ks)
            w = [P.ld_shared_u32x2(v_lane + (16 * ks + 4 * t + r) * FP8_ROW) for r in range(4)]
            for h in cutlass.range_constexpr(2):  # dims 4h .. 4h + 3 of the thread's 8
                for half in cutlass.range_constexpr(2):  # dims 4h + 2 half, + 1
                    sel = 0x7362 if half else 0x5140
                    low = P.e4m3x4_to_f16x2(P.byte_perm(w[0][h], w[1][h], sel))
                    high = P.e4m3x4_to_f16x2(P.byte_perm(w[2][h], w[3][h], sel))
                    for e in cutlass.range_constexpr(2):
                        n = 4 * h + 2 * half + e
                        acc_o[n] = P.mma_f16_16816(a, (low[e], high[e]), acc_o[n])
        return acc_o

    @cute.jit
    def load_queries_permuted(self, rows, head0, q_s, q_unscale_s, tid, threads: int):
        """The CTA's query rows -> shared memory at STRIDE for the fp8 cache's scores
        (score_tiles_fp8): dims 32i + 8u .. 32i + 8u + 7 go to k steps 2i, 2i + 1 at columns
        (2u, 2u + 1, 2u + 8, 2u + 9) -- what ldmatrix hands lane t = u of the A fragment --
        the latent as f16, the rope as bf16 (both exact); rows at or past `gathered` are
        zeros. Warp w takes rows 2w, 2w + 1 (16 rows, 8 warps), all its loads issued first.
        bf16 rows: the latent x 2^(Q_F16_TOP - E), E the exponent of the row's largest
        latent element (over the warp's lanes), its 2^(E - Q_F16_TOP) into q_unscale_s
        (consume_ring's docstring: why it is exact)."""
        pieces = ROW // 32 * 4  # (i, u) per row
        lane, warp = tid % 32, tid // 32
        per_warp = self.heads // (threads // 32)
        items = per_warp * pieces
        loads = []
        for i in cutlass.range_constexpr((items + 31) // 32):
            index = cutlass.min(lane + 32 * i, items - 1)
            r, piece = index // pieces, index % pieces
            h = warp * per_warp + r
            live = head0 + h < self.gathered
            words = None
            if cutlass.const_expr(self.q_fp8):
                words = P.load_u32x2_if(rows + h * self.q_bytes + 8 * piece, live)
            else:
                words = P.load_u32x4_if(rows + h * self.q_bytes + 16 * piece, live)
            loads.append((words, r, piece, h))
        for i in cutlass.range_constexpr(len(loads)):  # the words -> fp32 values, once all are loading
            words, r, piece, h = loads[i]
            values = []
            if cutlass.const_expr(self.q_fp8):
                for w in cutlass.range_constexpr(2):
                    values += list(P.unpack_e4m3x4(words[w]))
            else:
                values = P.unpack_bf16x8(words)
            loads[i] = (values, r, piece, h)
        ups = [Float32(1)] * per_warp  # each row's 2^(Q_F16_TOP - E) (e4m3 rows: 1)
        if cutlass.const_expr(not self.q_fp8):
            tops = [Int32(0)] * per_warp  # the bits of each row's largest |latent element|
            for values, r, piece, _ in loads:
                top = P.select_i32(piece < LATENT // 8, P.abs_max_bits(values), 0)
                for k in cutlass.range_constexpr(per_warp):
                    tops[k] = cutlass.max(tops[k], P.select_i32(r == k, top, 0))
            for k in cutlass.range_constexpr(per_warp):
                for offset in cutlass.range_constexpr(5):
                    tops[k] = cutlass.max(tops[k], cute.arch.shuffle_sync_bfly(tops[k], offset=1 << offset))
                _, ups[k], down = P.pow2_fit(tops[k], Q_F16_TOP + 1, Q_F16_TOP)
                if lane == 0:
                    q_unscale_s[warp * per_warp + k] = down
        for values, r, piece, h in loads:  # a clamped duplicate rewrites the same bytes
            up = ups[0]
            for k in cutlass.range_constexpr(1, per_warp):
                up = P.select(r == k, ups[k], up)
            latent = piece < LATENT // 8
            at = q_s + h * STRIDE + 2 * (32 * (piece // 4) + 2 * (piece % 4))
            for kh in cutlass.range_constexpr(2):  # k step 2i + kh
                for half in cutlass.range_constexpr(2):  # columns 2u (+ 8)
                    lo, hi = values[4 * kh + 2 * half], values[4 * kh + 2 * half + 1]
                    word = Uint32(cutlass.select_(latent, P.pack_f16x2(lo * up, hi * up), P.pack_bf16x2(lo, hi)))
                    P.st_shared_u32(at + 2 * (16 * kh + 8 * half), word)

    @cute.jit
    def partial_wgmma(self, q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots):
        """64-row CTAs: two warpgroups (256 threads). Shared memory: the query rows (bf16, K-major
        canonical), two buffers of `block` cache rows as bf16 (block b in buffer b % 2: bf16
        rows by cp.async, fp8 rows loaded to registers and dequantized into it -- while P @ V
        runs -- block b + 1's copies or loads in flight while block b is computed), P (bf16,
        K-major), the two blocks' slot ids and the row maxima the warpgroups exchange (the
        whole 227 KB but 1.5 KB). Each thread copies chunks of one row per block, so it
        loads one slot id per block, a block ahead. Per block:
        - warpgroup h: S = Q x K^T over the block's slots h x block / 2 .. (wgmma m64n(block/2)k16,
          both operands in shared memory), holes -inf, scaled to log2 units;
        - the row max over both warpgroups (shared memory, one CTA barrier), P = 2^(s - max)
          as bf16 into shared memory (the whole block's P after a second barrier);
        - warpgroup h: O[:, 256 h .. 256 h + 255] += P x V (wgmma m64n256k16, V = the same
          shared rows' first 512 dims read MN-major), rescaled first when the max moved."""
        tid, _, _ = cute.arch.thread_idx()
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        wg, w4 = warp // 4, warp % 4
        g, t = lane // 4, lane % 4
        block = self.block
        half = block // 2  # the slots of a block whose scores one warpgroup computes
        smem = cutlass.memory.SmemAllocator()
        q_s = smem.allocate_tensor(Uint8, cute.make_layout(TILE_BYTES), byte_alignment=128).iterator.toint()
        kv_s = smem.allocate_tensor(Uint8, cute.make_layout(2 * TILE_BYTES), byte_alignment=128).iterator.toint()
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(block // 8 * CHUNK), byte_alignment=128).iterator.toint()
        ids_s = smem.allocate_tensor(Int32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        sums = smem.allocate_tensor(Float32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # This thread's cache row of every block (r) and its 16-byte chunks 4 cg + q4: the
        # 8 lanes of a quarter-warp take 8 rows of one chunk (128 contiguous shared bytes).
        groups = block // 8
        r = 8 * (warp % groups) + lane % 8
        cg0, q4 = warp // groups, lane // 8
        writer = (cg0 == 0) & (q4 == 0)  # the thread of chunk 0: records the row's slot id
        ids_row = slots + token * self.k + split * self.slots_per_cta + r
        head0 = group * WG_ROWS
        slot = P.load_i32(ids_row)
        self.load_query_tile(q_rows + (token * self.q_heads + head0) * self.q_bytes, head0, q_s, tid)
        blocks = self.slots_per_cta // block
        staged = self.fetch_rows(cache, slot, kv_s, r, cg0, q4, pool_slots)
        if cutlass.const_expr(self.mla_fp8):
            self.store_rows(staged, kv_s, r, cg0, q4)
        if writer:
            ids_s[r] = slot
            if slot != -1 and not P.in_range(slot, pool_slots):
                P.record_range(error, guards.SPARSE_CORE_SLOT, token, slot)
        # the next block's slot of this row, loaded a block ahead of its use (past the CTA's
        # last block it reads as -1: the "copy" is zeros into the free buffer, read by no one)
        upcoming = P.load_i32(ids_row + cutlass.min(1, blocks - 1) * block)
        P.cp_async_commit()
        P.cp_async_wait(0)
        P.fence_proxy_async()  # generic-proxy shared writes (and cp.async data) -> wgmma
        cute.arch.sync_threads()
        if cutlass.const_expr(self.publish and self.splits == 1):  # this CTA is its rows' only reader
            self.publish_rows(q_rows, q_out, token, head0, WG_ROWS, tid, WG_THREADS)

        neg_inf = Float32(-math.inf)
        acc_o = [Float32(0)] * 128
        row_max = [neg_inf, neg_inf]  # rows 16 w4 + g (+ 8), log2 units
        row_sum = [Float32(0), Float32(0)]  # this thread's share
        row0 = 16 * w4 + g
        for b in range(blocks):
            cur = kv_s + (b % 2) * TILE_BYTES
            ahead = b + 1
            # block b + 1 into the other buffer (free: every thread passed the barrier that
            # ended block b - 1, the last reader of it)
            coming = P.select_i32(ahead < blocks, upcoming, -1)
            nxt = self.fetch_rows(cache, coming, kv_s + (ahead % 2) * TILE_BYTES, r, cg0, q4, pool_slots)
            P.cp_async_commit()
            if writer:
                ids_s[(ahead % 2) * WG_ROWS + r] = coming
                if coming != -1 and not P.in_range(coming, pool_slots):
                    P.record_range(error, guards.SPARSE_CORE_SLOT, token, coming)
            # (not used before the next block: its load latency hides behind this block)
            upcoming = P.load_i32(ids_row + cutlass.min(b + 2, blocks - 1) * block)

            # scores of this warpgroup's half of the block, then P (both halves) in shared memory
            s = wgmma_scores(q_s, cur + wg * half * 16, half)
            row_max, row_sum, acc_o = self.block_softmax(
                s, ids_s, b % 2, red, p_s, row_max, row_sum, acc_o, wg, row0, t, pool_slots, False
            )

            # P @ V in flight while this thread dequantizes its share of the next block (fp8)
            acc_o = wgmma_values(acc_o, p_s, cur + wg * (LATENT // 2 // 8) * CHUNK, block // 16, False)
            if cutlass.const_expr(self.mla_fp8):
                self.store_rows(nxt, kv_s + (ahead % 2) * TILE_BYTES, r, cg0, q4)
            acc_o = wgmma_wait(acc_o)
            P.cp_async_wait(0)
            P.fence_proxy_async()
            cute.arch.sync_threads()  # block b + 1 is in shared memory; P, red and buffer b are free

        self.finish_wgmma(acc_o, row_max, row_sum, sums, out, lse, partial_o, partial_ml, tid, False)

    @cute.jit
    def finish_wgmma(self, acc_o, row_max, row_sum, sums, out, lse, partial_o, partial_ml, tid, named: bool):
        """The end of a 64-row CTA (256 computing threads): its rows' sums over both
        warpgroups, then out and lse (one split: normalized here) or the split's partials.
        named: the computing threads meet at their named barrier, not the CTA's."""
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        wg, w4 = warp // 4, warp % 4
        g, t = lane // 4, lane % 4
        head0 = group * WG_ROWS
        row0 = 16 * w4 + g
        # the row sums over the 4 lanes of a row, then over the two warpgroups
        for rr in cutlass.range_constexpr(2):
            total = row_sum[rr] + cute.arch.shuffle_sync_bfly(row_sum[rr], offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            if t == 0:
                sums[wg * WG_ROWS + row0 + 8 * rr] = total
        if cutlass.const_expr(named):
            cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=WG_THREADS)
        else:
            cute.arch.sync_threads()
        item = token * self.splits + split
        for rr in cutlass.range_constexpr(2):
            head = head0 + row0 + 8 * rr
            total = sums[row0 + 8 * rr] + sums[WG_ROWS + row0 + 8 * rr]
            dims = wg * (LATENT // 2) + 2 * t
            if cutlass.const_expr(self.splits == 1):  # the whole selection: normalize here
                if head < self.gathered:
                    inverse = self.inverse_of(total)
                    at = out + (token * self.gathered + head) * LATENT + dims
                    for j in cutlass.range_constexpr(32):
                        P.store_f32x2(at + 8 * j, acc_o[4 * j + 2 * rr] * inverse, acc_o[4 * j + 2 * rr + 1] * inverse)
                    if wg == 0 and t == 0:
                        P.store_f32(lse + token * self.gathered + head, self.lse_of(row_max[rr], total))
            else:
                at = partial_o + (item * self.q_heads + head) * LATENT + dims
                for j in cutlass.range_constexpr(32):
                    P.store_f32x2(at + 8 * j, acc_o[4 * j + 2 * rr], acc_o[4 * j + 2 * rr + 1])
                if wg == 0 and t == 0:
                    P.store_f32x2(partial_ml + 2 * (item * self.q_heads + head), row_max[rr], total)

    @cute.jit
    def partial_wgmma_ws(self, q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots):
        """64-row CTAs with a producer warpgroup (384 threads). Warpgroup 2 (the producer) owns
        the slot ids, their range guard and the cache rows: block b into bf16 buffer b % 2
        (fp8 rows: loads issued, then the buffer's empty barrier, then dequantized into it;
        bf16 rows: cp.async into it once empty, signalled a block later so two blocks are in
        flight), its slot ids beside it, then it arrives on the buffer's full mbarrier.
        Warpgroups 0 and 1 wait on full, compute the block as partial_wgmma does with named
        barriers of their 256 threads (no CTA barrier in the loop) and release the buffer on
        its empty mbarrier after their P @ V has completed. Shared memory as partial_wgmma,
        plus the four mbarriers.
        crossover: the CTA and its peer (the other head group of the same split and token,
        a cluster of 2) share the blocks' rows: each producer loads (fp8: and dequantizes) its
        half into both CTAs' buffers (bf16 rows through registers, not by cp.async), full[s]
        also waits for the peer's bytes and empty[s] for the peer's consumers
        (produce_blocks); the mbarriers' initialization is published to
        the peer by a cluster barrier (arrived on here, waited on before any remote access),
        and every thread meets the peer's at a second one before it exits."""
        tid, _, _ = cute.arch.thread_idx()
        split, group, token = cute.arch.block_idx()
        warp = tid // 32
        block = self.block
        smem = cutlass.memory.SmemAllocator()
        q_s = smem.allocate_tensor(Uint8, cute.make_layout(TILE_BYTES), byte_alignment=128).iterator.toint()
        kv_s = smem.allocate_tensor(Uint8, cute.make_layout(2 * TILE_BYTES), byte_alignment=128).iterator.toint()
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(block // 8 * CHUNK), byte_alignment=128).iterator.toint()
        ids_s = smem.allocate_tensor(Int32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        sums = smem.allocate_tensor(Float32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        bars = smem.allocate_tensor(Int64, cute.make_layout(4), byte_alignment=8).iterator.toint()
        full0, empty0 = bars, bars + 16  # full[s] at full0 + 8 s, empty[s] at empty0 + 8 s
        # crossover: empty[s] also counts the peer's consumer warps (remote arrivals)
        releases = 16 if self.crossover else 8
        if tid == 0:
            for s in cutlass.range_constexpr(2):
                P.mbar_init(full0 + 8 * s, 128)  # every producer thread, after its stores
                P.mbar_init(empty0 + 8 * s, releases)  # lane 0 of each consumer warp, after its P @ V
            P.mbar_init_fence()
        cute.arch.sync_threads()  # the mbarriers are initialized (the CTA's only full barrier)
        if cutlass.const_expr(self.crossover):
            # ... and, for the peer, by this cluster barrier (release), waited on by each thread
            # before its first remote store or arrive (the producer's / consumers' cluster_wait)
            cute.arch.cluster_arrive(aligned=True)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        consumers = (
            q_rows,
            q_out,
            out,
            lse,
            partial_o,
            partial_ml,
            q_s,
            kv_s,
            p_s,
            ids_s,
            red,
            sums,
            full0,
            empty0,
            tid,
            pool_slots,
        )
        if cutlass.const_expr(self.reshape):
            if warp < 4:
                cute.arch.setmaxregister_increase(SCORER_REGS)
                self.consume_blocks(*consumers, 0)
            elif warp < 8:
                cute.arch.setmaxregister_decrease(VALUES_REGS)
                self.consume_blocks(*consumers, 1)
            else:
                cute.arch.setmaxregister_decrease(RESHAPE_PRODUCER_REGS)
                self.produce_blocks(
                    slots, cache, kv_s, ids_s, full0, empty0, tid - WG_THREADS, split, token, error, pool_slots
                )
        elif warp >= WG_THREADS // 32:  # warpgroup 2
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce_blocks(
                slots, cache, kv_s, ids_s, full0, empty0, tid - WG_THREADS, split, token, error, pool_slots
            )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume_blocks(*consumers)

    @cute.jit
    def produce_blocks(self, slots, cache, kv_s, ids_s, full0, empty0, ptid, split, token, error, pool_slots):
        """The producer warpgroup (ptid 0 .. 127): each thread does the share of two of
        partial_wgmma's 256 threads (fetch_rows / store_rows, v = ptid and ptid + 128), so
        the row and chunk maps are the same; the next block's slot ids load a block ahead.

        crossover (this CTA rank c of a cluster of 2, its peer 1 - c): the thread loads only
        share v = c (rows 32 c .. 32 c + 31 of each block: XOVER_ROWS) into registers -- fp8
        rows then dequantized, bf16 rows as raw 16-byte chunks (fetch_rows' raw: predicated
        loads, all 18 issued before the buffer's empty wait, as the fp8 rows' are) -- and
        stores each 16-byte bf16 chunk twice, st.shared into its own buffer and st.async into
        the same place of the peer's (complete_tx on the peer's full[s]); the slot ids, their
        range guard and the error word stay whole in each CTA (both shares' ids, as without).
        Protocol (both CTAs alike):
        - full[s]: 128 local arrivals (after this CTA's stores and proxy fence; producer thread
          0's arrival also expects XOVER_BYTES) + the peer's XOVER_BYTES of st.async. The
          peer's bytes of block b may land before this CTA's expect: the tx-count goes below
          zero, and the phase cannot complete before the local arrivals anyway.
        - empty[s]: 16 arrivals, lane 0 of each consumer warp of both CTAs (the peer's by
          mapa + mbarrier.arrive.release.cluster), so stage s is rewritten (here and, by the
          pushes, in the peer) only once both CTAs' consumers finished block b - 2 there;
          waited on with acquire at cluster scope, as full[s] is (the peer's data).
        - The consumers skip the remote arrive for a CTA's last two blocks (no producer waits
          for those phases), so every remote arrive lands on a phase its owner waits for and
          every push is waited for by the peer's consumers: neither CTA can have exited when
          the other's pushes or arrivals reach it. A closing cluster barrier (every thread,
          after its last remote store or arrive) keeps both CTAs resident until both are
          done, as FlashMLA does.
        st.async (not st.shared::cluster + a remote arrive): the bytes count themselves on the
        peer's full[s] (no fence or second arrive per block, no round trip before the
        arrive), and the one mbarrier covers local and remote halves. The peer's tile and
        full barrier are mapped once (mapa) and offset per chunk, not mapped per store."""
        block = self.block
        blocks = self.slots_per_cta // block
        maps = []
        for v in cutlass.range_constexpr(2):
            r, cg0, q4 = producer_map(ptid, v, block)
            maps.append((r, cg0, q4, (cg0 == 0) & (q4 == 0)))  # the writer: chunk 0's thread
        ids_row = slots + token * self.k + split * self.slots_per_cta
        slot = [P.load_i32(ids_row + maps[v][0]) for v in range(2)]
        rank = Int32(0)  # crossover: this CTA's rank in the pair, the share of each block it loads
        half = maps[0]
        peer_kv, peer_full0 = kv_s, full0  # crossover: the peer's tile and full[0] (shared::cluster)
        if cutlass.const_expr(self.crossover):
            rank = cute.arch.block_idx_in_cluster()
            r, cg0, q4 = producer_map(ptid, rank, block)
            half = (r, cg0, q4, (cg0 == 0) & (q4 == 0))
            peer_kv = P.mapa(kv_s, 1 - rank)
            peer_full0 = P.mapa(full0, 1 - rank)
            cute.arch.cluster_wait()  # the peer's mbarriers are initialized
        for b in range(blocks):
            s = b % 2
            buf = kv_s + s * TILE_BYTES
            fetched = slot
            if cutlass.const_expr(self.probe == "no_loads"):
                fetched = [Int32(-1), Int32(-1)]
            # the next block's slots (past the CTA's last block: the last block's again, unused)
            upcoming = [P.load_i32(ids_row + cutlass.min(b + 1, blocks - 1) * block + maps[v][0]) for v in range(2)]
            if cutlass.const_expr(self.crossover):
                own = P.select_i32(rank == 0, fetched[0], fetched[1])
                staged = self.fetch_rows(cache, own, buf, half[0], half[1], half[2], pool_slots, True)
                if b >= 2:  # block b - 2's consumers (both CTAs') are done with the buffers
                    P.mbar_wait(empty0 + 8 * s, (b // 2 + 1) % 2, cluster=True)
                self.store_rows(staged, buf, half[0], half[1], half[2], (peer_kv + s * TILE_BYTES, peer_full0 + 8 * s))
                self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                P.fence_proxy_async()  # generic-proxy shared writes -> the consumers' wgmma
                if ptid == 0:  # the peer's bytes of this block, expected with this arrival
                    P.mbar_expect(full0 + 8 * s, Int32(XOVER_BYTES))
                else:
                    P.mbar_arrive(full0 + 8 * s)
            elif cutlass.const_expr(self.mla_fp8):
                staged = [
                    self.fetch_rows(cache, fetched[v], buf, maps[v][0], maps[v][1], maps[v][2], pool_slots)
                    for v in range(2)
                ]
                if b >= 2:  # block b - 2's consumers are done with the buffer
                    P.mbar_wait(empty0 + 8 * s, (b // 2 + 1) % 2)
                for v in cutlass.range_constexpr(2):
                    self.store_rows(staged[v], buf, maps[v][0], maps[v][1], maps[v][2])
                self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                P.fence_proxy_async()  # generic-proxy shared writes -> the consumers' wgmma
                P.mbar_arrive(full0 + 8 * s)
            else:
                if b >= 2:
                    P.mbar_wait(empty0 + 8 * s, (b // 2 + 1) % 2)
                for v in cutlass.range_constexpr(2):
                    self.fetch_rows(cache, fetched[v], buf, maps[v][0], maps[v][1], maps[v][2], pool_slots)
                P.cp_async_commit()
                self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                if b >= 1:  # block b - 1's copies (this thread's) have landed: its buffer is full
                    P.cp_async_wait(1)
                    P.fence_proxy_async()
                    P.mbar_arrive(full0 + 8 * (1 - s))
            slot = upcoming
        if cutlass.const_expr(not (self.mla_fp8 or self.crossover)):  # the cp.async branch's last block
            P.cp_async_wait(0)
            P.fence_proxy_async()
            P.mbar_arrive(full0 + 8 * ((blocks - 1) % 2))
        if cutlass.const_expr(self.crossover):  # the closing cluster barrier (see above)
            cute.arch.cluster_arrive(aligned=True)
            cute.arch.cluster_wait()

    @cute.jit
    def record_ids(self, ids_s, s, slot, maps, token, error, pool_slots):
        """The block's slot ids beside buffer s (the consumers' -inf mask), each by its row's
        chunk-0 thread, which also records a slot outside the pool in the error word."""
        for v in cutlass.range_constexpr(2):
            r, _, _, writer = maps[v]
            if writer:
                ids_s[s * WG_ROWS + r] = slot[v]
                if slot[v] != -1 and not P.in_range(slot[v], pool_slots):
                    P.record_range(error, guards.SPARSE_CORE_SLOT, token, slot[v])

    @cute.jit
    def consume_blocks(
        self,
        q_rows,
        q_out,
        out,
        lse,
        partial_o,
        partial_ml,
        q_s,
        kv_s,
        p_s,
        ids_s,
        red,
        sums,
        full0,
        empty0,
        tid,
        pool_slots,
        role: int | None = None,
    ):
        """The consumer warpgroups (tid 0 .. 255) between each buffer's full and empty
        mbarriers, in one of two shapes (RESHAPE_BLOCKS):

        role None: partial_wgmma's math per block (consume_block), each warpgroup scoring half
        the block, the row max and P exchanged over two named barriers of the 256 threads.
        The next block needs no third barrier: a warpgroup writes its next row maxima (`red`)
        after this block's second barrier, which the other reaches only once it has read this
        block's; and its next P after the next block's first barrier, which the other reaches
        only once its P @ V over this block has completed.

        role 0 / 1: FlashMLA's shape, this thread's warpgroup: 0 scores each block whole and
        does P @ V on dims 0 .. 255 (score_block), 1 does P @ V on dims 256 .. 511
        (values_block_half); P and the rows' rescale factors (`red`, 64 words) handed over by
        named barriers: P_READY (0 arrives once they are in shared memory, 1 waits) and P_FREE
        (1 arrives once its P @ V over them has completed, 0 waits before it writes the next
        block's). Only warpgroup 0 keeps row maxima and sums; 1's sums are zeros in
        finish_wgmma.

        crossover: full[s] is waited on with acquire at cluster scope (half the block is the
        peer's st.async), and lane 0 of each warp also releases the buffer to the peer's
        producer (its empty[s], mapa + arrive.release.cluster) but for the CTA's last two
        blocks (produce_blocks has the protocol); the thread passes the cluster barrier the
        kernel arrived on after initializing its mbarriers before its first remote arrive, and
        meets the peer at the closing one around finish_wgmma."""
        _, group, token = cute.arch.block_idx()
        lane = tid % 32
        blocks = self.slots_per_cta // self.block
        head0 = group * WG_ROWS
        self.load_query_tile(q_rows + (token * self.q_heads + head0) * self.q_bytes, head0, q_s, tid)
        P.cp_async_commit()
        P.cp_async_wait(0)
        P.fence_proxy_async()  # generic-proxy shared writes (and cp.async data) -> wgmma
        cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=WG_THREADS)
        peer = Int32(0)  # crossover: the other CTA of the pair
        if cutlass.const_expr(self.crossover):
            peer = 1 - cute.arch.block_idx_in_cluster()
            cute.arch.cluster_wait()  # the peer's mbarriers are initialized
        if cutlass.const_expr(self.publish and self.splits == 1):  # this CTA is its rows' only reader
            self.publish_rows(q_rows, q_out, token, head0, WG_ROWS, tid, WG_THREADS)

        neg_inf = Float32(-math.inf)
        acc_o = [Float32(0)] * 128
        row_max = [neg_inf, neg_inf]  # rows 16 w4 + g (+ 8), log2 units (role 1: unused)
        row_sum = [Float32(0), Float32(0)]  # this thread's share (role 1: unused)
        for b in range(blocks):
            s = b % 2
            cur = kv_s + s * TILE_BYTES
            P.mbar_wait(full0 + 8 * s, (b // 2) % 2, cluster=self.crossover)
            if cutlass.const_expr(self.crossover):
                P.fence_proxy_async()  # the peer's st.async rows (generic proxy) -> this thread's wgmma
            if cutlass.const_expr(self.probe != "no_math"):
                if cutlass.const_expr(role is None):
                    row_max, row_sum, acc_o = self.consume_block(
                        q_s, cur, p_s, ids_s, s, red, row_max, row_sum, acc_o, tid, pool_slots
                    )
                elif cutlass.const_expr(role == 0):
                    row_max, row_sum, acc_o = self.score_block(
                        q_s, cur, p_s, ids_s, s, red, row_max, row_sum, acc_o, tid, pool_slots, b > 0
                    )
                else:
                    acc_o = self.values_block_half(cur, p_s, red, acc_o, tid, b < blocks - 1)
            if lane == 0:  # this warp's reads of buffer s (its wgmmas, the slot ids) are done
                P.mbar_arrive(empty0 + 8 * s)
                if cutlass.const_expr(self.crossover):
                    if b < blocks - 2:  # the peer's producer waits for it (before block b + 2)
                        P.mbar_arrive_remote(empty0 + 8 * s, peer)

        if cutlass.const_expr(self.crossover):  # this thread's last remote access is done
            cute.arch.cluster_arrive(aligned=True)
        self.finish_wgmma(acc_o, row_max, row_sum, sums, out, lse, partial_o, partial_ml, tid, True)
        if cutlass.const_expr(self.crossover):
            cute.arch.cluster_wait()

    @cute.jit
    def score_block(self, q_s, cur, p_s, ids_s, s, factors, row_max, row_sum, acc_o, tid, pool_slots, wait_free):
        """Warpgroup 0 of consume_blocks' FlashMLA shape, one block (buffer s at cur): S = Q x K^T over all
        its slots (m64n(block)k16), holes -inf, the online softmax in registers, P as bf16
        words -- the A fragments of P @ V -- and the rows' factors 2^(old max - new max) into
        shared memory for warpgroup 1 (after P_FREE when wait_free: it has read the last
        block's), then O[:, 0 .. 255] += P x V with P from registers (completed on return)."""
        lane, w4 = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        block = self.block
        row0 = 16 * w4 + g
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        sc = wgmma_scores(q_s, cur, block)
        for j in cutlass.range_constexpr(block // 8):
            for e in cutlass.range_constexpr(2):
                live = P.in_range(ids_s[s * WG_ROWS + 8 * j + 2 * t + e], pool_slots)
                for rr in cutlass.range_constexpr(2):
                    sc[4 * j + 2 * rr + e] = P.select(live, sc[4 * j + 2 * rr + e] * scale, neg_inf)
        alpha = [Float32(0), Float32(0)]
        use = [Float32(0), Float32(0)]
        for rr in cutlass.range_constexpr(2):
            top = row_max[rr]
            for j in cutlass.range_constexpr(block // 8):
                top = cute.arch.fmax(top, cute.arch.fmax(sc[4 * j + 2 * rr], sc[4 * j + 2 * rr + 1]))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=2))
            use[rr] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
            alpha[rr] = P.exp2_approx(row_max[rr] - use[rr])
            row_max[rr] = top
            row_sum[rr] = row_sum[rr] * alpha[rr]
        words = []  # word i = 2 j + rr: row row0 + 8 rr, slots 8 j + 2 t, + 1
        for i in cutlass.range_constexpr(block // 4):
            p0 = P.exp2_approx(sc[2 * i] - use[i % 2])
            p1 = P.exp2_approx(sc[2 * i + 1] - use[i % 2])
            row_sum[i % 2] = row_sum[i % 2] + p0 + p1
            words.append(P.pack_bf16x2(p0, p1))
        for i in cutlass.range_constexpr(128):
            acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
        if wait_free:
            cute.arch.barrier(barrier_id=P_FREE, number_of_threads=WG_THREADS)
        for i in cutlass.range_constexpr(block // 4):
            P.st_shared_u32(p_s + i // 2 * CHUNK + (row0 + 8 * (i % 2)) * 16 + 4 * t, words[i])
        if t == 0:
            for rr in cutlass.range_constexpr(2):
                factors[row0 + 8 * rr] = alpha[rr]
        P.fence_proxy_async()  # P -> warpgroup 1's wgmma
        cute.arch.barrier_arrive(barrier_id=P_READY, number_of_threads=WG_THREADS)
        acc_o = P.wgmma_bf16_rs(acc_o, words, cur, DESC_V, 16 * 16, True)
        return row_max, row_sum, acc_o

    @cute.jit
    def values_block_half(self, cur, p_s, factors, acc_o, tid, arrive_free):
        """Warpgroup 1 of consume_blocks' FlashMLA shape, one block: once P_READY, O[:, 256 .. 511] rescaled
        by the rows' factors, += P x V (P from shared memory; completed on return), then
        P_FREE (arrive_free: not after the CTA's last block, which nothing waits for)."""
        lane, w4 = tid % 32, tid // 32 - 4
        row0 = 16 * w4 + lane // 4
        cute.arch.barrier(barrier_id=P_READY, number_of_threads=WG_THREADS)
        alpha = [factors[row0], factors[row0 + 8]]
        for i in cutlass.range_constexpr(128):
            acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
        acc_o = wgmma_values(acc_o, p_s, cur + (LATENT // 2 // 8) * CHUNK, self.block // 16)
        if arrive_free:
            cute.arch.barrier_arrive(barrier_id=P_FREE, number_of_threads=WG_THREADS)
        return acc_o

    @cute.jit
    def consume_block(self, q_s, cur, p_s, ids_s, s, red, row_max, row_sum, acc_o, tid, pool_slots):
        """One block of consume_blocks (buffer s at cur): scores of this warpgroup's half,
        the row max over both (named barrier), P into shared memory (named barrier), P @ V
        (completed on return)."""
        lane, warp = tid % 32, tid // 32
        wg, w4 = warp // 4, warp % 4
        g, t = lane // 4, lane % 4
        block = self.block
        half = block // 2
        row0 = 16 * w4 + g
        sc = wgmma_scores(q_s, cur + wg * half * 16, half)
        row_max, row_sum, acc_o = self.block_softmax(
            sc, ids_s, s, red, p_s, row_max, row_sum, acc_o, wg, row0, t, pool_slots, True
        )
        acc_o = wgmma_values(acc_o, p_s, cur + wg * (LATENT // 2 // 8) * CHUNK, block // 16)
        return row_max, row_sum, acc_o

    @cute.jit
    def block_softmax(self, sc, ids_s, s, red, p_s, row_max, row_sum, acc_o, wg, row0, t, pool_slots, named: bool):
        """The online softmax of one block in the 64-row paths, from this warpgroup's half of
        the scores (sc, wgmma_scores) to P in shared memory: slots outside the pool scored
        -inf (the block's ids beside buffer s), each row's max over both halves exchanged
        through `red`, the running max and sum and the output accumulators rescaled, P
        stored as bf16 for P @ V. The two exchanges meet at the consumers' named barrier
        (named: partial_wgmma_ws) or the CTA's (partial_wgmma). wg: this thread's
        warpgroup, row0: its first row (16 w4 + g), t: its lane in the quad. Returns
        (row_max, row_sum, acc_o)."""
        half = self.block // 2
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        for j in cutlass.range_constexpr(half // 8):
            for e in cutlass.range_constexpr(2):
                live = P.in_range(ids_s[s * WG_ROWS + wg * half + 8 * j + 2 * t + e], pool_slots)
                for rr in cutlass.range_constexpr(2):
                    sc[4 * j + 2 * rr + e] = P.select(live, sc[4 * j + 2 * rr + e] * scale, neg_inf)
        for rr in cutlass.range_constexpr(2):
            top = sc[2 * rr]
            for j in cutlass.range_constexpr(half // 8):
                top = cute.arch.fmax(top, cute.arch.fmax(sc[4 * j + 2 * rr], sc[4 * j + 2 * rr + 1]))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=2))
            if t == 0:
                red[wg * WG_ROWS + row0 + 8 * rr] = top
        self.consumers_meet(named)  # both halves' maxima
        alpha = [Float32(0), Float32(0)]
        use = [Float32(0), Float32(0)]
        for rr in cutlass.range_constexpr(2):
            top = cute.arch.fmax(row_max[rr], cute.arch.fmax(red[row0 + 8 * rr], red[WG_ROWS + row0 + 8 * rr]))
            use[rr] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
            alpha[rr] = P.exp2_approx(row_max[rr] - use[rr])
            row_max[rr] = top
            row_sum[rr] = row_sum[rr] * alpha[rr]
        for j in cutlass.range_constexpr(half // 8):
            p = [P.exp2_approx(sc[4 * j + q] - use[q // 2]) for q in range(4)]
            row_sum[0] = row_sum[0] + p[0] + p[1]
            row_sum[1] = row_sum[1] + p[2] + p[3]
            at = p_s + (wg * half // 8 + j) * CHUNK + row0 * 16 + 4 * t
            P.st_shared_u32(at, P.pack_bf16x2(p[0], p[1]))
            P.st_shared_u32(at + 8 * 16, P.pack_bf16x2(p[2], p[3]))
        for i in cutlass.range_constexpr(128):
            acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
        P.fence_proxy_async()
        self.consumers_meet(named)  # the block's P (both halves) is in shared memory
        return row_max, row_sum, acc_o

    @cute.jit
    def consumers_meet(self, named: bool):
        if cutlass.const_expr(named):
            cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=WG_THREADS)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def fetch_rows(self, cache, slot, dst, r, cg0, q4, pool_slots, raw: bool = False) -> list:
        """This thread's chunks of cache row `slot` (block row r): bf16 rows by cp.async
        straight into dst (the caller commits; returns []), or raw (the crossover, whose
        producer stores each chunk into two tiles) by predicated 16-byte loads into registers
        as they are; fp8 rows by predicated loads into registers. Registers are returned for
        store_rows. Chunk j: 4 (cg0 + step j) + q4 of the row's 72 (8 dims each); a hole or a
        slot outside the pool reads nothing (zeros)."""
        step = 8 // (self.block // 8)
        live = P.in_range(slot, pool_slots)
        row = Int64(P.select_i32(live, slot, 0)) * self.row_bytes
        staged = []
        if cutlass.const_expr(not self.mla_fp8 and not raw):
            src = cache + row + 16 * q4
            at = dst + r * 16 + q4 * CHUNK
            for j in cutlass.range_constexpr((TILE_CHUNKS // 4 + step - 1) // step):
                c4 = cg0 + step * j  # chunk 4 c4 + q4
                if cutlass.const_expr(step * (j + 1) <= TILE_CHUNKS // 4):
                    P.cp_async_16(at + 4 * CHUNK * c4, src + 64 * c4, live)
                elif c4 < TILE_CHUNKS // 4:
                    P.cp_async_16(at + 4 * CHUNK * c4, src + 64 * c4, live)
        else:
            src = cache + row
            if cutlass.const_expr(self.mla_fp8):
                staged.append(P.load_f32x4_if(src + LATENT, live))  # the row's 4 fp32 scales
            for j in cutlass.range_constexpr((TILE_CHUNKS // 4 + step - 1) // step):
                staged.append(self.fetch_piece(src, live, cg0, q4, j))
        return staged

    @cute.jit
    def fetch_piece(self, src, live, cg0, q4, j: int):
        """Piece j of fetch_rows' row at src in registers: chunk 4 (cg0 + step j) + q4 of its
        72 -- fp8 rows: 8 e4m3 of the latent (8 bytes at 8 c), or 8 bf16 of the rope (16 bytes
        at 528 + 16 (c - 64)); bf16 rows: the 16 bytes at 16 c -- zeros where not live (or
        past the row's chunks)."""
        step = 8 // (self.block // 8)
        c4 = cg0 + step * j
        words = None
        if cutlass.const_expr(not self.mla_fp8):
            inside = live if step * (j + 1) <= TILE_CHUNKS // 4 else live & (c4 < TILE_CHUNKS // 4)
            words = P.load_u32x4_if(src + 16 * (4 * c4 + q4), inside)
        elif cutlass.const_expr(step * (j + 1) <= LATENT // 32):
            words = P.load_u32x2_if(src + 8 * (4 * c4 + q4), live)
        else:
            words = P.load_u32x4_if(src + LATENT + 16 + 16 * (4 * (c4 - 16) + q4), live & (c4 < TILE_CHUNKS // 4))
        return words

    @cute.jit
    def store_piece(self, words, scales, at, cg0, j: int, remote=None):
        """fetch_piece's words -> its bf16 chunk of block row `at` (dst + 16 r + q4 x CHUNK):
        e4m3 x the chunk's 128-dim scale, rounded to bf16; bf16 (the rope, or a raw bf16 row)
        copied. remote (the crossover): (the same row's address in the peer's tile, the peer's
        full mbarrier), both shared::cluster; the chunk is also pushed there (st.async)."""
        step = 8 // (self.block // 8)
        c4 = cg0 + step * j
        if cutlass.const_expr(self.mla_fp8 and step * (j + 1) <= LATENT // 32):
            # chunk 4 c4 + q4 < 64: its scale is scales[c4 // 4], and c4 // 4 = step j // 4
            # for every cg0 < step (step divides 4)
            sc = scales[step * j // 4]
            outw = []
            for i in cutlass.range_constexpr(2):
                f = P.unpack_e4m3x4(words[i])
                outw.append(P.pack_bf16x2(f[0] * sc, f[1] * sc))
                outw.append(P.pack_bf16x2(f[2] * sc, f[3] * sc))
            self.put_chunk(outw, at, 4 * CHUNK * c4, remote)
        elif cutlass.const_expr(not self.mla_fp8 and step * (j + 1) <= TILE_CHUNKS // 4):
            self.put_chunk(words, at, 4 * CHUNK * c4, remote)  # (every thread's chunk is in the row)
        elif cutlass.const_expr(step * j < TILE_CHUNKS // 4):
            if c4 < TILE_CHUNKS // 4:
                self.put_chunk(words, at, 4 * CHUNK * c4, remote)

    @cute.jit
    def put_chunk(self, words, at, offset, remote):
        """A bf16 chunk (4 words) to shared at + offset, and (remote: the crossover's peer tile
        and full mbarrier) by st.async to remote[0] + offset, counted on remote[1]."""
        P.st_shared_u32x4(at + offset, words)
        if cutlass.const_expr(remote is not None):
            P.st_async_u32x4(remote[0] + offset, words, remote[1])

    @cute.jit
    def store_rows(self, staged, dst, r, cg0, q4, remote=None):
        """fetch_rows' registers -> bf16 chunks of block row r in dst: fp8 rows' e4m3 x the
        chunk's 128-dim scale, rounded to bf16, their rope and raw bf16 rows copied. remote
        (the crossover): (the peer's dst, the peer's full mbarrier), shared::cluster: every
        chunk also pushed there."""
        at = dst + r * 16 + q4 * CHUNK
        there = None
        if cutlass.const_expr(remote is not None):
            there = (remote[0] + r * 16 + q4 * CHUNK, remote[1])
        pieces, scales = (staged[1:], staged[0]) if self.mla_fp8 else (staged, None)
        for j in cutlass.range_constexpr(len(pieces)):
            self.store_piece(pieces[j], scales, at, cg0, j, there)

    @cute.jit
    def load_query_tile(self, rows, head0, q_s, tid):
        """The CTA's 64 query rows -> shared bf16 in the canonical K-major layout (chunk c of
        row h at c x CHUNK + 16 h): bf16 rows by cp.async (the caller commits and waits),
        e4m3 rows by loads all issued first and widened exactly; rows at or past
        `gathered` are zeros."""
        if cutlass.const_expr(self.q_fp8):
            items = WG_ROWS * (ROW // 16)  # 16 e4m3 (two chunks) each
            loads = []
            for i in cutlass.range_constexpr(items // WG_THREADS):
                index = tid + i * WG_THREADS
                h, c2 = index % WG_ROWS, index // WG_ROWS
                loads.append((P.load_u32x4_if(rows + h * self.q_bytes + 16 * c2, head0 + h < self.gathered), h, c2))
            for words, h, c2 in loads:
                outw = []
                for j in cutlass.range_constexpr(4):
                    f = P.unpack_e4m3x4(words[j])
                    outw.append(P.pack_bf16x2(f[0], f[1]))
                    outw.append(P.pack_bf16x2(f[2], f[3]))
                P.st_shared_u32x4(q_s + 2 * c2 * CHUNK + 16 * h, outw[:4])
                P.st_shared_u32x4(q_s + (2 * c2 + 1) * CHUNK + 16 * h, outw[4:])
        else:
            for i in cutlass.range_constexpr(WG_ROWS * TILE_CHUNKS // WG_THREADS):
                index = tid + i * WG_THREADS
                h, c = index % WG_ROWS, index // WG_ROWS
                P.cp_async_16(q_s + c * CHUNK + 16 * h, rows + h * self.q_bytes + 16 * c, head0 + h < self.gathered)

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
    def publish_quarter(self, q_rows, q_out, token, head, quarter, tid):
        """Quarter `quarter` of query row (token, head): copied to q_out and re-armed."""
        chunks = self.q_bytes // 16 // 4  # 18 (bf16 rows) or 9 (e4m3)
        if tid < chunks:
            offset = quarter * chunks * 16 + 16 * tid
            src = q_rows + (token * self.q_heads + head) * self.q_bytes + offset
            words = P.load_u32x4(src)
            P.store_u32x4(q_out + (token * self.gathered + head) * self.q_bytes + offset, words)
            P.store_u32x4(src, [Uint32(SENTINEL_WORD)] * 4)

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

    @cute.jit
    def values_block(self, acc_o, p_lane, v_lane, ntiles: int) -> list:
        """P @ V for a block: this warp's 16 rows x its 8 x ntiles latent dims; P (A) by
        ldmatrix, the block's rows (B) by ldmatrix.trans (16 slots x 16 dims per load)."""
        for ks in cutlass.range_constexpr(self.block // 16):
            a = P.ldmatrix_x4(p_lane + 2 * 16 * ks)
            for n2 in cutlass.range_constexpr(ntiles // 2):
                v = P.ldmatrix_x4_trans(v_lane + 16 * ks * STRIDE + 2 * 16 * n2)
                acc_o[2 * n2] = P.mma_bf16_16816(a, (v[0], v[1]), acc_o[2 * n2])
                acc_o[2 * n2 + 1] = P.mma_bf16_16816(a, (v[2], v[3]), acc_o[2 * n2 + 1])
        return acc_o

    @cute.jit
    def score_tiles(self, q_lane, q_frags, kv, first_tile, per: int, mi, mj) -> list:
        """Scores of the M tile's 16 rows x slot tiles first_tile .. + per - 1 (unscaled):
        per tile, c0 c1 = row g, slots 2t, 2t + 1; c2 c3 = row g + 8. Two accumulators per
        tile (even and odd k steps) keep two MMA chains in flight."""
        acc = [[[Float32(0)] * 4 for _ in range(2)] for _ in range(per)]
        k_lane = kv + (first_tile * 8 + mj) * STRIDE + 2 * 8 * mi  # B tiles: 8 slots x 4 x 8 dims
        for kk in cutlass.range_constexpr(K_STEPS // 2):
            a0, a1 = None, None
            if cutlass.const_expr(self.q_in_registers):
                a0, a1 = q_frags[2 * kk], q_frags[2 * kk + 1]
            else:
                a0 = P.ldmatrix_x4(q_lane + 2 * 32 * kk)
                a1 = P.ldmatrix_x4(q_lane + 2 * (32 * kk + 16))
            for j in cutlass.range_constexpr(per):
                b = P.ldmatrix_x4(k_lane + j * 8 * STRIDE + 2 * 32 * kk)
                acc[j][0] = P.mma_bf16_16816(a0, (b[0], b[1]), acc[j][0])
                acc[j][1] = P.mma_bf16_16816(a1, (b[2], b[3]), acc[j][1])
        return [[acc[j][0][q] + acc[j][1][q] for q in range(4)] for j in range(per)]

    @cute.jit
    def issue_block(self, cache, ids_t, dst, first, tid, pool_slots, error, token):
        """cp.async the cache rows of slots ids[first .. first + block) into dst (bf16 rows
        at STRIDE, or raw fp8 rows at FP8_ROW); -1 slots, and slots outside the pool
        (recorded), are zero-filled. threads / block threads share a row, each taking every
        (threads / block)-th 16-byte chunk, so a thread reads one slot id per block and its
        chunk offsets are constants."""
        stride = STRIDE if not self.mla_fp8 else FP8_ROW
        per_row = self.threads // self.block
        r, c0 = tid // per_row, tid % per_row
        self.copy_row(cache, ids_t[first + r], dst + r * stride, c0, per_row, pool_slots, error, token)

    @cute.jit
    def copy_row(self, cache, slot, row, c0, per_row: int, pool_slots, error, token):
        """cp.async this thread's 16-byte chunks c0, c0 + per_row, ... of cache row `slot` to
        shared `row`; a -1 slot, or one outside the pool (recorded by chunk 0's thread), is
        zero-filled."""
        chunks = BF16_CHUNKS if not self.mla_fp8 else FP8_CHUNKS
        live = P.in_range(slot, pool_slots)
        if c0 == 0 and slot != -1 and not live:
            P.record_range(error, guards.SPARSE_CORE_SLOT, token, slot)
        src = cache + Int64(P.select_i32(live, slot, 0)) * self.row_bytes + 16 * c0
        row = row + 16 * c0
        for j in cutlass.range_constexpr((chunks + per_row - 1) // per_row):
            if cutlass.const_expr(per_row * (j + 1) <= chunks):
                P.cp_async_16(row + 16 * per_row * j, src + 16 * per_row * j, live)
            elif c0 + per_row * j < chunks:
                P.cp_async_16(row + 16 * per_row * j, src + 16 * per_row * j, live)

    @cute.jit
    def dequantize_block(self, raw, kv, tid):
        """Raw fp8 rows -> bf16 rows, 72 items of 8 dims per row: e4m3 latent x its
        128-dim scale, or the bf16 rope copied; threads share rows as in issue_block."""
        per_row = self.threads // self.block
        r, c0 = tid // per_row, tid % per_row
        src = raw + r * FP8_ROW
        dst = kv + r * STRIDE
        for j in cutlass.range_constexpr((BF16_CHUNKS + per_row - 1) // per_row):
            c = c0 + per_row * j  # per_row divides 64: a j is all latent or all rope
            if cutlass.const_expr(per_row * (j + 1) <= LATENT // 8):
                words = P.ld_shared_u32x2(src + 8 * c)
                scale = P.ld_shared_f32(src + LATENT + 4 * (c // 16))
                out = []
                for i in cutlass.range_constexpr(2):
                    f = P.unpack_e4m3x4(words[i])
                    out.append(P.pack_bf16x2(f[0] * scale, f[1] * scale))
                    out.append(P.pack_bf16x2(f[2] * scale, f[3] * scale))
                P.st_shared_u32x4(dst + 16 * c, out)
            elif c < BF16_CHUNKS:  # the bf16 rope after the 512 e4m3 and 4 scales
                P.st_shared_u32x4(dst + 16 * c, P.ld_shared_u32x4(src + LATENT + 16 + 16 * (c - LATENT // 8)))

    @cute.jit
    def load_queries(self, rows, head0, q_s, tid, threads: int):
        """The CTA's query rows -> shared memory as bf16 rows at STRIDE: bf16 rows by
        cp.async (the caller commits and waits), e4m3 rows by loads all issued first and
        widened exactly; rows at or past `gathered` are zeros."""
        if cutlass.const_expr(self.q_fp8):
            chunks = self.heads * (ROW // 16)
            loads = []
            for i in cutlass.range_constexpr((chunks + threads - 1) // threads):
                index = cutlass.min(tid + i * threads, chunks - 1)
                h, c = index // (ROW // 16), index % (ROW // 16)
                loads.append((P.load_u32x4_if(rows + h * self.q_bytes + 16 * c, head0 + h < self.gathered), h, c))
            for words, h, c in loads:  # a clamped duplicate rewrites the same bytes
                out = []
                for j in cutlass.range_constexpr(4):
                    f = P.unpack_e4m3x4(words[j])
                    out.append(P.pack_bf16x2(f[0], f[1]))
                    out.append(P.pack_bf16x2(f[2], f[3]))
                P.st_shared_u32x4(q_s + h * STRIDE + 32 * c, out[:4])
                P.st_shared_u32x4(q_s + h * STRIDE + 32 * c + 16, out[4:])
        else:
            chunks = self.heads * BF16_CHUNKS
            for i in cutlass.range_constexpr((chunks + threads - 1) // threads):
                index = tid + i * threads
                if index < chunks:
                    h, c = index // BF16_CHUNKS, index % BF16_CHUNKS
                    P.cp_async_16(
                        q_s + h * STRIDE + 16 * c, rows + h * self.q_bytes + 16 * c, head0 + h < self.gathered
                    )

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
        quarter, head, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        smem = cutlass.memory.SmemAllocator()
        weights = smem.allocate_tensor(Float32, cute.make_layout(self.splits), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(4 * 128), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        if cutlass.const_expr(self.publish):  # every partial CTA (the rows' readers) has finished
            self.publish_quarter(q_rows, q_out, token, head, quarter, tid)
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
            inverse = self.inverse_of(total)
            o = []
            for d in cutlass.range_constexpr(4):
                v = red[4 * lane + d] + red[128 + 4 * lane + d] + red[256 + 4 * lane + d] + red[384 + 4 * lane + d]
                o.append(v * inverse)
            dst = out + (token * self.gathered + head) * LATENT + dims
            P.store_f32x2(dst, o[0], o[1])
            P.store_f32x2(dst + 2, o[2], o[3])
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
