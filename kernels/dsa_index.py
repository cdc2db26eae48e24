"""DsaIndex: score every cached token of each sequence on the tensor cores (wgmma).

    score[b, i] = k_scale[i] * sum_h w[b, h] * relu(q[b, h] . k[i])     (i < local length)
    score[b, i] = -inf                                                   (past it)

Grid: (page runs, tokens); 160 threads. A CTA owns one token and a run of `pages_per_cta`
consecutive block-table pages (chosen on the host by `pages_per_cta(batch, pages)` so that
B = 1 still fills the GPU and large batches are one or two waves). Warp 4 is the producer:
one `cp.async.bulk` per live page (8448 B: 64 keys x 128 e4m3 | 64 fp32 scales) into a ring
of shared-memory stages (STAGES = 4, or DEEP_STAGES = 8 where `ring_for` picks it: a whole
8-page run in flight, 2 CTAs per SM), completing on a `full` mbarrier; a last, partial
page copies only its live keys and the 16-byte words of their scales, so keys past the
length are never read. Warps 0-3 (one warpgroup) are the consumers: once per CTA they
write the token's 64 query rows to shared memory as fp16 (e4m3 widens exactly) in the
no-swizzle K-major layout wgmma reads (8 x 16 B core matrices; chunk c of head n at
c x 1024 + n x 16) and keep its head weights in registers; per page they load their keys
(thread (warp w, g, t): key rows 16 w + g and + 8, bytes 16 t.. and 64 + 16 t..; odd rows
take the halves in the other order so a quarter-warp hits 32 distinct banks), release the
stage to the producer (`empty` mbarrier), widen the bytes to fp16 pairs
(`cvt.rn.f16x2.e4m3x2`, exact) and issue eight `wgmma.m64n64k16.f32.f16.f16` with the
keys as A from registers (M = the page's 64 keys) and the queries as B from shared memory
(N = 64 heads), FP32 accumulation. Thread (w, g, t) then holds keys 16 w + g (+ 8) x heads
8 j + 2 t (+ 1): ReLU, the weighted head sum in registers, two butterflies over the 4
lanes of a key, times the key's scale.

Predicted when written (us per launch, B = 1 / 4 / 16 / 64): 32K ~3 / 5.5 / 19 / 70, 128K
~6 / 19 / 70 / 275 -- the cache bytes at ~4.0 TB/s plus ~1.5-2 us of launch, first-page
latency and the last page's compute. Measured on the H200 (bench/RESULTS.md, sessions 10
to 14): 32K 4.04-4.74 / 8.95-9.81 / 22.6-23.4 / 76.7-77.2, 128K 8.79 / 24.0-24.6 / 75.9-77.5 /
284-288. The small batches miss by each CTA's chain after the PDL wait (session 14's trace
probe, 32K B = 1: 1.7 us staging the query rows, then 0.6-0.7 us a page of math), not by the
pages' arrival or the conversions. Staged by coalesced loads since session 16 (`stage_queries`),
the rows take 0.9-1.3 us (the step 0.4-1.2 us faster at B <= 16).

Per page and SM the tensor cores need ~256 cycles (8 m64n64k16 at 4096 FLOP/clock),
shared memory ~250 (16 KB of B reads, 8 KB of key loads, 8.4 KB of copies), a consumer warp
issues ~190 instructions (32 F2FP), against ~500 cycles of HBM time per page per SM at 4.3
TB/s: bandwidth-bound with 4 CTAs (16 pages) per SM in flight, if the F2FP rate is not below
16 per clock per SM.

Why fp16 wgmma and not e4m3: `mma.sync ... e4m3` is not native on sm_90 (ptxas emulates
it: F2FP + two HMMA + four FADD per MMA, what v2 ran), and e4m3 wgmma accumulates in
reduced precision (DeepSeek-V3 measured ~14 bits on H800), which would break "within
1e-5 of the fp32 reference". e4m3 -> fp16 is exact and fp16 wgmma accumulates in FP32.

The k order inside an MMA is free as long as A and B agree: a thread's key byte i of its
32 (i < 16: 16 t + i, else 64 + 16 t + i - 16) is logical k = 16 s + 8 h + 2 t + j with
i = 4 s + 2 h + j, and the query rows are written to shared memory in the same order
(`key_byte`, `a_fragment`, `query_slice`, `query_target`, `query_offset`; tests/test_dsa_index_layout.py
checks them against the PTX fragment layouts on the CPU). Under DCP the local length of a
sequence is ceil((len - rank) / dcp). Every byte offset into the cache is 64-bit (caches
pass 2 GiB). PDL: the cache pages, query rows and weights are read after
griddepcontrol.wait (IndexKey writes the new key into the cache, IndexQuery the query rows);
before it only the length and block-table entries (no kernel of the step writes them) and an
L2 prefetch of the run's first pages (as many as its ring holds), which brings no data into
the SM (L2 is the point of coherence: the copies after the wait see IndexKey's write), so a
launch's first pages stream in while its predecessor finishes.

Guard (kernels/guards.py): a live page id outside [0, pool_pages) is a hole. The producer
copies nothing for it (its stage completes on a bare expect_tx of 0 bytes) and records it;
the consumers, who hold the run's block-table entries too (loaded before the wait), score
its 64 keys -inf whatever the stale stage holds; no prefetch is issued for it.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32

from . import guards
from . import primitives as P

HEADS, DIM, PAGE = 64, 128, 64
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"index_heads": (HEADS,), "index_dim": (DIM,), "page_size": (PAGE,)}
KEY_BYTES = PAGE * DIM  # 8192: the page's keys, then its 64 fp32 scales
PAGE_BYTES = KEY_BYTES + 4 * PAGE  # 8448 (graphstep/formats.py)
STAGES = 4  # pages in flight per CTA (the default ring)
DEEP_STAGES = 8  # a run of up to 8 pages all in flight at once (`ring_for`)
RINGS = (STAGES, DEEP_STAGES)
CONSUMERS = 128  # one warpgroup
THREADS = CONSUMERS + 32  # + the producer warp
QUERY_BYTES = HEADS * DIM * 2  # the token's query rows as fp16 in shared memory
NTILES = HEADS // 8
SMS = P.SMS
# The runs the host picks from (every one GPU-tested). A run longer than the ring reuses its
# stages: each release is preceded by a proxy fence (see `consume`).
CTA_PAGES = (2, 4, 8, 16, 32)
# 96 registers x 160 threads and 50 KB of shared memory: 4 CTAs per SM, 16 pages in flight
WAVE_CTAS = 4 * SMS
# Device probes (wrong scores, times only; bench/bench_indexer.py --dsa-probes): no_widen feeds
# the key words to the wgmma unconverted, no_mma skips the wgmma; trace runs the kernel as it is
# and then writes each CTA's timeline over its own first scores (TRACE_SLOTS; bench_indexer.py
# --dsa-trace; a probe that stored no scores let ptxas drop the head sums: half the registers).
# (H200, session 14: at 32K B = 4 no_widen / no_mma save 0.4 / 1.7 of 9.4 us; widening by
# integer bit moves instead of cvt, or half by each, was slower everywhere: the conversions
# are not what bounds the kernel. bench/RESULTS.md) trace_no_rows traces a kernel that widens
# constant words instead of loading the query rows: what the rows' loads cost of the 1.5-2 us
# from the PDL wait to the rows staged (session 15: not their order, nor a cold line).
PROBES = ("", "no_widen", "no_mma", "trace", "trace_no_rows")
PROBE = ""
# The trace probe's int32 slots from a CTA's first score position: globaltimer ns at entry
# (2 words) and after its last page (2), then %clock deltas from entry: after the last page,
# the PDL wait's return, the query rows staged; the live page count (not a time); then %clock
# deltas at page i's full-barrier wait done (i < TRACE_PAGES; kept in shared memory until the end).
TRACE_SLOTS = ("start", "start_hi", "end", "end_hi", "clk_end", "clk_wait", "clk_query", "live")
TRACE_PAGES = 2 * PAGE - len(TRACE_SLOTS)  # a run of >= 2 pages has room


def pages_per_cta(batch: int, pages_per_seq: int) -> int:
    """Pages per CTA for a launch: the smallest run in CTA_PAGES whose grid fits one wave of
    WAVE_CTAS CTAs (else the longest), and at least min(2 x batch, 16) pages: each CTA
    widens its token's query rows into shared memory once, and once the batch fills the GPU
    longer runs amortize that (H200, `bench/bench_indexer.py --runs`, 32K: B = 4 9.0 us at
    8 pages against 9.7 at 4; B = 8 14.4 at 16 against 15.4 at 8; bench/RESULTS.md)."""
    for run in CTA_PAGES:
        if run >= min(2 * batch, 16) and batch * -(-pages_per_seq // run) <= WAVE_CTAS:
            return run
    return CTA_PAGES[-1]


def ring_for(batch: int, pages_per_seq: int, run: int) -> int:
    """The ring depth of a launch: DEEP_STAGES when the run is longer than STAGES but fits the
    deep ring and the grid fits one wave of the deep ring's 2 CTAs per SM (84 KB each; at 32K
    that is B = 3 / 4, 8-page runs), so every page of a CTA is in flight from the start instead of
    the run's second half waiting for the first half's stages (session 14's trace at 32K B = 4:
    0.41 us a page against 0.10 at B = 1, whose 2-page runs are all in flight); else STAGES."""
    deep = STAGES < run <= DEEP_STAGES and batch * -(-pages_per_seq // run) <= 2 * SMS
    return DEEP_STAGES if deep else STAGES


def grid_for(batch: int, pages_per_seq: int, run: int) -> tuple[int, int]:
    return (-(-pages_per_seq // run), batch)


# -- the k order and the layouts (pure index math, shared with tests/test_dsa_index_layout.py)

LBO, SBO = HEADS * 16, 8 * 16  # bytes between k chunks / between 8-head groups of the fp16 query rows
DESC_LAYOUT = (SBO >> 4) << 32 | (LBO >> 4) << 16  # wgmma descriptor bits besides the start address
STEP_BYTES = 2 * LBO  # the query bytes one k16 step reads (two k chunks)


def key_byte(i: int, t):
    """The byte of a key row that byte i (of 32) of thread t's share holds: [16 t, 16 t + 16)
    then [64 + 16 t, 64 + 16 t + 16)."""
    return 16 * t + i if i < 16 else 64 + 16 * t + i - 16


def a_fragment(halves, s: int) -> list:
    """A registers of k16 step s from a thread's fp16 pairs of rows g (halves[0]) and
    g + 8 (halves[1]), pair q = bytes 2 q, 2 q + 1 of its 32: (g, k 2t..) (g + 8, k 2t..)
    (g, k 8 + 2t..) (g + 8, k 8 + 2t..) of the step. So logical k = 16 s + 8 h + 2 t + j
    is byte i = 4 s + 2 h + j of the share."""
    return [halves[0][2 * s], halves[1][2 * s], halves[0][2 * s + 1], halves[1][2 * s + 1]]


def query_slice(j: int, lane, warp) -> tuple:
    """(head, byte) of the 16 bytes a consumer lane loads in its load j: warp w's load j
    covers bytes [2048 w + 512 j, + 512) of the token's 64 x 128-byte rows, lane l 16 at 16 l
    (coalesced: 4 whole rows an instruction)."""
    at = 2048 * warp + 512 * j + 16 * lane
    return at // DIM, at % DIM


def query_target(byte, m: int, high: int) -> tuple:
    """(k chunk, position tt) of the byte pair `high` (bytes 2 high, 2 high + 1) of word m of the
    16 bytes at `byte` of a query row: the pair goes to bytes [4 tt, 4 tt + 4) of the chunk's
    16 (as fp16x2). k chunk c holds logical k 8 c .. 8 c + 7: byte b = 64 h + 16 tt + 4 m' + e
    of a row is logical k 8 (8 h + 2 m' + e // 2) + 2 tt + e % 2 (key_byte's order)."""
    return 8 * (byte // 64) + 2 * m + high, byte % 64 // 16


def query_offset(chunk: int, n):
    """Byte offset of k chunk `chunk` of head n in the fp16 query rows (K-major, no swizzle:
    8 heads x 16 B core matrices, SBO between 8-head groups, LBO between k chunks)."""
    return chunk * LBO + n * 16


def accumulator(nt: int, r: int, e: int) -> int:
    """Index of (key row g + 8 r, head 8 nt + 2 t + e) in a thread's 32 wgmma accumulators."""
    return 4 * nt + 2 * r + e


