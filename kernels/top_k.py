"""TopK: the k highest DsaIndex scores of each token, by radix select (no sort).

One CTA of 1024 threads per token; thread t owns a contiguous run of the token's scores
(runs of a multiple of 16, read as four 16-byte loads issued together). A score's float bits map to an
order-preserving 32-bit key; three histogram rounds over 11 + 11 + 10 key bits find the
exact k-th key T and how many keys equal to T are still needed; a round whose chosen bin
is needed whole ends the search early (with continuous scores, usually after two). The first round's
histogram is warp-aggregated (`match.any`): scores of similar magnitude share their top
11 bits, and 32 lanes adding to one shared-memory counter would serialize.

Output, in ascending score index (the sparse core does not depend on order; a compaction
in index order is what needs no sort): every index with key > T, and the first `need`
indices with key == T, so equal scores go to the lower index first. Rows shorter than k
keep every position and are padded with -1. With DCP the output is this rank's candidates
for the merge: global positions (local x dcp + rank) and their scores (-inf padded);
otherwise cache slots (block table page x 64 + offset).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from . import primitives as P

THREADS = 1024
WARPS = THREADS // 32
PAGE = 64
ROUNDS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of each radix digit, high first
HIST = 1 << 11
STEP = 16  # scores per thread per loop step: four 16-byte loads in flight
ALL = 2**31 - 1


def order_key(word) -> Uint32:
    """fp32 bits -> a key whose unsigned order is the float order (-inf lowest)."""
    flip = (Uint32(0) - (word >> Uint32(31))) | Uint32(0x80000000)
    return word ^ flip


class TopK:
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
        tid, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(HIST), byte_alignment=16)
        scratch = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS), byte_alignment=16)
        chosen = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        width = pages_per_seq * PAGE
        n = cutlass.min(cutlass.max((P.load_i32(context_lens + token) - self.rank + self.dcp - 1) // self.dcp, 0),
                        width)
        row = scores + token * width
        # same run length for every thread (loops stay warp-uniform), whole unrolled steps
        run = (n + THREADS * STEP - 1) // (THREADS * STEP) * STEP
        begin = tid * run
        last_vector = cutlass.max(n - 1, 0) // 4 * 4

        threshold, need = Uint32(0), Int32(ALL)  # n <= k: every position is kept
        if n > self.k:
            need = Int32(self.k)
            prefix, done = Uint32(0), Int32(0)
            for r in cutlass.range_constexpr(len(ROUNDS)):
                shift, bits = ROUNDS[r]
                if done == 0:
                    for i in range(tid, HIST, THREADS):
                        hist[i] = 0
                    cute.arch.sync_threads()
                    for v in range(0, run, STEP):
                        words = self.load_step(row, begin + v, last_vector)
                        for j in cutlass.range_constexpr(STEP):
                            key = order_key(words[j])
                            digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                            valid = begin + v + j < n
                            if r == 0:
                                self.count_aggregated(hist, P.select_i32(valid, digit, HIST), lane)
                            else:
                                if valid and (key >> Uint32(shift + bits)) == prefix:
                                    cute.arch.atomic_add(hist.iterator + digit, Int32(1))
                    cute.arch.sync_threads()
                    self.find_bin(hist, scratch, chosen, 1 << bits, need, tid, lane, warp)
                    prefix = (prefix << Uint32(bits)) | Uint32(chosen[0])
                    need = need - chosen[1]
                    threshold = prefix << Uint32(shift)
                    if chosen[2] == need:  # the bin is taken whole: every key >= its lowest
                        need = Int32(ALL)
                        done = Int32(1)

        # Ordered compaction: count this run's keys above and at the threshold, scan, write.
        above, at = Int32(0), Int32(0)
        for v in range(0, run, STEP):
            words = self.load_step(row, begin + v, last_vector)
            for j in cutlass.range_constexpr(STEP):
                key = order_key(words[j])
                valid = begin + v + j < n
                above = above + P.select_i32(valid and key > threshold, 1, 0)
                at = at + P.select_i32(valid and key == threshold, 1, 0)
        above_before = P.block_exclusive_sum(above, scratch, lane, warp, WARPS)
        at_before = P.block_exclusive_sum(at, scratch, lane, warp, WARPS)
        position = above_before + cutlass.min(at_before, need)
        seen = at_before
        for v in range(0, run, STEP):
            words = self.load_step(row, begin + v, last_vector)
            for j in cutlass.range_constexpr(STEP):
                key = order_key(words[j])
                index = begin + v + j
                valid = index < n
                tie = valid and key == threshold
                if (valid and key > threshold) or (tie and seen < need):
                    self.write(out, out_scores, block_tables, token, pages_per_seq, position, index, words[j])
                    position = position + 1
                seen = seen + P.select_i32(tie, 1, 0)
        for i in range(cutlass.min(n, self.k) + tid, self.k, THREADS):
            P.store_i32(out + token * self.k + i, Int32(-1))
            if self.dcp > 1:
                P.store_f32(out_scores + token * self.k + i, Float32(float("-inf")))

    def load_step(self, row, first, last_vector) -> list:
        """STEP scores from `first` as words, all loads issued before any is used (clamped
        to the last vector holding a valid score; callers mask by index)."""
        words = []
        for u in range(STEP // 4):
            words += list(P.load_u32x4(row + cutlass.min(first + 4 * u, last_vector)))
        return words

    @cute.jit
    def count_aggregated(self, hist, digit, lane):
        """hist[digit] += 1 for every lane, one shared atomic per distinct digit of the warp
        (digit HIST: nothing to count)."""
        peers = cute.arch.match_sync(0xFFFFFFFF, digit)
        lower = (Uint32(1) << Uint32(lane)) - Uint32(1)
        if (peers & lower) == Uint32(0) and digit < HIST:
            cute.arch.atomic_add(hist.iterator + digit, Int32(cute.arch.popc(peers)))

    @cute.jit
    def find_bin(self, hist, scratch, chosen, bins: int, need, tid, lane, warp):
        """chosen = (the bin holding the need-th highest key, the count above that bin, the
        bin's own count).
        Thread t owns bins in descending order, so an exclusive scan counts what is above."""
        per = bins // THREADS
        counts = []
        for j in cutlass.range_constexpr(per):
            counts.append(hist[bins - 1 - (tid * per + j)])
        total = counts[0]
        for j in cutlass.range_constexpr(1, per):
            total = total + counts[j]
        before = P.block_exclusive_sum(total, scratch, lane, warp, WARPS)
        for j in cutlass.range_constexpr(per):
            if before < need and before + counts[j] >= need:
                chosen[0] = bins - 1 - (tid * per + j)
                chosen[1] = before
                chosen[2] = counts[j]
            before = before + counts[j]
        cute.arch.sync_threads()

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
