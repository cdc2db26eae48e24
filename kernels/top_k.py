"""TopK: the k highest DsaIndex scores of each token, by radix select (no sort).

One CTA of 1024 threads per token. The row is read in chunks of 16K scores; in a chunk,
warp w owns the contiguous segment [512 w, 512 w + 512), read as four coalesced 16-byte
loads per lane (lane l, load u: scores 4 (32 u + l) .. + 3 of the segment), so each warp
load instruction covers 512 contiguous bytes. A score's float bits map to an
order-preserving 32-bit key; histogram rounds over 11 + 11 + 10 key bits find the exact
k-th key T and how many keys equal to T are still needed; a round whose chosen bin is
needed whole ends the search early (with continuous scores, usually after two). Every
histogram is plain shared-memory atomics: warp-aggregating the first round with
`match.any` (scores of similar magnitude share their top 11 bits) was measured 2x slower
at 32K (bench/RESULTS.md).

Output, in ascending score index (the sparse core does not depend on order; a compaction
in index order is what needs no sort): every index with key > T, and the first `need`
indices with key == T, so equal scores go to the lower index first. The compaction ranks
each element with warp ballots (in-segment order is load, then lane, then element) and one
block scan of the warps' counts per chunk. Rows shorter than k keep every position and
are padded with -1. With DCP the output is this rank's candidates for the merge: global
positions (local x dcp + rank) and their scores (-inf padded); otherwise cache slots
(block table page x 64 + offset); a kept position whose page is outside [0, pool_pages)
becomes slot -1 (a hole SparseCore skips) and is recorded (kernels/guards.py).

Two kernels give that output. `TopK`, one CTA of 1024 threads per row, streams the row in
16K chunks once per round (DcpMerge shares its RadixSelect). `ClusterTopK` splits a row
over a thread-block cluster (`Split`: CTAs x threads x scores per thread), each CTA holding
its slice in registers (the larger splits keep part of it in shared memory), so the row is
read from global memory once; after round 0 a CTA lists the scores that can be kept, and
the later rounds and the compaction read only that list; the CTAs exchange their histograms
by one-way pushes into each other's shared memory (see its docstring). The host picks the variant with
`split_for(width, batch)` (graphstep/launch.py), by the row width of the block table and
the batch (the measured PICKS table); every split in SPLITS is compiled by
kernels/catalog.py. TopK runs rows wider than every split.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from . import guards
from . import primitives as P

THREADS = 1024
WARPS = THREADS // 32
LOADS = 4  # 16-byte loads per lane per chunk
SEGMENT = 32 * 4 * LOADS  # scores per warp per chunk
CHUNK = WARPS * SEGMENT
PAGE = 64
ROUNDS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of each radix digit, high first
HIST = 1 << 11
ALL = 2**31 - 1
M32 = 2**32 - 1
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"page_size": (PAGE,)}


def order_key(word) -> Uint32:
    """fp32 bits -> a key whose unsigned order is the float order (-inf lowest). -0.0 is
    keyed as +0.0: equal scores must tie (the lower index first), and -0.0 == +0.0."""
    word = Uint32(cutlass.select_(word == Uint32(0x80000000), Uint32(0), word))
    flip = (Uint32(0) - (word >> Uint32(31))) | Uint32(0x80000000)
    return word ^ flip


def element(start, warp, lane, e):
    """The index of a lane's element e (load e // 4, word e % 4) in the chunk at `start`."""
    return start + warp * SEGMENT + (e // 4 * 32 + lane) * 4 + e % 4


class RadixSelect:
    """The threshold search TopK and DcpMerge share. A subclass defines
    `segment(source, start, warp, lane) -> (words, valids)`: a lane's elements of the chunk
    at `start` (TopK: 4 x LOADS, see `element`; DcpMerge: the few it holds, one chunk) as
    fp32 bits, and which of them take part."""

    chunk = CHUNK  # elements a round reads per `segment` call

    @staticmethod
    def begin() -> tuple:
        """A kernel's opening: (tid, token, lane, warp) and the shared buffers (histogram,
        per-warp scratch, the chosen bin's 4 words), after the PDL wait and release."""
        tid, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(HIST), byte_alignment=16)
        scratch = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
        chosen = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        return tid, token, lane, warp, hist, scratch, chosen

    @cute.jit
    def find_threshold(self, source, count, k: int, hist, scratch, chosen, tid, lane, warp):
        """(T, need) over the `count` elements of `source`: the k best are every valid key
        > T and the first `need` valid keys == T (need = ALL: every one). Fewer than k
        valid keys: T = 0 and need = ALL (every valid key)."""
        threshold, need = Uint32(0), Int32(k)
        prefix, done = Uint32(0), Int32(0)
        for r in cutlass.range_constexpr(len(ROUNDS)):
            shift, bits = ROUNDS[r]
            if done == 0:
                for i in range(tid, HIST, THREADS):
                    hist[i] = 0
                cute.arch.sync_threads()
                for start in range(0, count, self.chunk):
                    words, valids = self.segment(source, start, warp, lane)
                    for e in cutlass.range_constexpr(len(words)):
                        key = order_key(words[e])
                        digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                        if r == 0:
                            if valids[e]:
                                cute.arch.atomic_add(hist.iterator + digit, Int32(1))
                        else:
                            if valids[e] and (key >> Uint32(shift + bits)) == prefix:
                                cute.arch.atomic_add(hist.iterator + digit, Int32(1))
                cute.arch.sync_threads()
                self.find_bin(hist, scratch, chosen, 1 << bits, need, tid, lane, warp)
                if chosen[3] < need:  # round 0 only: fewer valid keys than k, keep them all
                    threshold, need, done = Uint32(0), Int32(ALL), Int32(1)
                else:
                    prefix = (prefix << Uint32(bits)) | Uint32(chosen[0])
                    need = need - chosen[1]
                    threshold = prefix << Uint32(shift)
                    if chosen[2] == need:  # the bin is taken whole: every key >= its lowest
                        need = Int32(ALL)
                        done = Int32(1)
        return threshold, need

    @cute.jit
    def warp_scan(self, count, scratch, lane, warp):
        """(sum of `count` over the lower warps, sum over all warps) for a per-warp count."""
        if lane == 0:
            scratch[warp] = count
        cute.arch.sync_threads()
        mine = scratch[lane]
        inclusive = mine
        for offset in (1, 2, 4, 8, 16):
            below = cute.arch.shuffle_sync_up(inclusive, offset=offset)
            inclusive = inclusive + P.select_i32(lane >= offset, below, 0)
        before = cute.arch.shuffle_sync(inclusive - mine, offset=warp)
        total = cute.arch.shuffle_sync(inclusive, offset=31)
        cute.arch.sync_threads()
        return before, total

    @cute.jit
    def find_bin(self, hist, scratch, chosen, bins: int, need, tid, lane, warp):
        """chosen = (the bin holding the need-th highest key, the count above that bin, the
        bin's own count, the count of every bin). Thread t owns bins in descending order, so
        an exclusive scan counts what is above."""
        per = bins // THREADS
        counts = []
        for j in cutlass.range_constexpr(per):
            counts.append(hist[bins - 1 - (tid * per + j)])
        total = counts[0]
        for j in cutlass.range_constexpr(1, per):
            total = total + counts[j]
        before = P.block_exclusive_sum(total, scratch, lane, warp, WARPS)
        if tid == THREADS - 1:
            chosen[3] = before + total
        for j in cutlass.range_constexpr(per):
            if before < need and before + counts[j] >= need:
                chosen[0] = bins - 1 - (tid * per + j)
                chosen[1] = before
                chosen[2] = counts[j]
            before = before + counts[j]
        cute.arch.sync_threads()