# -- loads, conversions and the wgmma of a page (32-bit shared addresses) ----------------


def _ldg_nc_i32(ptr) -> Int32:
    """Read-only global load (data no kernel of the step writes: lengths, block tables)."""
    return cute.arch.inline_ptx("ld.global.nc.s32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[ptr])


def _prefetch_l2(ptr, nbytes):
    """Bulk L2 prefetch of nbytes (a multiple of 16) at a 16-byte aligned address."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};", read_only_args=[ptr, nbytes])


def _as_f32(word) -> Float32:
    """A 32-bit word's bits as an fp32 (the no_mma probe's stand-in accumulators)."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[word])


def _consumer_sync():
    cute.arch.inline_ptx(f"bar.sync 1, {CONSUMERS};")


def _e4m3x2_to_f16x2(word, high: int) -> Uint32:
    """Bytes 0-1 (high = 0) or 2-3 (high = 1) of a word -> one fp16x2 word; exact."""
    half = "hi" if high else "lo"
    return cute.arch.inline_ptx(
        f"{{\n\t.reg .b16 lo, hi;\n\tmov.b32 {{lo, hi}}, {{$r0}};\n\tcvt.rn.f16x2.e4m3x2 {{$w0}}, {half};\n\t}}",
        write_only_types=[Uint32],
        read_only_args=[word],
    )


