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
(block table page x 64 + offset).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

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


def order_key(word) -> Uint32:
    """fp32 bits -> a key whose unsigned order is the float order (-inf lowest)."""
    flip = (Uint32(0) - (word >> Uint32(31))) | Uint32(0x80000000)
    return word ^ flip


def element(start, warp, lane, e):
    """The index of a lane's element e (load e // 4, word e % 4) in the chunk at `start`."""
    return start + warp * SEGMENT + (e // 4 * 32 + lane) * 4 + e % 4


class RadixSelect:
    """The threshold search TopK and DcpMerge share. A subclass defines
    `segment(source, start, warp, lane) -> (words, valids)`: a lane's 4 x LOADS elements of
    the chunk at `start` (see `element`) as fp32 bits, and which of them take part."""

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
                for start in range(0, count, CHUNK):
                    words, valids = self.segment(source, start, warp, lane)
                    for e in cutlass.range_constexpr(4 * LOADS):
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
    def __call__(self, scores: cute.Pointer, block_tables: cute.Pointer, context_lens: cute.Pointer,
                 out: cute.Pointer, out_scores: cute.Pointer, batch: Int32, pages_per_seq: Int32,
                 stream: cuda.CUstream):
        self.kernel(scores, block_tables, context_lens, out, out_scores, pages_per_seq).launch(
            grid=[batch, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, scores: cute.Pointer, block_tables: cute.Pointer, context_lens: cute.Pointer,
               out: cute.Pointer, out_scores: cute.Pointer, pages_per_seq: Int32):
        tid, token, lane, warp, hist, scratch, chosen = self.begin()

        width = pages_per_seq * PAGE
        n = cutlass.min(cutlass.max((P.load_i32(context_lens + token) - self.rank + self.dcp - 1) // self.dcp, 0),
                        width)
        row = scores + token * width
        last_vector = cutlass.max(n - 1, 0) // 4 * 4

        threshold, need = Uint32(0), Int32(ALL)  # n <= k: every position is kept
        if n > self.k:
            threshold, need = self.find_threshold((row, n, last_vector), n, self.k, hist, scratch, chosen, tid, lane, warp)

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
                        self.write(out, out_scores, block_tables, token, pages_per_seq,
                                   lane_above + cutlass.min(lane_at, need), element(start, warp, lane, e), words[e])
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
    def write(self, out, out_scores, block_tables, token, pages_per_seq, position, index, word):
        if self.dcp > 1:
            P.store_i32(out + token * self.k + position, index * self.dcp + self.rank)
            P.store_u32(out_scores + token * self.k + position, word)
        else:
            page = P.load_i32(block_tables + token * pages_per_seq + index // PAGE)
            P.store_i32(out + token * self.k + position, page * PAGE + index % PAGE)


def compile_args():
    i32 = P.gmem_ptr(Int32, align=4)
    return (P.gmem_ptr(Float32), i32, i32, i32, P.gmem_ptr(Float32, align=4), Int32(1), Int32(1))