class TopK(RadixSelect):
    def __init__(self, k: int = 2048, dcp: int = 1, rank: int = 0, pdl: bool = True):
        self.k, self.dcp, self.rank, self.pdl = k, dcp, rank, pdl

    @cute.jit
    def __call__(
        self,
        scores: cute.Pointer,
        block_tables: cute.Pointer,
        context_lens: cute.Pointer,
        out: cute.Pointer,
        out_scores: cute.Pointer,
        batch: Int32,
        pages_per_seq: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
        stream: cuda.CUstream,
    ):
        self.top_k(scores, block_tables, context_lens, out, out_scores, pages_per_seq, error, pool_pages).launch(
            grid=[batch, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def top_k(
        self,
        scores: cute.Pointer,
        block_tables: cute.Pointer,
        context_lens: cute.Pointer,
        out: cute.Pointer,
        out_scores: cute.Pointer,
        pages_per_seq: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
    ):
        tid, token, lane, warp, hist, scratch, chosen = self.begin()

        width = pages_per_seq * PAGE
        n = cutlass.min(
            cutlass.max((P.load_i32(context_lens + token) - self.rank + self.dcp - 1) // self.dcp, 0), width
        )
        row = scores + token * width
        last_vector = cutlass.max(n - 1, 0) // 4 * 4

        threshold, need = Uint32(0), Int32(ALL)  # n <= k: every position is kept
        if n > self.k:
            threshold, need = self.find_threshold(
                (row, n, last_vector), n, self.k, hist, scratch, chosen, tid, lane, warp
            )

        # Ordered compaction: an element's place = (keys above T before it) + min(keys at T
        # before it, need); it is taken if above T, or at T with fewer than `need` before it.
        lower_lanes = (Int32(1) << lane) - Int32(1)
        above_done, at_done = Int32(0), Int32(0)  # counts of the chunks before this one
        for start in range(0, n, CHUNK):
            words, valids = self.segment((row, n, last_vector), start, warp, lane)
            above, at = [], []
            warp_above, warp_at = Int32(0), Int32(0)
            for e in cutlass.range_constexpr(4 * LOADS):
                key = order_key(words[e])
                valid = valids[e]
                above.append(cute.arch.vote_ballot_sync(valid and key > threshold))
                at.append(cute.arch.vote_ballot_sync(valid and key == threshold))
                warp_above = warp_above + cute.arch.popc(above[e])
                warp_at = warp_at + cute.arch.popc(at[e])
            # the warps' counts before this one (both packed in one int: each <= CHUNK < 2^16)
            before, total = self.warp_scan(warp_above | (warp_at << 16), scratch, lane, warp)
            above_before = above_done + (before & 0xFFFF)
            at_before = at_done + (before >> 16)
            for u in cutlass.range_constexpr(LOADS):
                lane_above, lane_at = above_before, at_before
                for j in cutlass.range_constexpr(4):
                    lane_above = lane_above + cute.arch.popc(above[4 * u + j] & lower_lanes)
                    lane_at = lane_at + cute.arch.popc(at[4 * u + j] & lower_lanes)
                for j in cutlass.range_constexpr(4):
                    e = 4 * u + j
                    mine_above = (above[e] >> lane) & 1
                    mine_at = (at[e] >> lane) & 1
                    if mine_above == 1 or (mine_at == 1 and lane_at < need):
                        self.write(
                            out,
                            out_scores,
                            block_tables,
                            token,
                            pages_per_seq,
                            lane_above + cutlass.min(lane_at, need),
                            element(start, warp, lane, e),
                            words[e],
                            error,
                            pool_pages,
                        )
                    lane_above = lane_above + mine_above
                    lane_at = lane_at + mine_at
                for j in cutlass.range_constexpr(4):  # the whole warp's load u precedes load u + 1
                    above_before = above_before + cute.arch.popc(above[4 * u + j])
                    at_before = at_before + cute.arch.popc(at[4 * u + j])
            above_done = above_done + (total & 0xFFFF)
            at_done = at_done + (total >> 16)
        for i in range(cutlass.min(n, self.k) + tid, self.k, THREADS):
            P.store_i32(out + token * self.k + i, Int32(-1))
            if self.dcp > 1:
                P.store_f32(out_scores + token * self.k + i, Float32(float("-inf")))

    def segment(self, source, start, warp, lane) -> tuple:
        """A lane's 4 x LOADS scores of its warp's segment of the chunk at `start`, as words,
        every load issued before any is used (clamped to the last vector holding a valid
        score), and whether each is a score of the row."""
        row, n, last_vector = source
        words, valids = [], []
        for u in range(LOADS):
            words += list(P.load_u32x4(row + cutlass.min(element(start, warp, lane, 4 * u), last_vector)))
            valids += [element(start, warp, lane, 4 * u + j) < n for j in range(4)]
        return words, valids

    @cute.jit
    def write(self, out, out_scores, block_tables, token, pages_per_seq, position, index, word, error, pool_pages):
        if self.dcp > 1:
            P.store_i32(out + token * self.k + position, index * self.dcp + self.rank)
            P.store_u32(out_scores + token * self.k + position, word)
        else:
            page = P.load_i32(block_tables + token * pages_per_seq + index // PAGE)
            store_slot(out + token * self.k + position, page, index, error, token, pool_pages)


@cute.jit
def store_slot(at, page, index, error, token, pool_pages):
    """The slot of local position `index` on `page` at `at`: -1 (a hole) and a record for a
    page outside [0, pool_pages)."""
    page_ok = P.in_range(page, pool_pages)
    P.store_i32(at, P.select_i32(page_ok, page * PAGE + index % PAGE, -1))
    if not page_ok:
        P.record_range(error, guards.TOP_K_PAGE, token, page)


# -- a row split over a thread-block cluster ---------------------------------------------


@dataclass(frozen=True)
class Split:
    """A row split over `ctas` CTAs of one cluster, `threads` threads each, every thread
    holding 4 x `loads` scores: a row of up to `capacity` scores. The last `stashed` of the
    loads are kept in shared memory (each thread's own 16 bytes, copied there by cp.async
    and re-read by that thread in every pass), the others in registers. listed False: no
    candidate list whatever shared memory allows (rounds 1 and 2 and the compaction over the
    slice by bit masks, as a split with no room for one)."""

    ctas: int
    threads: int
    loads: int
    stashed: int = 0
    listed: bool = True

    @property
    def held(self) -> int:
        """The loads held in registers."""
        return self.loads - self.stashed

    @property
    def per_cta(self) -> int:
        return self.threads * 4 * self.loads

    @property
    def capacity(self) -> int:
        return self.ctas * self.per_cta

    @property
    def per_sm(self) -> int:
        """CTAs an SM holds (a thread's 64 registers: one at 1024 threads, two at 512): a
        cluster needs ctas / per_sm SMs of one GPC free at once."""
        return 65536 // (64 * self.threads)

    @property
    def name(self) -> str:
        return f"c{self.ctas}x{self.threads}x{4 * self.loads}" + ("" if self.listed else "_masks")


# A device probe of ClusterTopK (bench/bench_indexer.py --top-k-trace-step; wrong outputs, times
# only): trace runs the kernel as it is, then, after a closing cluster barrier, each CTA's thread 0
# writes its marks over the row's first outputs (len(TRACE_SLOTS) words from that x its rank):
# globaltimer ns at entry and exit (2 words each), then %clock deltas from entry at the exit,
# after the PDL wait, once the slice is loaded (the start barrier), after each round's bin is
# chosen (0: the search ended before that round), after the compaction, after the candidate
# list is written, and per round once the CTA's histogram is complete and once every CTA's
# group sums have landed (hop 1). (levers.md Part K.)
PROBES = ("", "trace")
PROBE = ""
TRACE_SLOTS = ("start", "start_hi", "end", "end_hi", "clk_end", "clk_wait", "clk_loaded")
TRACE_SLOTS += tuple(f"clk_round{r}" for r in range(3)) + ("clk_compacted", "clk_listed")
TRACE_SLOTS += tuple(f"clk_hist{r}" for r in range(3)) + tuple(f"clk_groups{r}" for r in range(3))
TRACE_MARKS = len(TRACE_SLOTS) - 5  # the %clock marks kept in shared memory until the end


# Every split the host can choose (each compiled in kernels/catalog.py), smallest first.
SPLITS = (
    Split(4, 512, 1),  # rows up to 8K
    Split(8, 512, 2),  # up to 32K: 8 CTAs of 4K scores per row
    Split(4, 512, 4),  # up to 32K: 4 CTAs of 8K (2 CTAs / SM)
    Split(2, 1024, 4),  # up to 32K: 2 CTAs of 16K (64 rows in one wave)
    Split(8, 1024, 4),  # up to 128K: 8 CTAs of 16K
    Split(16, 1024, 2),  # up to 128K: 16 CTAs of 8K (a non-portable cluster size)
    Split(4, 1024, 8, 4),  # up to 128K: 4 CTAs of 32K, half of each in shared memory
    Split(4, 1024, 8, 4, listed=False),  # the same without its (partial) list: rounds 1-2 by bit masks
    Split(2, 1024, 16, 12),  # up to 128K: 2 CTAs of 64K, 3/4 of each in shared memory (one wave at B = 64)
    Split(16, 512, 4),  # up to 128K: 16 CTAs of 8K at 2 CTAs / SM
    Split(8, 512, 8, 4, listed=False),  # up to 128K: 8 CTAs of 16K at 2 CTAs / SM, half in shared memory
    Split(16, 1024, 4),  # up to 256K: 16 CTAs of 16K (a non-portable cluster size)
)
# The host's pick by row width (the block table's pages x 64: every row's length is at most
# that) and batch: per width, (the largest batch or None for every larger one, split) in
# ascending batch; a split of None would be the one-CTA-per-row TopK (no width picks it now:
# it runs only rows wider than every split). Measured on the H200 (2026-12-03, with the
# candidate list: every split in one process, on DsaIndex's scores; bench/RESULTS.md): more
# CTAs per row win while the batch leaves SMs idle; once the clusters fill the GPU, fewer
# and larger CTAs do (one wave of rows, fewer CTAs to exchange with; measured with the
# cluster-barrier exchange before K1, not swept again since). 32K: 8 CTAs of 4K to B = 8
# (7.1-7.2 us), 4 of 8K to B = 32 (9.1 at 16, 11.3 at 32), 2 of 16K above (12.3 at 64).
# 128K: 16 CTAs of 8K of 512 threads (2 per SM) to B = 4 (10.8 / 11.0 at B = 1 / 4, where 16 of
# 1024 threads took 12.0 / 12.1 in the same run, session 10). Then the bit-mask splits (no
# candidate list: rounds 1-2 and the compaction by per-thread masks, sessions 18-19): 8 CTAs of
# 16K at 512 threads (c8x512x32_masks, 2 CTAs a SM) to B = 12 (9.95 / 10.6 us at B = 8 / 12,
# where 8 of 1024 threads with a list took 11.1 / 11.2), 4 of 32K (c4x1024x32_masks) to B = 24
# (14.2 / 14.8 at B = 16 / 24; 16.0 / 16.5 with its partial list; c8x512x32_masks 14.2 / 15.3),
# c8x512x32_masks again to B = 32 (19.8 against 21.9 for 2 of 64K), 2 of 64K above (23.6 at
# B = 48). H200, bench/RESULTS.md session 19, calls B and C.
PICKS = (
    (8192, ((None, Split(4, 512, 1)),)),
    (32768, ((8, Split(8, 512, 2)), (32, Split(4, 512, 4)), (None, Split(2, 1024, 4)))),
    (
        131072,
        (
            (4, Split(16, 512, 4)),
            (12, Split(8, 512, 8, 4, listed=False)),
            (24, Split(4, 1024, 8, 4, listed=False)),
            (32, Split(8, 512, 8, 4, listed=False)),
            (None, Split(2, 1024, 16, 12)),
        ),
    ),
)


def split_for(width: int, batch: int, fits=None) -> Split | None:
    """The split TopK uses for rows of `width` scores at this batch (PICKS); None: the
    one-CTA-per-row kernel (TopK), for rows wider than every split. fits: whether a split's
    cluster can be resident on the device (None: every one, as on the H100 SXM / H200). A
    pick that does not fit gives way to the width's pick for the next larger batch that does
    (128K, B <= 4: 16 CTAs of 8K -> 8 of 16K), then to any split that holds the row and
    fits, then to the one-CTA kernel: on parts whose GPCs hold fewer SMs (an H20's, an H100
    PCIe's) a 16-CTA cluster would fail at its first launch."""
    fits = fits or (lambda split: True)
    wanted = next(
        ([s for largest, s in picks if largest is None or batch <= largest] for w, picks in PICKS if width <= w), []
    )
    held = [split for split in SPLITS if split.capacity >= width]
    return next((split for split in wanted + held if fits(split)), None)


# Shared words of the CTA's own histograms, zeroed each launch: rounds 1 and 2, the list's
# overflow flag (and 3 words of padding), then round 0's, whose words (free once round 0's
# bin is chosen) begin the candidate list.
HISTS = ((2048 + 1024 + 4, 2048), (0, 2048), (2048, 1024))  # (offset, bins) of each round
OVERFLOW = 2048 + 1024
LIST = HISTS[0][0]
ZEROED = (0, LIST + HISTS[0][1])  # [from, to)
GROUP = 32  # bins of a group: a round's bin is found as a group, then a bin of that group


def inbox(ctas: int) -> tuple:
    """The words each CTA receives in the rounds' exchanges, from every CTA of the cluster (a
    slot per source CTA, single use): per round, (offset of hop 1: each source's group sums,
    offset of hop 2: each source's bins of the chosen group); and the words in all."""
    offsets, at = [], 0
    for _, bins in HISTS:
        offsets.append((at, at + ctas * (bins // GROUP)))
        at += ctas * (bins // GROUP + GROUP)
    return tuple(offsets), at


SMEM_PER_SM = 233472  # sm_90: 228 KB, of which 1 KB per resident CTA is reserved
ROW_SLACK = 256  # bytes of alignment padding the allocator may add


def list_entries(split: Split) -> int:
    """Candidates per warp the CTA's list holds (8 bytes each: key and offset): the warp's
    own scores where shared memory allows (the list never overflows), else as many as fit
    beside the stash at the split's residency (one CTA per SM at 1024 threads, two at 512);
    0 (no list: every round and the compaction pass over the whole slice) where that is
    less than a quarter of the warp's scores, which a row's candidates would often overflow,
    or where the split is not `listed`."""
    if not split.listed:
        return 0
    warps = split.threads // 32
    groups = split.loads * warps
    fixed = (
        4 * LIST
        + 4 * (2 * groups + warps + split.per_cta // PAGE)
        + 4 * inbox(split.ctas)[1]
        + (8 * 2 + 16) * len(ROUNDS)
        + 16 * split.threads * split.stashed
        + ROW_SLACK
    )
    budget = SMEM_PER_SM // split.per_sm - 1024
    own = 128 * split.loads
    entries = min(own, (budget - fixed) // (8 * warps) // 32 * 32)
    return entries if 4 * entries >= own else 0


def store_zero4(address):
    cute.arch.inline_ptx(
        "{\n\t.reg .b32 z;\n\tmov.b32 z, 0;\n\tst.shared.v4.b32 [{$r0}], {z, z, z, z};\n\t}", read_only_args=[address]
    )


def store_entry(address, key, offset):
    """A list entry, (key, offset), at shared address `address` (8-byte aligned)."""
    cute.arch.inline_ptx("st.shared.v2.b32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[address, key, offset])


def load_hist_quad(address) -> tuple:
    """4 histogram words at shared address `address` (16-byte aligned), as the hops read them
    (primitives.ld_shared_u32x4's instruction): its own source line, so scripts/sanitize_known.txt
    can name these reads, and only these, against store_entry's list writes."""
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[address],
    )


def word_of(key) -> Uint32:
    """order_key's inverse: the fp32 bits of a key."""
    flip = Uint32(cutlass.select_((key >> Uint32(31)) == Uint32(1), Uint32(0x80000000), Uint32(0xFFFFFFFF)))
    return key ^ flip


def inclusive_scan(value, lane) -> Int32:
    for offset in (1, 2, 4, 8, 16):
        below = cute.arch.shuffle_sync_up(value, offset=offset)
        value = value + P.select_i32(lane >= offset, below, 0)
    return value


def lowest_lane(mask) -> Int32:
    """The lowest set bit of a non-zero ballot."""
    return cute.arch.popc((mask & (Int32(0) - mask)) - Int32(1))


def mark_bit(masks: list, u: int, j: int, hit):
    """Set bit 4 (u % 8) + j of mask word u // 8 (load u, word j: the bit masks' layout) where
    `hit`, with no branch."""
    bit = Uint32(1 << (4 * (u % 8) + j))
    masks[u // 8] = masks[u // 8] | Uint32(cutlass.select_(hit, bit, Uint32(0)))


def pop_lowest(pending) -> tuple:
    """(the index of the lowest set bit of the non-zero mask word `pending`, `pending` without it)."""
    low = pending & (Uint32(0) - pending)
    return Int32(cute.arch.popc(low - Uint32(1))), pending ^ low


def raw_bound(threshold) -> tuple:
    """(flip, bound): a raw fp32 word w has order_key(w) >= T exactly when (w ^ flip) >= bound
    (unsigned), with no order key made. T above +0.0's key: only w >= 0 can be, compared as
    signed ints (flip the sign bit); else every w >= 0 and -0.0 are, and a negative w where
    ~w >= T (flip every bit; +0.0's own T takes -0.0, ~w = 0x7FFFFFFF, too)."""
    flip = Uint32(cutlass.select_(threshold > Uint32(0x80000000), Uint32(0x80000000), Uint32(0xFFFFFFFF)))
    bound = threshold - Uint32(cutlass.select_(threshold == Uint32(0x80000000), Uint32(1), Uint32(0)))
    return flip, bound


def bin_test(prefix) -> tuple:
    """(scale, offset, width): every raw fp32 word w whose order key is in round 0's bin
    `prefix` (key >> 21 == prefix) has (w x scale + offset) mod 2^32 < width, and few
    others do (a superset: its users check the exact key). Bins of positive scores (prefix
    above +0.0's, 0x400): w - (the bin's lowest key ^ 2^31), where a negative w lands at
    >= 2^21. Negative scores' bins: ~lowest - w (their key is ~w); -0.0 and NaNs may pass.
    +0.0's bin, which holds -0.0 too: 2 w < 2^22, so the negative scores of the same tiny
    magnitudes pass as well. (tests/test_top_k_model.py checks it on every bin.)"""
    shift, _ = ROUNDS[0]
    lowest = prefix << Uint32(shift)
    positive, zero = prefix > Uint32(0x400), prefix == Uint32(0x400)
    scale = Uint32(cutlass.select_(positive, Uint32(1), Uint32(cutlass.select_(zero, Uint32(2), Uint32(M32)))))
    negative = Uint32(cutlass.select_(zero, Uint32(0), ~lowest))
    offset = Uint32(cutlass.select_(positive, Uint32(0x80000000) - lowest, negative))
    width = Uint32(cutlass.select_(zero, Uint32(2 << shift), Uint32(1 << shift)))
    return scale, offset, width


def nibble_counts(mask) -> list:
    """The set bits of each 4-bit nibble of `mask` (a load's 4 words), as bytes: [the even
    nibbles' counts (nibble 2m in byte m), the odd ones' (2m + 1 in byte m)]."""
    mask = mask - ((mask >> Uint32(1)) & Uint32(0x55555555))
    mask = (mask & Uint32(0x33333333)) + ((mask >> Uint32(2)) & Uint32(0x33333333))
    return [mask & Uint32(0x0F0F0F0F), (mask >> Uint32(4)) & Uint32(0x0F0F0F0F)]


def lane_scans(masks, lane) -> tuple:
    """compact's step 2 for a thread's mask words: per word pair of byte counts (nibble_counts),
    (their inclusive sums over the warp's lanes, this lane's lower lanes' sums): a warp's load
    holds at most 128 keys, so no byte carries into the next."""
    counts = []
    for mask in masks:
        counts += nibble_counts(mask)
    inclusive = [inclusive_scan(Int32(c), lane) for c in counts]
    return inclusive, [inclusive[q] - Int32(counts[q]) for q in range(len(counts))]


def store_words(address, words):
    """2 or 4 words at shared address `address` (16-byte aligned for 4)."""
    if len(words) == 4:
        P.st_shared_u32x4(address, words)
    else:
        for i, word in enumerate(words):
            P.st_shared_u32(address + 4 * i, word)


class ClusterTopK:
    """TopK's contract (see the module docstring) with a row split over a cluster of CTAs.

    CTA c of the cluster holds scores [c x per_cta, (c + 1) x per_cta) of its row in
    registers (thread t, load u: the 4 scores at 4 (threads x u + t); read once, 16-byte
    loads), so index order is (CTA, load, thread, word); a split's last `stashed` loads go
    to shared memory instead (cp.async), each thread re-reading its own 16 bytes in every
    pass. Each radix round (11 + 11 + 10 key bits, as TopK) histograms the CTA's candidates
    in shared memory (atomics), then exchanges them in two one-way hops, with no cluster
    barrier: each CTA pushes the sums of its 32-bin groups into a slot of its own in every
    CTA (16-byte `st.async`, counted on that CTA's mbarrier for the hop); warp 0 sums the
    slots and finds the group holding the need-th key, the same in every CTA, pushes its
    CTA's 32 bins of that group likewise and hands the group to its CTA's other warps
    (which wait for hop 2 meanwhile); every warp finds the bin. A hop's slots
    and mbarrier are used once (2 a round, set up before the PDL wait and published by the
    kernel's one cluster barrier), so a CTA ahead never overwrites what one behind reads,
    and each CTA waits for all it expects before it exits. From the same per-CTA counts
    each CTA also sums the lower CTAs' keys above the chosen bins and in the last one: the
    offsets of its kept keys in the row. (The pull this replaced, every CTA's bins between
    two cluster barriers, took ~1.9-2.1 us a round at 32K B = 1; the hops take ~1.3-1.5,
    most of it hop 2's find-push-land-find chain: bench/RESULTS.md session 17.)

    Only two passes read the whole slice (a pass costs each thread a few instructions per
    score it holds, which bounds the kernel). Round 0 histograms every score. The second
    pass appends every score at or above round 0's bin (each one that can be kept: a few
    thousand of a row's scores) with its offset to its warp's part of a candidate list in
    shared memory, in index order (load, lane, word). Rounds 1 and 2 histogram the list,
    and the compaction reads only the list: count the kept candidates of each (load, warp)
    group, one CTA scan of those counts, and each warp writes its kept candidates. A
    warp's part holds all its scores (the list never overflows) except where a split's
    stash leaves too little shared memory (list_entries): there, where a warp's candidates
    overflow its part (ties, equal scores), its CTA runs rounds 1 and 2 and the compaction
    over its whole slice (per-thread bit masks and one scan of per-(load, warp) counts:
    `compact`), re-reading its held loads from global memory. A split with no list
    (list_entries 0: no room for one, or Split.listed False, the splits PICKS take at 128K
    but c16x512x16) always runs them over its slice, from its registers and stash: after
    round 0 one pass marks the stashed words that may be in round 0's bin as bits
    (`bin_masks`), and rounds 1 and 2 read the held keys and only those stashed words
    (`histogram_bits`). Either way a CTA's kept scores are offset by the lower CTAs' counts
    from the rounds' exchanges. Rows of at most k scores keep every score at its own index
    (no search, no exchange)."""

    def __init__(self, k: int = 2048, dcp: int = 1, rank: int = 0, split: Split = SPLITS[1], pdl: bool = True):
        if split.ctas > 16 or split.loads > 16 or 1024 % split.threads or split.threads < 256 or split.held < 0:
            raise ValueError(f"unsupported split {split}")
        self.k, self.dcp, self.rank, self.pdl = k, dcp, rank, pdl
        self.probe = PROBE
        if self.probe not in PROBES:
            raise ValueError(f"top_k.PROBE must be one of {PROBES}, got {self.probe!r}")
        self.tracing = self.probe == "trace"
        self.ctas, self.threads, self.loads = split.ctas, split.threads, split.loads
        self.stashed, self.held = split.stashed, split.held
        self.entries = list_entries(split)
        # the list's scan packs a group's (above, at) counts in one word: a CTA's sums < 2^16
        if self.entries and split.per_cta >= 1 << 16:
            raise ValueError(f"unsupported split {split}: a listed CTA holds fewer than 2^16 scores")
        # the slice's compaction scans (keys > T) | (keys == T) << at_shift in one word: a CTA
        # has at most k keys >= T where need = ALL, fewer than k > T otherwise, per_cta == T
        self.at_shift = k.bit_length()
        if self.entries < 128 * split.loads and self.at_shift + split.per_cta.bit_length() > 31:
            raise ValueError(f"unsupported k {k} for split {split}: the compaction's counts overflow a word")

    @cute.jit
    def __call__(
        self,
        scores: cute.Pointer,
        block_tables: cute.Pointer,
        context_lens: cute.Pointer,
        out: cute.Pointer,
        out_scores: cute.Pointer,
        batch: Int32,
        pages_per_seq: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
        stream: cuda.CUstream,
    ):
        self.top_k_cluster(
            scores, block_tables, context_lens, out, out_scores, pages_per_seq, error, pool_pages
        ).launch(
            grid=[self.ctas, batch, 1],
            block=[self.threads, 1, 1],
            cluster=[self.ctas, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def top_k_cluster(
        self,
        scores: cute.Pointer,
        block_tables: cute.Pointer,
        context_lens: cute.Pointer,
        out: cute.Pointer,
        out_scores: cute.Pointer,
        pages_per_seq: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
    ):
        threads, ctas, loads = self.threads, self.ctas, self.loads
        warps = threads // 32
        per_cta = threads * 4 * loads
        tid, _, _ = cute.arch.thread_idx()
        _, token, _ = cute.arch.block_idx()
        cta = cute.arch.block_idx_in_cluster()
        lane, warp = tid % 32, tid // 32
        smem = cutlass.memory.SmemAllocator()
        list_words = max(HISTS[0][1], 2 * self.entries * warps)  # 2 words per candidate
        hists = smem.allocate_tensor(Int32, cute.make_layout(LIST + list_words), byte_alignment=16)
        counts = smem.allocate_tensor(Int32, cute.make_layout(loads * warps), byte_alignment=16)
        sizes = counts  # the list's groups' sizes, and the scan's per-warp scratch
        scratch = counts
        if cutlass.const_expr(self.entries > 0):
            sizes = smem.allocate_tensor(Int32, cute.make_layout(loads * warps), byte_alignment=16)
            scratch = smem.allocate_tensor(Int32, cute.make_layout(warps), byte_alignment=16)
        received = smem.allocate_tensor(Int32, cute.make_layout(inbox(ctas)[1]), byte_alignment=16)
        # the exchanges' mbarriers (2 a round), then each round's chosen group and the count
        # above it (16 bytes a round), which warp 0 hands to the other warps
        bars = smem.allocate_tensor(Int64, cute.make_layout(4 * len(ROUNDS)), byte_alignment=16).iterator.toint()
        pages = smem.allocate_tensor(Int32, cute.make_layout(per_cta // PAGE), byte_alignment=16)
        stash = Int32(0)
        if cutlass.const_expr(self.stashed > 0):
            stash = smem.allocate_tensor(
                Int32, cute.make_layout(4 * threads * self.stashed), byte_alignment=16
            ).iterator.toint()
        base_address = hists.iterator.toint()
        exchange = (received.iterator.toint(), bars)
        clock0, start, marks = Int32(0), Int64(0), Int32(0)
        if cutlass.const_expr(self.tracing):
            clock0, start = cute.arch.clock(), P.globaltimer()
            marks = smem.allocate_tensor(Int32, cute.make_layout(TRACE_MARKS), byte_alignment=16).iterator.toint()
            if tid < TRACE_MARKS:
                P.st_shared_u32(marks + 4 * tid, Uint32(0))  # a round not run stays 0
        # Before the PDL wait (no global reads): zero this CTA's histograms and the overflow
        # flag, and set up the exchanges' mbarriers (one a round and hop, single use), each
        # expecting every CTA's bytes. The cluster barrier this arrives on, waited on below
        # before the first histogram atomics, orders the zeroing before this CTA's atomics
        # and the mbarriers before any CTA's push: it is the kernel's only cluster barrier.
        for i in range(tid, (ZEROED[1] - ZEROED[0]) // 4, threads):
            store_zero4(base_address + 4 * ZEROED[0] + 16 * i)
        for r in cutlass.range_constexpr(len(ROUNDS)):
            for hop in cutlass.range_constexpr(2):
                if tid == 2 * r + hop:  # hop 2's also waits for warp 0's arrival (its group written)
                    P.mbar_init(bars + 8 * (2 * r + hop), 1 + hop)
                    P.mbar_expect(bars + 8 * (2 * r + hop), Int32(self.hop_bytes(r, hop)))
                    P.mbar_init_fence()
        cute.arch.cluster_arrive(aligned=True)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        self.mark(marks, "clk_wait", clock0, tid)

        # The slice's scores up to the row's width and its block table entries, loaded
        # alongside the length (not after it: one global latency, not two).
        length = P.load_i32(context_lens + token)
        width = pages_per_seq * PAGE
        base = cta * per_cta  # this CTA's first index
        row = scores + token * width + base
        in_row = width - base - 4 * tid  # this thread's element at offset o (4 threads u + j) is < width if o < in_row
        for u in cutlass.range_constexpr(self.held, loads):  # the stashed loads: global -> shared
            at = stash + 16 * (threads * (u - self.held) + tid)
            P.cp_async_16(at, row + 4 * (threads * u + tid), 4 * threads * u < in_row)
        if cutlass.const_expr(self.stashed > 0):
            P.cp_async_commit()
        words = []
        for u in cutlass.range_constexpr(self.held):
            words += list(P.load_u32x4_if(row + 4 * (threads * u + tid), 4 * threads * u < in_row))
        if cutlass.const_expr(self.dcp == 1):  # for the slots
            for p in range(tid, per_cta // PAGE, threads):
                if base + PAGE * p < width:
                    pages[p] = P.load_i32(block_tables + token * pages_per_seq + base // PAGE + p)
        n = cutlass.min(cutlass.max((length - self.rank + self.dcp - 1) // self.dcp, 0), width)
        limit = n - base - 4 * tid  # ... and valid (a score of the row) if o < limit
        keys = [order_key(w) for w in words]
        if cutlass.const_expr(self.stashed > 0):
            P.cp_async_wait(0)  # this thread's stashed scores (read back by this thread only)
        cute.arch.cluster_wait()
        self.mark(marks, "clk_loaded", clock0, tid)

        if n > self.k:
            # where the list overflows, the later passes re-read the held loads from global
            # memory (rare: so the keys need not stay in registers past the list's pass)
            again = (row, in_row)
            threshold, need, listed, fill, lower = self.find_threshold(
                keys,
                again,
                stash,
                limit,
                hists,
                counts,
                sizes,
                base_address,
                exchange,
                tid,
                lane,
                warp,
                cta,
                (marks, clock0),
            )
            out_args = (out, out_scores, pages, token, base, error, pool_pages)
            list_args = (base_address, threshold, need, counts, sizes, scratch, lower, fill, out_args)
            if cutlass.const_expr(self.entries == 0):
                self.compact(
                    keys, again, stash, limit, threshold, need, counts, hists, lower, out_args, tid, lane, warp
                )
            elif cutlass.const_expr(self.entries == 128 * loads):  # the list holds every candidate
                self.compact_list(*list_args, tid, lane, warp)
            else:
                if listed:
                    self.compact_list(*list_args, tid, lane, warp)
                else:
                    self.compact(
                        again, again, stash, limit, threshold, need, counts, hists, lower, out_args, tid, lane, warp
                    )
        else:  # every score is kept, at its own index
            cute.arch.sync_threads()  # the block table entries
            for u in cutlass.range_constexpr(loads):
                quad = self.quad(keys, stash, u, tid)
                for j in cutlass.range_constexpr(4):
                    offset = 4 * (threads * u + tid) + j
                    if 4 * threads * u + j < limit:
                        self.write(
                            out,
                            out_scores,
                            pages,
                            token,
                            base + offset,
                            base + offset,
                            offset,
                            quad[j],
                            error,
                            pool_pages,
                        )
            # the padding (only a row of fewer than k scores has any: here, so that n is not
            # live through the search, where it cost c2x1024x64 with DCP a spill)
            for i in range(n + cta * threads + tid, self.k, ctas * threads):
                P.store_i32(out + token * self.k + i, Int32(-1))
                if cutlass.const_expr(self.dcp > 1):
                    P.store_f32(out_scores + token * self.k + i, Float32(float("-inf")))
        self.mark(marks, "clk_compacted", clock0, tid)
        if cutlass.const_expr(self.tracing):
            finished, ended = cute.arch.clock() - clock0, P.globaltimer()
            cute.arch.cluster_arrive(aligned=True)  # every CTA's outputs are stored: the marks go over them
            cute.arch.cluster_wait()
            if tid == 0:
                trace_at = out + token * self.k + len(TRACE_SLOTS) * cta
                for i, time_word in enumerate((start, start >> 32, ended, ended >> 32)):
                    P.store_i32(trace_at + i, Int32(time_word))
                P.store_i32(trace_at + 4, finished)
                for i in cutlass.range_constexpr(TRACE_MARKS):
                    P.store_i32(trace_at + 5 + i, P.ld_shared_i32(marks + 4 * i))

    @cute.jit
    def mark(self, marks, slot: str, clock0, tid):
        """The trace probe: thread 0's %clock delta from entry into the shared mark `slot`."""
        if cutlass.const_expr(self.tracing):
            if tid == 0:
                P.st_shared_u32(marks + 4 * (TRACE_SLOTS.index(slot) - 5), Uint32(cute.arch.clock() - clock0))

    @cute.jit
    def find_threshold(
        self, keys, again, stash, limit, hists, counts, sizes, base_address, exchange, tid, lane, warp, cta, trace
    ):
        """(T, need, listed, fill, lower) over the cluster's row: the k best are every key > T
        and the first `need` keys == T (need = ALL: every one); listed: whether the candidate
        list holds every key >= round 0's bin (this CTA's), and fill this warp's count of
        them; lower: the lower CTAs' (keys > T, keys == T), summed from the exchanges (where
        need = ALL, only their sum, the keys >= T, matters). The row has more than k scores.
        trace: (marks, clock0) of the trace probe."""
        threshold, need = Uint32(0), Int32(self.k)
        prefix, done = Uint32(0), Int32(0)
        lower_above, lower_in = Int32(0), Int32(0)
        self.histogram(keys, stash, limit, hists, 0, prefix, tid)
        threshold, need, prefix, done, lower_above, lower_in = self.choose_bin(
            0, base_address, exchange, threshold, need, prefix, done, lower_above, tid, lane, warp, cta, trace
        )
        self.mark(trace[0], "clk_round0", trace[1], tid)
        listed, fill = cutlass.Boolean(False), Int32(0)
        if cutlass.const_expr(self.entries > 0):
            # round 0's histogram becomes the list: this CTA's reads of it (the hops' pushes,
            # load_hist_quad) came before, through hop 2's mbarrier (push_group_bins).
            # compute-sanitizer's racecheck reports them against the list writes; a CTA barrier here
            # leaves the report, a cluster barrier clears it (its view of a cluster's shared memory,
            # by that A/B; bench/RESULTS.md session 28), so it is listed in scripts/sanitize_known.txt
            fill = self.collect(keys, stash, limit, counts, sizes, base_address, threshold, tid, lane, warp)
            cute.arch.sync_threads()  # the list and its overflow flag
            listed = hists[OVERFLOW] == 0
            self.mark(trace[0], "clk_listed", trace[1], tid)
        near0, near1 = Uint32(0), Uint32(0)  # no list: round 0's bin as bits of the stash (bin_masks)
        for r in cutlass.range_constexpr(1, len(ROUNDS)):
            if done == 0:
                if cutlass.const_expr(self.entries == 0):
                    if cutlass.const_expr(r == 1):
                        near0, near1 = self.bin_masks(stash, limit, prefix, tid)
                    self.histogram_bits(keys, stash, limit, hists, r, prefix, (near0, near1), tid)
                elif cutlass.const_expr(self.entries == 128 * self.loads):  # the list holds every candidate
                    self.histogram_list(hists, base_address, r, prefix, fill, lane, warp)
                else:
                    if listed:
                        self.histogram_list(hists, base_address, r, prefix, fill, lane, warp)
                    else:
                        self.histogram(again, stash, limit, hists, r, prefix, tid)
                threshold, need, prefix, done, lower_above, lower_in = self.choose_bin(
                    r, base_address, exchange, threshold, need, prefix, done, lower_above, tid, lane, warp, cta, trace
                )
                self.mark(trace[0], f"clk_round{r}", trace[1], tid)
        return threshold, need, listed, fill, (lower_above, lower_in)

    @cute.jit
    def histogram(self, keys, stash, limit, hists, r: int, prefix, tid):
        """This CTA's histogram of round r over its whole slice: the keys that share the
        higher rounds' digits `prefix`."""
        shift, bits = ROUNDS[r]
        hist = HISTS[r][0]
        for u in cutlass.range_constexpr(self.loads):
            quad = self.quad(keys, stash, u, tid)
            for j in cutlass.range_constexpr(4):
                key = quad[j]
                live = 4 * self.threads * u + j < limit
                digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                if cutlass.const_expr(r > 0):
                    live = live and (key >> Uint32(shift + bits)) == prefix
                if live:
                    cute.arch.atomic_add(hists.iterator + hist + digit, Int32(1))

    @cute.jit
    def bin_masks(self, stash, limit, prefix, tid) -> tuple:
        """The stashed words that may be in round 0's bin `prefix` (a superset of those that
        are) as bits, in compact's layout (bit 4 (u % 8) + j of word u // 8 for load u, word
        j; the held loads' bits 0), ANDed with `valid_masks`: two words (the second 0 where
        one holds every load). Rounds 1 and 2 then read only these words (histogram_bits),
        checking each one's exact key. A raw word w is tested with no order key
        (`bin_test`): one multiply-add and one compare, no branch."""
        threads, loads = self.threads, self.loads
        scale, offset, width = bin_test(prefix)
        near = [Uint32(0), Uint32(0)]
        for u in cutlass.range_constexpr(self.held, loads):
            quad = P.ld_shared_u32x4(stash + 16 * (threads * (u - self.held) + tid))
            for j in cutlass.range_constexpr(4):
                hit = quad[j] * scale + offset < width
                mark_bit(near, u, j, hit)
        valid = self.valid_masks(limit)
        for i in cutlass.range_constexpr((4 * loads + 31) // 32):
            near[i] = near[i] & valid[i]
        return near[0], near[1]

    @cute.jit
    def histogram_bits(self, keys, stash, limit, hists, r: int, prefix, near, tid):
        """This CTA's histogram of round r (1 or 2) over its whole slice, no list: the held
        keys (registers) each tested, the stashed ones only
        at the set bits of `near` (bin_masks: round 0's bin), lowest first, a stash word
        read for each (the warp loops as often as its busiest lane). Same counts as
        `histogram`: the keys that share the higher rounds' digits `prefix`.

        Issue estimate, c2x1024x64 (SASS: CuTe DSL 4.8.1, nvdisasm 13; not yet measured), a
        warp: `histogram` took ~9 instructions a word where no lane hits (the order key of a
        stashed word, the prefix test, a branch and its reconvergence), +3 where one does:
        ~660 a round. Now round 1: bin_masks ~205 (12 LDS.128; a word: IMAD, ISETP, SEL and
        half an IADD3), the held keys ~100, the loops ~22 an iteration x ~4 (the busiest
        lane's ~0.75 stashed words in the bin a thread, where the bin holds ~1 a thread):
        ~440; round 2: ~220."""
        shift, bits = ROUNDS[r]
        threads = self.threads
        hist = HISTS[r][0]
        for u in cutlass.range_constexpr(self.held):
            for j in cutlass.range_constexpr(4):
                key = keys[4 * u + j]
                live = 4 * threads * u + j < limit and (key >> Uint32(shift + bits)) == prefix
                digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                if live:
                    cute.arch.atomic_add(hists.iterator + hist + digit, Int32(1))
        for i in cutlass.range_constexpr((4 * self.loads + 31) // 32):
            pending = near[i]
            while pending != Uint32(0):
                b, pending = pop_lowest(pending)
                u = 8 * i + (b >> 2)
                word = P.ld_shared_i32(stash + 16 * (threads * (u - self.held) + tid) + 4 * (b & 3))
                key = order_key(Uint32(word))
                if (key >> Uint32(shift + bits)) == prefix:
                    digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                    cute.arch.atomic_add(hists.iterator + hist + digit, Int32(1))

    @cute.jit
    def histogram_list(self, hists, base_address, r: int, prefix, fill, lane, warp):
        """This CTA's histogram of round r over its candidate list (each warp its own part)."""
        shift, bits = ROUNDS[r]
        hist = HISTS[r][0]
        first = LIST + 2 * self.entries * warp
        for i in range(lane, fill, 32):
            key, _ = P.ld_shared_u32x2(base_address + 4 * (first + 2 * i))
            if (key >> Uint32(shift + bits)) == prefix:
                digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                cute.arch.atomic_add(hists.iterator + hist + digit, Int32(1))

    def hop_bytes(self, r: int, hop: int) -> int:
        """The bytes a CTA receives in round r's hop: every CTA's group sums, then every CTA's
        bins of the chosen group."""
        return 4 * self.ctas * (HISTS[r][1] // GROUP if hop == 0 else GROUP)

    @cute.jit
    def choose_bin(
        self, r: int, base_address, exchange, threshold, need, prefix, done, lower_above, tid, lane, warp, cta, trace
    ):
        """Round r's exchange, in two one-way hops with no cluster barrier: each CTA pushes
        its histogram's group sums into every CTA (hop 1); warp 0 alone sums them over the
        CTAs, finds the group holding the need-th key (the same in every CTA), pushes its
        CTA's bins of that group into every CTA (hop 2) and hands the group to the other
        warps through shared memory and its arrival on hop 2's mbarrier (they wait there,
        leaving warp 0's scheduler to it); every warp finds the bin.
        Each hop lands in its own slots and completes its own mbarrier, so a CTA ahead never
        overwrites what a CTA behind still reads. The lower CTAs' counts above the chosen
        bin are added to lower_above. -> (threshold, need, prefix, done, lower_above, the
        lower CTAs' count in the bin). trace: (marks, clock0) of the trace probe."""
        shift, bits = ROUNDS[r]
        hist, bins = HISTS[r]
        groups = bins // GROUP
        received, bars = exchange
        hop1, hop2 = inbox(self.ctas)[0][r]
        cute.arch.sync_threads()  # this CTA's histogram of the round is complete
        self.mark(trace[0], f"clk_hist{r}", trace[1], tid)
        self.push_group_sums(
            base_address + 4 * hist, bins, received + 4 * (hop1 + groups * cta), bars + 16 * r, tid, lane
        )
        chosen_at = bars + 16 * (len(ROUNDS) + r)
        if warp == 0:
            P.mbar_wait(bars + 16 * r, 0, cluster=True)
            self.mark(trace[0], f"clk_groups{r}", trace[1], tid)
            group, above = self.find_group(received + 4 * hop1, groups, need, lane)
            self.push_group_bins(
                base_address + 4 * (hist + GROUP * group), received + 4 * (hop2 + GROUP * cta), bars + 16 * r + 8, lane
            )
            if lane == 0:
                P.st_shared_u32(chosen_at, Uint32(group))
                P.st_shared_u32(chosen_at + 4, Uint32(above))
                P.mbar_arrive(bars + 16 * r + 8)  # release: the other warps' wait acquires the words
        P.mbar_wait(bars + 16 * r + 8, 0, cluster=True)
        chosen = P.ld_shared_u32x2(chosen_at)
        group, above = Int32(chosen[0]), Int32(chosen[1])
        bin_in_group, above, count, lower_bins, lower_in = self.find_in_group(
            received + 4 * hop2, above, need, lane, cta
        )
        prefix = (prefix << Uint32(bits)) | Uint32(GROUP * group + bin_in_group)
        need = need - above
        threshold = prefix << Uint32(shift)
        if count == need:  # the bin is taken whole: every key >= its lowest
            need = Int32(ALL)
            done = Int32(1)
        lower_groups = self.lower_above_group(received + 4 * hop1, groups, group, lane, cta)
        lower_above = lower_above + lower_groups + P.warp_sum_i32(lower_bins)
        return threshold, need, prefix, done, lower_above, lower_in

    @cute.jit
    def push_group_sums(self, hist_address, bins: int, slot, bar, tid, lane):
        """Hop 1: this CTA's sum of each 32-bin group of its histogram at `hist_address`,
        pushed into `slot` (its own, the same address in every CTA) of every CTA: a thread
        sums 4 bins, 8 lanes a group, and lane d of each warp pushes the warp's 4 group sums
        (16 bytes) to CTA d."""
        quads = bins // 4  # a multiple of 32: whole warps
        for p in cutlass.range_constexpr((quads + self.threads - 1) // self.threads):
            quad = tid + self.threads * p
            if quad - lane < quads:
                words = load_hist_quad(hist_address + 16 * quad)
                total = Int32(words[0]) + Int32(words[1]) + Int32(words[2]) + Int32(words[3])
                for offset in (1, 2, 4):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
                sums = [cute.arch.shuffle_sync(total, offset=8 * i) for i in range(4)]
                if lane < self.ctas:
                    P.dsmem_push_u32x4(slot + 4 * ((quad - lane) // 8), lane, sums, bar)

    @cute.jit
    def push_group_bins(self, bins_address, slot, bar, lane):
        """Hop 2 (one warp): this CTA's 32 bins at `bins_address` (the chosen group) pushed
        into `slot` of every CTA: lane l sends quad l % 8 to CTAs l / 8, l / 8 + 4, ...
        Round 0's histogram becomes the candidate list once every warp has passed hop 2,
        which needs this CTA's own push, so the warp's loads are done before it is rewritten
        (the sync_warp makes that formal for the lanes that push only to other CTAs)."""
        quad = lane % 8
        words = load_hist_quad(bins_address + 16 * quad)
        cute.arch.sync_warp()
        for p in cutlass.range_constexpr((8 * self.ctas + 31) // 32):
            if lane // 8 + 4 * p < self.ctas:
                P.dsmem_push_u32x4(slot + 16 * quad, lane // 8 + 4 * p, words, bar)

    @cute.jit
    def find_group(self, received, groups: int, need, lane):
        """(the group holding the need-th highest key, the count above that group) from every
        CTA's group sums at `received` (a warp on its own). Lanes take groups in descending
        order (two each of 64)."""
        high, low = Int32(0), Int32(0)
        for c in cutlass.range_constexpr(self.ctas):  # every load issued before the sums need them
            if cutlass.const_expr(groups == 64):
                pair = P.ld_shared_u32x2(received + 4 * (64 * c + 62 - 2 * lane))
                low, high = low + Int32(pair[0]), high + Int32(pair[1])
            else:
                high = high + P.ld_shared_i32(received + 4 * (32 * c + 31 - lane))
        own = high + low
        inclusive = inclusive_scan(own, lane)
        chosen = lowest_lane(cute.arch.vote_ballot_sync(inclusive >= need))
        above = cute.arch.shuffle_sync(inclusive - own, offset=chosen)
        group = groups - 1 - chosen
        if cutlass.const_expr(groups == 64):
            chosen_high = cute.arch.shuffle_sync(high, offset=chosen)
            group = 63 - 2 * chosen
            if above + chosen_high < need:
                group = group - 1
                above = above + chosen_high
        return group, above

    @cute.jit
    def lower_above_group(self, received, groups: int, group, lane, cta):
        """The lower CTAs' (rank < cta) count above `group`, from their group sums at
        `received` (every warp, after hop 2 has landed: off warp 0's path to its push)."""
        lower = Int32(0)
        for c in cutlass.range_constexpr(self.ctas - 1):  # c < cta
            if c < cta:
                if cutlass.const_expr(groups == 64):
                    pair = P.ld_shared_u32x2(received + 4 * (64 * c + 62 - 2 * lane))
                    lower = lower + P.select_i32(62 - 2 * lane > group, Int32(pair[0]), 0)
                    lower = lower + P.select_i32(63 - 2 * lane > group, Int32(pair[1]), 0)
                else:
                    word = P.ld_shared_i32(received + 4 * (32 * c + 31 - lane))
                    lower = lower + P.select_i32(31 - lane > group, word, 0)
        return P.warp_sum_i32(lower)

    @cute.jit
    def collect(self, keys, stash, limit, counts, sizes, base_address, low, tid, lane, warp):
        """The second pass over the slice: every key >= `low` (round 0's bin's lowest: the
        keys that can be kept) and its offset go to this warp's part of the list, in index
        order (load, lane, word), each load's group counted in `sizes`. A warp whose
        candidates exceed its part stops writing them and sets the CTA's overflow flag.
        -> this warp's count of candidates."""
        threads, warps = self.threads, self.threads // 32
        first = LIST + 2 * self.entries * warp
        lower_lanes = (Int32(1) << lane) - Int32(1)
        fill = Int32(0)
        for u in cutlass.range_constexpr(self.loads):
            quad = self.quad(keys, stash, u, tid)
            taken = []
            for j in cutlass.range_constexpr(4):
                taken.append(cute.arch.vote_ballot_sync(4 * threads * u + j < limit and quad[j] >= low))
            total = cute.arch.popc(taken[0])
            place = fill + cute.arch.popc(taken[0] & lower_lanes)
            for j in cutlass.range_constexpr(1, 4):
                total = total + cute.arch.popc(taken[j])
                place = place + cute.arch.popc(taken[j] & lower_lanes)
            if fill + total <= self.entries:
                for j in cutlass.range_constexpr(4):
                    if (taken[j] >> lane) & 1 == 1:
                        store_entry(base_address + 4 * (first + 2 * place), quad[j], 4 * (threads * u + tid) + j)
                        place = place + 1
            if lane == 0:
                sizes[u * warps + warp] = total
                counts[u * warps + warp] = 0
            fill = fill + total
        if lane == 0 and fill > self.entries:
            P.st_shared_u32(base_address + 4 * OVERFLOW, Uint32(1))
        return fill

    def quad(self, keys, stash, u: int, tid) -> list:
        """The 4 keys of this thread's load u: registers (keys: a list), or its 16 bytes of
        the stash; keys (row, in_row): the held loads read again from global memory."""
        if u < self.held:
            if isinstance(keys, list):
                return keys[4 * u : 4 * u + 4]
            row, in_row = keys
            live = 4 * self.threads * u < in_row
            return [order_key(w) for w in P.load_u32x4_if(row + 4 * (self.threads * u + tid), live)]
        return [order_key(w) for w in P.ld_shared_u32x4(stash + 16 * (self.threads * (u - self.held) + tid))]

    @cute.jit
    def find_in_group(self, received, above, need, lane, cta):
        """(the chosen group's bin holding the need-th highest key, the count above that bin,
        its count, this lane's part of the lower CTAs' count above it in the group, theirs
        in it) from every CTA's bins of the group at `received`, given the count `above` the
        group (a warp on its own). Lane l takes bin 31 - l."""
        count, lower = Int32(0), Int32(0)
        for c in cutlass.range_constexpr(self.ctas):
            word = P.ld_shared_i32(received + 4 * (GROUP * c + GROUP - 1 - lane))
            count = count + word
            lower = lower + P.select_i32(c < cta, word, 0)
        inclusive = inclusive_scan(count, lane)
        chosen = lowest_lane(cute.arch.vote_ballot_sync(above + inclusive >= need))
        above = above + cute.arch.shuffle_sync(inclusive - count, offset=chosen)
        return (
            GROUP - 1 - chosen,
            above,
            cute.arch.shuffle_sync(count, offset=chosen),
            P.select_i32(lane < chosen, lower, 0),
            cute.arch.shuffle_sync(lower, offset=chosen),
        )

    @cute.jit
    def compact_list(
        self,
        base_address,
        threshold,
        need,
        counts,
        sizes,
        scratch,
        lower,
        fill,
        out_args,
        tid,
        lane,
        warp,
    ):
        """Write the kept candidates of the list at their places: (kept keys > T before them
        in the row) + min(kept keys == T before them, need). A group's candidates (one
        load of one warp) are in index order, and the groups' counts are scanned in index
        order (load, warp)."""
        threads, loads = self.threads, self.loads
        warps = threads // 32
        groups = loads * warps
        first = LIST + 2 * self.entries * warp
        # each kept candidate counted in its group (its offset / 128: load x warps + warp)
        for i in range(lane, fill, 32):
            key, offset = P.ld_shared_u32x2(base_address + 4 * (first + 2 * i))
            if key >= threshold:
                cute.arch.atomic_add(
                    counts.iterator + Int32(offset >> Uint32(7)), P.select_i32(key == threshold, 1 << 16, 1)
                )
        cute.arch.sync_threads()
        # the groups' counts before each (above | at << 16: each sum below 2^16), and the CTA's
        count = P.select_i32(tid < groups, counts[cutlass.min(tid, groups - 1)], 0)
        before = P.block_exclusive_sum(count, scratch, lane, warp, warps)
        if tid < groups:
            counts[tid] = before
        cute.arch.sync_threads()
        above_before, at_before = lower  # the lower CTAs' keys > T and == T (find_threshold)

        lower_lanes = (Int32(1) << lane) - Int32(1)
        start = Int32(0)
        for u in cutlass.range_constexpr(loads):
            size = sizes[u * warps + warp]
            before = counts[u * warps + warp]
            lane_above = above_before + (before & 0xFFFF)
            lane_at = at_before + (before >> 16)
            for c in range(0, size, 32):
                live = c + lane < size
                i = start + cutlass.min(c + lane, size - 1)
                key, offset = P.ld_shared_u32x2(base_address + 4 * (first + 2 * i))
                above = cute.arch.vote_ballot_sync(live and key > threshold)
                at = cute.arch.vote_ballot_sync(live and key == threshold)
                mine_at = lane_at + cute.arch.popc(at & lower_lanes)
                if (above >> lane) & 1 == 1 or ((at >> lane) & 1 == 1 and mine_at < need):
                    self.place(
                        out_args,
                        lane_above + cute.arch.popc(above & lower_lanes) + cutlass.min(mine_at, need),
                        Int32(offset),
                        key,
                    )
                lane_above = lane_above + cute.arch.popc(above)
                lane_at = lane_at + cute.arch.popc(at)
            start = start + size

    @cute.jit
    def compact(self, keys, again, stash, limit, threshold, need, counts, hists, lower, out_args, tid, lane, warp):
        """Write the kept scores of this CTA at their places: (kept keys > T before them in
        the row) + min(kept keys == T before them, need), from its whole slice (no list),
        with a thread's kept scores as bits (no ballot or branch per score):

        1. One pass over the slice sets bit 4 (u % 8) + j of mask word u // 8 for each of the
           thread's keys >= T (load u, word j; stashed and re-read words compared raw,
           `raw_bound`), ANDed with `valid_masks` (the scores below `limit`). Only where T's
           keys are split (need < ALL) a second pass marks those == T (E); A = (>= T) & ~E.
           With need = ALL every key >= T is an A (and the lower CTAs' two counts one sum).
        2. The set bits of each nibble (a load's 4 words) as bytes, 4 loads a word (a SWAR
           popcount), scanned over the warp's lanes with one 5-shuffle scan a word (a warp's
           load holds at most 128 keys: no carry between bytes); lane 31 stores the warp's
           totals, then a CTA barrier.
        3. Thread u x warps + w takes warp w's totals of load u, A | E << at_shift, and one
           block scan in index order (load, warp) gives each group the keys before it; each
           group's result goes to shared memory (round 1's histogram words, free by now).
        4. Each thread visits only its set bits, lowest first (a loop a mask word, which the
           warp runs as often as its busiest lane: ~2.4 times a word at ~1 kept score a
           thread): place = lower CTAs + the group's before + the lanes' before (byte u) +
           its own bits before in the nibble; a key == T is kept while that count is < need.

        Issue estimate, c2x1024x64 (64 scores a thread, 12 of 16 loads stashed; 32 warps on
        4 schedulers), from the SASS (ptxas via CuTe DSL 4.8.1, nvdisasm 13) at ~1,000 kept
        scores a CTA, need = ALL; the us are not yet measured. Before (ballots): per (load,
        warp) ~62 instructions to count (8 ballots, 8 POPC), ~122 to rank (8 ballots, 8
        POPC, a 7-shuffle scan, the stash re-read and order keys, a branch per score) and
        ~22 more for each of the 4 words where any lane keeps one (~40%): ~3,500 a warp,
        112K an SM, 256 POPC a warp: ~28K issue cycles a scheduler, 14 us at 1.98 GHz at
        one instruction a cycle (traced 29.2 us: ~0.5 IPC, dependent ballot/POPC/shuffle
        chains). Now: pass 1 ~262 a warp, step 2 ~87 (20 shuffles), step 3 ~86 (4 CTA
        barriers), step 4 ~55 an iteration x ~4.75 ~260: ~700 a warp (5x fewer), ~14 POPC;
        at the same IPC ~5.6K issue cycles, ~3-6 us. Where T's keys are split, + ~360 (the
        second pass) + ~87 (its scan) and a longer loop where many keys equal T."""
        threads, loads = self.threads, self.loads
        warps = threads // 32
        words = (4 * loads + 31) // 32  # mask words: loads 8i .. 8i + 7 in word i
        counted = 2 * words  # byte-count words: (even loads, odd loads) of each mask word
        table_a = hists.iterator.toint()  # per warp, its totals (a byte a load) of keys > T ...
        table_e = table_a + 4 * warps * counted  # ... and of keys == T
        bases = 2 * warps * counted  # hists[bases + warp x loads + u]: the groups before (u, warp)
        ties = need != Int32(ALL)  # T's keys are split: those == T counted apart
        above_lower, at_lower = lower  # the lower CTAs' keys > T and == T (find_threshold)
        above_lower = above_lower + P.select_i32(ties, 0, at_lower)  # need = ALL: one count
        at_lower = P.select_i32(ties, at_lower, 0)

        # 1. a pass over the slice: the keys >= T as bits, then (ties only) those == T
        valid = self.valid_masks(limit)
        flip, bound = raw_bound(threshold)
        at_least = [Uint32(0)] * words
        for u in cutlass.range_constexpr(loads):
            quad, keyed = self.raw_quad(keys, stash, u, tid)
            for j in cutlass.range_constexpr(4):
                hit = quad[j] >= threshold if keyed else (quad[j] ^ flip) >= bound
                mark_bit(at_least, u, j, hit)
        at_least = [at_least[i] & valid[i] for i in range(words)]
        equal0, equal1 = Uint32(0), Uint32(0)
        if ties:
            equal0, equal1 = self.equal_masks(keys, stash, threshold, valid, tid)
        equal = [equal0, equal1][:words]
        above = [at_least[i] & ~equal[i] for i in range(words)]

        # 2. per-load counts (a byte each), scanned over the warp's lanes
        above_inclusive, above_lanes = lane_scans(above, lane)
        at0, at1, at2, at3 = Int32(0), Int32(0), Int32(0), Int32(0)
        if ties:
            at0, at1, at2, at3 = self.scan_equal(equal, table_e, lane, warp)
        at_lanes = [at0, at1, at2, at3][:counted]
        if lane == 31:
            store_words(table_a + 4 * counted * warp, above_inclusive)
        cute.arch.sync_threads()

        # 3. one scan of the (load, warp) groups' counts in index order (above | at << at_shift)
        group = Int32(0)
        if tid < loads * warps:
            u, w = tid // warps, tid % warps
            q = 2 * (u // 8) + u % 2
            shift = 8 * ((u % 8) // 2)
            group = (P.ld_shared_i32(table_a + 4 * (counted * w + q)) >> shift) & 0xFF
            if ties:
                group = group | (((P.ld_shared_i32(table_e + 4 * (counted * w + q)) >> shift) & 0xFF) << self.at_shift)
        before = P.block_exclusive_sum(group, counts, lane, warp, warps)
        if tid < loads * warps:
            hists[bases + (tid % warps) * loads + tid // warps] = before
        cute.arch.sync_threads()

        # 4. each thread's set bits, lowest first, at their places
        for i in cutlass.range_constexpr(words):
            pending = at_least[i] | equal[i]
            while pending != Uint32(0):
                b, pending = pop_lowest(pending)
                u = 8 * i + (b >> 2)
                j = b & 3
                nibble = Uint32(b & ~3)
                earlier = (Uint32(1) << Uint32(j)) - Uint32(1)
                byte = 8 * (b >> 3)
                odd = ((b >> 2) & 1) == 1
                group = hists[bases + warp * loads + u]
                above_before = (
                    above_lower
                    + (group & ((1 << self.at_shift) - 1))
                    + Int32(cute.arch.popc((above[i] >> nibble) & earlier))
                )
                lanes = P.select_i32(odd, above_lanes[2 * i + 1], above_lanes[2 * i])
                above_before = above_before + ((lanes >> byte) & 0xFF)
                at_before = at_lower + (group >> self.at_shift) + Int32(cute.arch.popc((equal[i] >> nibble) & earlier))
                lanes = P.select_i32(odd, at_lanes[2 * i + 1], at_lanes[2 * i])
                at_before = at_before + ((lanes >> byte) & 0xFF)
                if ((above[i] >> Uint32(b)) & Uint32(1)) == Uint32(1) or at_before < need:
                    offset = 4 * (threads * u + tid) + j
                    key = self.key_at(again, stash, u, offset, tid)
                    self.place(out_args, above_before + cutlass.min(at_before, need), offset, key)

    def valid_masks(self, limit) -> list:
        """The mask words of this thread's valid scores (offset 4 (threads u + tid) + j <
        that + limit): a prefix of the bits, as the loads' valid counts never grow with u."""
        threads, loads = self.threads, self.loads
        full = cutlass.min(cutlass.max(limit - 1, 0) // (4 * threads), loads)  # the loads before the last valid one
        count = P.select_i32(full >= loads, 4 * loads, 4 * full + cutlass.min(limit - 4 * threads * full, 4))
        count = cutlass.max(count, 0)
        masks = []
        for i in range((4 * loads + 31) // 32):
            bits = cutlass.min(cutlass.max(count - 32 * i, 0), 32)
            part = (Uint32(1) << Uint32(cutlass.min(bits, 31))) - Uint32(1)
            masks.append(Uint32(cutlass.select_(bits >= 32, Uint32(0xFFFFFFFF), part)))
        return masks

    def raw_quad(self, keys, stash, u: int, tid) -> tuple:
        """(the 4 words of this thread's load u, whether they are order keys): the held
        loads' keys from registers (keys: a list) or their raw words read again from
        global memory (keys: (row, in_row)); the stashed loads' raw words."""
        if u < self.held:
            if isinstance(keys, list):
                return keys[4 * u : 4 * u + 4], True
            row, in_row = keys
            live = 4 * self.threads * u < in_row
            return list(P.load_u32x4_if(row + 4 * (self.threads * u + tid), live)), False
        return list(P.ld_shared_u32x4(stash + 16 * (self.threads * (u - self.held) + tid))), False

    def equal_masks(self, keys, stash, threshold, valid, tid) -> tuple:
        """The mask words (two, the second 0 where one holds every load) of this thread's
        valid keys == T: a second pass over the slice, only where T's keys are split."""
        equal = [Uint32(0), Uint32(0)]
        for u in range(self.loads):
            quad = self.quad(keys, stash, u, tid)
            for j in range(4):
                mark_bit(equal, u, j, quad[j] == threshold)
        for i in range(len(valid)):
            equal[i] = equal[i] & valid[i]
        return equal[0], equal[1]

    @cute.jit
    def scan_equal(self, equal, table_e, lane, warp) -> tuple:
        """compact's step 2 for the keys == T: this lane's counts before it in the warp
        (bytes), four words (zero where unused); lane 31 stores the warp's totals."""
        counted = 2 * len(equal)
        inclusive, lanes = lane_scans(equal, lane)
        if lane == 31:
            store_words(table_e + 4 * counted * warp, inclusive)
        lanes = lanes + [Int32(0)] * (4 - counted)
        return lanes[0], lanes[1], lanes[2], lanes[3]

    @cute.jit
    def key_at(self, again, stash, u, offset, tid):
        """The order key of score `offset` (in load u) of this CTA's slice, for DCP's score
        output (0 without DCP, which writes no scores): a stashed one from shared memory, a
        held one read again from global memory (again: (row, in_row))."""
        key = Uint32(0)
        if cutlass.const_expr(self.dcp > 1):
            row, _ = again
            if cutlass.const_expr(self.stashed == 0):
                key = order_key(P.load_u32(row + offset))
            else:
                if u < self.held:
                    key = order_key(P.load_u32(row + offset))
                else:
                    address = stash + 16 * (self.threads * (u - self.held) + tid) + 4 * (offset % 4)
                    key = order_key(Uint32(P.ld_shared_i32(address)))
        return key

    @cute.jit
    def place(self, out_args, position, offset, key):
        """Score `offset` of this CTA's slice (order key `key`) kept at `position`."""
        out, out_scores, pages, token, base, error, pool_pages = out_args
        self.write(out, out_scores, pages, token, position, base + offset, offset, key, error, pool_pages)

    @cute.jit
    def write(self, out, out_scores, pages, token, position, index, offset, key, error, pool_pages):
        """Score `index` of the row (`offset` in this CTA's slice) kept at `position`."""
        if cutlass.const_expr(self.dcp > 1):
            P.store_i32(out + token * self.k + position, index * self.dcp + self.rank)
            P.store_u32(out_scores + token * self.k + position, word_of(key))
        else:
            store_slot(out + token * self.k + position, pages[offset // PAGE], index, error, token, pool_pages)


def compile_args():
    i32 = P.gmem_ptr(Int32, align=4)
    f32 = P.gmem_ptr(Float32, align=4)
    return (P.gmem_ptr(Float32), i32, i32, i32, f32, Int32(1), Int32(1), P.gmem_ptr(Int32, align=8), Int32(1))