def _wgmma_page(a, qbase) -> list:
    """One page: D[64 keys, 64 heads] = sum over 8 k-steps of A (registers: a[4 s .. 4 s + 3]
    is step s's fragment) x B (shared fp16 queries at qbase, K-major no swizzle: LBO 1024 B
    between k chunks, SBO 128 B between 8-head groups; step s starts s x STEP_BYTES in).
    Issued, committed and waited for inside one asm block, so nothing touches the
    accumulators or A while the wgmmas are in flight. Returns the 32 accumulators."""
    d = ", ".join(f"{{$w{i}}}" for i in range(32))
    lines = [
        "{",
        ".reg .b64 desc0, desc;",
        ".reg .pred first, more;",
        *P.smem_desc_lines("desc0", "{$r32}", DESC_LAYOUT),
        "setp.ne.b32 first, 0, 0;",
        "setp.eq.b32 more, 0, 0;",
        "wgmma.fence.sync.aligned;",
    ]
    for s in range(8):
        regs = ", ".join(f"{{$r{4 * s + i}}}" for i in range(4))
        lines.append(f"add.s64 desc, desc0, {s * STEP_BYTES >> 4};")
        lines.append(
            f"wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {{{d}}}, {{{regs}}}, desc, "
            f"{'first' if s == 0 else 'more'}, 1, 1, 0;"
        )
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    out = cute.arch.inline_ptx("\n\t".join(lines), write_only_types=[Float32] * 32, read_only_args=list(a) + [qbase])
    return list(out)


class DsaIndex:
    def __init__(self, dcp: int = 1, rank: int = 0, pdl: bool = True, stages: int = STAGES):
        """stages: the ring's depth, one of RINGS (the host's choice: `ring_for`)."""
        if stages not in RINGS:
            raise ValueError(f"DsaIndex ring of {stages} stages: expected one of {RINGS}")
        self.dcp, self.rank, self.pdl, self.stages = dcp, rank, pdl, stages
        self.probe = PROBE
        if self.probe not in PROBES:
            raise ValueError(f"dsa_index.PROBE must be one of {PROBES}, got {self.probe!r}")
        self.tracing = self.probe.startswith("trace")

    @cute.jit
    def __call__(
        self,
        q: cute.Pointer,
        head_w: cute.Pointer,
        cache: cute.Pointer,
        block_tables: cute.Pointer,
        context_lens: cute.Pointer,
        scores: cute.Pointer,
        batch: Int32,
        pages_per_seq: Int32,
        run: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
        stream: cuda.CUstream,
    ):
        self.dsa_index(
            q, head_w, cache, block_tables, context_lens, scores, pages_per_seq, run, error, pool_pages
        ).launch(
            grid=[(pages_per_seq + run - 1) // run, batch, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def dsa_index(
        self,
        q: cute.Pointer,
        head_w: cute.Pointer,
        cache: cute.Pointer,
        block_tables: cute.Pointer,
        context_lens: cute.Pointer,
        scores: cute.Pointer,
        pages_per_seq: Int32,
        run: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        chunk, token, _ = cute.arch.block_idx()
        clock0, start = Int32(0), Int64(0)
        if cutlass.const_expr(self.tracing):
            clock0, start = cute.arch.clock(), P.globaltimer()
        lane, warp = tid % 32, tid // 32
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint8, cute.make_layout(self.stages * PAGE_BYTES), byte_alignment=128)
        queries = smem.allocate_tensor(Uint8, cute.make_layout(QUERY_BYTES), byte_alignment=128)
        bars = smem.allocate_tensor(Int64, cute.make_layout(2 * self.stages), byte_alignment=8)
        marks0 = Int32(0)
        if cutlass.const_expr(self.tracing):
            marks0 = smem.allocate_tensor(Int32, cute.make_layout(TRACE_PAGES), byte_alignment=16).iterator.toint()
        ring0, qbase = ring.iterator.toint(), queries.iterator.toint()
        full0 = bars.iterator.toint()
        empty0 = full0 + 8 * self.stages
        if tid == 0:
            for s in cutlass.range_constexpr(self.stages):
                P.mbar_init(full0 + 8 * s, 1)
                P.mbar_init(empty0 + 8 * s, CONSUMERS)
            P.mbar_init_fence()
        # Before the PDL wait only what no kernel of the step writes: the length, the run's
        # first 32 block-table entries (one per lane), and an L2 prefetch of the run's first
        # stages pages (live bytes only; no data reaches the SM, and L2 is the point of
        # coherence, so IndexKey's later write of the new key is what the copies read).
        length = cutlass.max((_ldg_nc_i32(context_lens + token) - self.rank + self.dcp - 1) // self.dcp, 0)
        first = chunk * run  # this CTA's first page (index into the token's block table)
        count = cutlass.max(cutlass.min(run, pages_per_seq - first), 0)
        live = cutlass.min(cutlass.max((length + PAGE - 1) // PAGE - first, 0), count)
        width = pages_per_seq * PAGE
        table = block_tables + token * pages_per_seq
        mine = _ldg_nc_i32(table + cutlass.min(first + lane, pages_per_seq - 1))
        if warp == CONSUMERS // 32 and lane < cutlass.min(live, self.stages) and P.in_range(mine, pool_pages):
            keys = cutlass.min(length - (first + lane) * PAGE, PAGE)
            src = cache + Int64(mine) * PAGE_BYTES
            _prefetch_l2(src, keys * DIM)
            _prefetch_l2(src + KEY_BYTES, (keys * 4 + 15) // 16 * 16)
        cute.arch.sync_threads()  # the mbarriers are initialized
        cute.arch.griddepcontrol_wait()
        waited = Int32(0)
        if cutlass.const_expr(self.tracing):
            waited = cute.arch.clock() - clock0
        cute.arch.griddepcontrol_launch_dependents()
        if warp == CONSUMERS // 32:
            self.produce(
                cache,
                table,
                mine,
                pages_per_seq,
                first,
                live,
                length,
                ring0,
                full0,
                empty0,
                lane,
                error,
                token,
                pool_pages,
            )
        else:
            self.consume(
                q,
                head_w,
                scores,
                token,
                width,
                first,
                count,
                live,
                length,
                ring0,
                qbase,
                full0,
                empty0,
                tid,
                lane,
                warp,
                table,
                mine,
                pages_per_seq,
                pool_pages,
                (clock0, start, waited, marks0),
            )

    @cute.jit
    def produce(
        self,
        cache,
        table,
        mine,
        pages_per_seq,
        first,
        live,
        length,
        ring0,
        full0,
        empty0,
        lane,
        error,
        token,
        pool_pages,
    ):
        """Warp 4: the block-table entries 32 at a time (one per lane; the first 32 loaded
        before the wait), then one bulk copy per live page into the ring, waiting for the
        consumers to free a stage; a page outside the pool: no copy, recorded."""
        for i0 in range(0, live, 32):
            if i0 > 0:
                mine = _ldg_nc_i32(table + cutlass.min(first + i0 + lane, pages_per_seq - 1))
            for j in range(0, cutlass.min(32, live - i0)):
                i = i0 + j
                page = cute.arch.shuffle_sync(mine, j)
                stage, use = i % self.stages, i // self.stages
                if use > 0:
                    P.mbar_wait(empty0 + 8 * stage, (use - 1) % 2)
                if lane == 0:
                    keys = cutlass.min(length - (first + i) * PAGE, PAGE)
                    dst, bar = ring0 + stage * PAGE_BYTES, full0 + 8 * stage
                    src = cache + Int64(page) * PAGE_BYTES  # 64-bit: caches pass 2 GiB
                    if not P.in_range(page, pool_pages):  # a hole: the stage completes with no bytes
                        P.mbar_expect(bar, Int32(0))
                        P.record_range(error, guards.DSA_INDEX_PAGE, token, page)
                    elif keys == PAGE:
                        P.mbar_expect(bar, Int32(PAGE_BYTES))
                        P.bulk_copy_g2s(dst, src, Int32(PAGE_BYTES), bar)
                    else:  # the last page: its live keys and the 16-byte words of their scales
                        scale_bytes = (keys * 4 + 15) // 16 * 16
                        P.mbar_expect(bar, keys * DIM + scale_bytes)
                        P.bulk_copy_g2s(dst, src, keys * DIM, bar)
                        P.bulk_copy_g2s(dst + KEY_BYTES, src + KEY_BYTES, scale_bytes, bar)

    @cute.jit
    def consume(
        self,
        q,
        head_w,
        scores,
        token,
        width,
        first,
        count,
        live,
        length,
        ring0,
        qbase,
        full0,
        empty0,
        tid,
        lane,
        warp,
        table,
        mine,
        pages_per_seq,
        pool_pages,
        times,
    ):
        """Warps 0-3. mine: block-table entry first + lane (as the producer's), so that a
        page outside the pool scores -inf (the producer copied nothing into its stage).
        times: (entry %clock, entry globaltimer, %clock delta at the PDL wait's return, the
        shared page marks), used by the trace probe only."""
        g, t = lane // 4, lane % 4
        out = scores + token * width
        trace = out + first * PAGE  # the trace probe's slots (TRACE_SLOTS)
        tracing = self.tracing
        if live > 0:
            self.stage_queries(q, token, qbase, tid)
            # this thread's heads: 8 j + 2 t and + 1
            weights = [P.load_f32x2(head_w + token * HEADS + nt * 8 + 2 * t) for nt in range(NTILES)]
            P.fence_proxy_async()
            _consumer_sync()
            staged = Int32(0)
            if cutlass.const_expr(tracing):
                staged = cute.arch.clock() - times[0]
            odd = g % 2
            for i in range(live):
                stage = i % self.stages
                if i % 32 == 0 and i > 0:  # runs past 32 pages: the next 32 entries
                    mine = _ldg_nc_i32(table + cutlass.min(first + i + lane, pages_per_seq - 1))
                page_ok = P.in_range(cute.arch.shuffle_sync(mine, i % 32), pool_pages)
                P.mbar_wait(full0 + 8 * stage, (i // self.stages) % 2)
                if cutlass.const_expr(tracing):
                    if tid == 0 and i < TRACE_PAGES:
                        P.st_shared_u32(Int32(times[3] + 4 * i), cute.arch.clock() - times[0])
                base = ring0 + stage * PAGE_BYTES
                rows = [warp * 16 + g, warp * 16 + g + 8]
                frags = []
                scales = []
                for r in cutlass.range_constexpr(2):
                    row = base + rows[r] * DIM
                    lo_at, hi_at = row + key_byte(0, t), row + key_byte(16, t)
                    # odd rows read the halves in the other order: a quarter-warp's 8 loads
                    # (rows g, g + 1 x 4 lanes) then cover all 32 banks
                    x = P.ld_shared_u32x4(Int32(cutlass.select_(odd == 1, hi_at, lo_at)))
                    y = P.ld_shared_u32x4(Int32(cutlass.select_(odd == 1, lo_at, hi_at)))
                    lo = [Uint32(cutlass.select_(odd == 1, y[k], x[k])) for k in range(4)]
                    hi = [Uint32(cutlass.select_(odd == 1, x[k], y[k])) for k in range(4)]
                    frags.append(lo + hi)  # the share's bytes i = 0..31 (key_byte(i, t)), 4 per word
                    scales.append(P.ld_shared_f32(base + KEY_BYTES + 4 * rows[r]))
                halves = [[], []]  # per row: 16 fp16x2 words, byte pairs 2 q, 2 q + 1 of the 32
                for r in cutlass.range_constexpr(2):
                    for k in cutlass.range_constexpr(8):
                        if cutlass.const_expr(self.probe == "no_widen"):
                            f0, f1 = frags[r][k], frags[r][k]
                        else:
                            f0, f1 = P.e4m3x4_to_f16x2(frags[r][k])
                        halves[r] += [f0, f1]
                # Release the stage to the producer's next bulk copy. The fence is what makes the
                # release safe: ptxas schedules the arrive right after the four LDS.128 of the
                # key words, before the F2FP that consume them, and the arrive does not wait for
                # the loads' data -- without it the copy into the reused stage overwrote key
                # words still being read (wrong keys in pairs of rows = one quarter-warp's
                # LDS.128, H200, bench/RESULTS.md). fence.proxy.async orders this thread's
                # generic-proxy reads before the async-proxy (bulk copy) writes that follow the
                # release; a bar.sync among the consumers did not (1 launch in 20 still wrong).
                P.fence_proxy_async()
                P.mbar_arrive(empty0 + 8 * stage)
                a = []
                for s in cutlass.range_constexpr(8):
                    a += a_fragment(halves, s)
                if cutlass.const_expr(self.probe == "no_mma"):
                    acc = [_as_f32(a[k]) for k in range(32)]
                else:
                    acc = _wgmma_page(a, qbase)
                sums = self.head_sums(acc, weights)
                position = (first + i) * PAGE
                if t == 0:
                    for r in cutlass.range_constexpr(2):
                        key = position + rows[r]
                        live_key = key < length and page_ok
                        P.store_f32(out + key, P.select(live_key, sums[r] * scales[r], Float32(float("-inf"))))
            if cutlass.const_expr(tracing):
                # over this CTA's own scores, after all of them (the barrier); the -inf fill
                # below starts at page `live`, past the 8 + min(live, TRACE_PAGES) slots
                finished, ended = cute.arch.clock() - times[0], P.globaltimer()
                _consumer_sync()
                for j in range(tid, cutlass.min(live, TRACE_PAGES), CONSUMERS):
                    P.store_i32(trace + len(TRACE_SLOTS) + j, P.ld_shared_i32(times[3] + 4 * j))
                if tid == 0:
                    P.store_i64(trace, times[1])
                    P.store_i64(trace + 2, ended)
                    P.store_i32(trace + 4, finished)
                    P.store_i32(trace + 5, times[2])
                    P.store_i32(trace + 6, staged)
                    P.store_i32(trace + 7, live)
        # pages of the run past the length: -inf, never read
        start, stop = (first + live) * PAGE, (first + count) * PAGE
        for p in range(start + tid, stop, CONSUMERS):
            P.store_f32(out + p, Float32(float("-inf")))

    @cute.jit
    def stage_queries(self, q, token, qbase, tid):
        """The token's 64 e4m3 query rows -> shared fp16, in the keys' k order: 4 coalesced
        16-byte loads a thread (`query_slice`: 512 contiguous bytes a warp instruction), each
        byte pair widened to fp16x2 and stored at its k chunk and position (`query_target`,
        `query_offset`). (Reading 64 bytes of one row a thread, 32 rows an instruction, the
        staging took 1.7 us after the PDL wait in the step at B = 1, 1.3 of it the loads.)"""
        lane, warp = tid % 32, tid // 32
        words = []
        for j in cutlass.range_constexpr(4):
            if cutlass.const_expr(self.probe == "trace_no_rows"):
                words.append([Uint32(0x38383838 + j)] * 4)  # e4m3 1.0s: no load (wrong scores)
            else:
                # query_slice's bytes, the offset added term by term: written through query_slice,
                # ptxas no longer folds the 512 j into the loads' immediates (+32 SASS; not measured)
                words.append(P.load_u32x4(q + token * HEADS * DIM + 2048 * warp + 512 * j + 16 * lane))
        for j in cutlass.range_constexpr(4):
            head, byte = query_slice(j, lane, warp)
            for m in cutlass.range_constexpr(4):
                for high in cutlass.range_constexpr(2):
                    chunk, tt = query_target(byte, m, high)
                    address = qbase + query_offset(chunk, head) + 4 * tt
                    P.st_shared_u32(address, _e4m3x2_to_f16x2(words[j][m], high))

    @cute.jit
    def head_sums(self, acc, weights):
        """Unscaled scores of rows g and g + 8 (every lane of the quad ends with them):
        acc[4 j + 2 r + e] is row g + 8 r x head 8 j + 2 t + e."""
        sums = []
        for r in cutlass.range_constexpr(2):
            parts = [Float32(0), Float32(0)]
            for nt in cutlass.range_constexpr(NTILES):
                for e in cutlass.range_constexpr(2):
                    parts[e] = parts[e] + cute.arch.fmax(acc[accumulator(nt, r, e)], Float32(0)) * weights[nt][e]
            total = parts[0] + parts[1]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            sums.append(total)
        return sums


def compile_args():
    return (
        P.gmem_ptr(Uint8),
        P.gmem_ptr(Float32),
        P.gmem_ptr(Uint8),
        P.gmem_ptr(Int32, align=4),
        P.gmem_ptr(Int32, align=4),
        P.gmem_ptr(Float32, align=4),
        Int32(1),
        Int32(1),
        Int32(2),
        P.gmem_ptr(Int32, align=8),
        Int32(1),
    )
