"""DcpMerge: under DCP, every rank's top-k candidates -> this rank's share of the global
top-k, as cache slots.

Each rank's TopK gives k candidates in ascending global position (local x dcp + rank) with
their scores (-inf padded). Rank r's list of a token is read at `peer_offsets[r]` bytes from
peer_positions / peer_scores, then `token_stride` elements per token: rows of one [B, dcp,
k] tensor (offsets r x k x 4, stride dcp x k), or in a DCP group the peers' own TopK outputs
[B, k] in their memory (offsets between the ranks' buffers, stride k). The global top-k is
the k best of the dcp x k candidates (equal scores: lower global position first), found with
TopK's radix threshold search (kernels/top_k.py, one CTA of 1024 threads per token). This
rank keeps the selected candidates that are its own, and its own list is already in
ascending position, so the output is a compaction of that list (one block scan of the
threads' counts): local slots in ascending position, -1 padded, as
graphstep.reference.local_slots gives them. Guards (kernels/guards.py): a kept candidate
whose local index is outside the block table's width, or whose page is outside [0,
pool_pages), becomes slot -1 (a hole), recorded.

Each thread loads its 16-byte vector(s) of the dcp x k candidates once, right after the PDL
wait (ceil(dcp / 2) vectors at k = 2048: 4 candidates a thread at dcp 2), with, for its own rank's,
their positions and the block-table pages they map to; the radix rounds and the compaction
then work on registers. The ranks' offsets are read before the wait (set up once, never
written by a step). Until session 40 the kernel ran TopK's chunk loop: 16 slots a thread, 12
of them clamped at dcp 2, every round reloading from L2 -- 31K cycles at 14.7 cycles an
instruction on its one SM, bound by its instruction count (ncu, H100); 12.9-15.8 us alone,
5.4-6.3 now (dcp 4: 12.8-15.7 -> 6.1-7.2), and the Kimi K3.1 DCP 2 step 9-15 us faster in fork
(`bench/bench_dcp_merge.py`, bench/RESULTS.md session 40).

A candidate whose score equals the threshold is taken outright when the search took
its bin whole (need = ALL: every candidate at the threshold is selected). Only when more
candidates sit at the exact threshold than are needed (true ties) is one taken if fewer than
`need` tied candidates of any rank have a lower position, each such candidate counting them
with a scan over all dcp x k candidates (~dcp x k dependent loads, ~100-250 us at dcp x k =
4096: rare with real scores; all-equal scores pay it per tied candidate, still bounded).
Without the need = ALL shortcut the scan also ran, for nothing, whenever the search
resolved in its last radix round with this rank's candidate as the k-th: about one token in
15-20 of the step's random data (a CPU model of the search), one scan holding the whole
step (issue 10's DCP 2 bullet: ~250 us at every batch; tests/test_dcp_replay.py).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from . import guards
from . import primitives as P
from .top_k import ALL, PAGE, THREADS, WARPS, RadixSelect, order_key

NEG_INF_BITS = 0xFF800000
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"page_size": (PAGE,)}


class DcpMerge(RadixSelect):
    def __init__(self, k: int, dcp: int, rank: int, pdl: bool = True):
        if dcp < 2:
            raise ValueError(f"DcpMerge needs dcp >= 2, got {dcp}")
        if k % 4:
            raise ValueError(f"DcpMerge needs k a multiple of 4 (16-byte loads), got {k}")
        self.k, self.dcp, self.rank, self.pdl = k, dcp, rank, pdl
        self.vectors = -(-dcp * k // (4 * THREADS))  # 16-byte vectors a thread holds
        self.chunk = dcp * k  # one `segment` a round: every candidate is held

    @cute.jit
    def __call__(
        self,
        own_positions: cute.Pointer,
        own_scores: cute.Pointer,
        peer_positions: cute.Pointer,
        peer_scores: cute.Pointer,
        block_tables: cute.Pointer,
        out: cute.Pointer,
        batch: Int32,
        pages_per_seq: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
        peer_offsets: cute.Pointer,
        token_stride: Int32,
        stream: cuda.CUstream,
    ):
        self.dcp_merge(
            own_positions,
            own_scores,
            peer_positions,
            peer_scores,
            peer_offsets,
            token_stride,
            block_tables,
            out,
            pages_per_seq,
            error,
            pool_pages,
        ).launch(grid=[batch, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def dcp_merge(
        self,
        own_positions: cute.Pointer,
        own_scores: cute.Pointer,
        peer_positions: cute.Pointer,
        peer_scores: cute.Pointer,
        peer_offsets: cute.Pointer,
        token_stride: Int32,
        block_tables: cute.Pointer,
        out: cute.Pointer,
        pages_per_seq: Int32,
        error: cute.Pointer,
        pool_pages: Int32,
    ):
        # the ranks' offsets are set up once, never written by the step: read before the wait
        offsets = [P.load_i64_nc(peer_offsets + r) // 4 for r in range(self.dcp)]
        tid, token, lane, warp, hist, scratch, chosen = self.begin()

        # Every candidate loaded once: thread t holds vector v's elements 4 (v THREADS + t) ..
        # + 3 of [rank 0's k | rank 1's k | ...] (a vector never straddles two ranks: 4 | k),
        # and, for its own rank's, their positions and the block-table pages they map to.
        table = block_tables + token * pages_per_seq
        peers = (peer_scores, peer_positions, offsets, token_stride)
        held = []  # per vector: (index in own list or -1, words, valids, positions, pages)
        for v in cutlass.range_constexpr(self.vectors):
            c = (v * THREADS + tid) * 4
            live = c < self.dcp * self.k
            rank, i = c // self.k, c % self.k
            own = live and rank == self.rank
            mine = P.load_u32x4_if(own_scores + token * self.k + i, own)
            theirs = P.load_u32x4_if(self.peer_row(peers, 0, token, rank) + i, live and rank != self.rank)
            words = [mine[j] | theirs[j] for j in range(4)]
            valids = [live and words[j] != Uint32(NEG_INF_BITS) for j in range(4)]
            positions = P.load_i32x4_if(own_positions + token * self.k + i, own)
            pages = []
            for j in cutlass.range_constexpr(4):
                local = positions[j] // self.dcp  # read only where in range (store_slot checks)
                ok = own and P.in_range(positions[j], pages_per_seq * PAGE * self.dcp)
                pages.append(P.load_i32_if(table + P.select_i32(ok, local, 0) // PAGE, ok))
            held.append((P.select_i32(own, i, -1), words, valids, positions, pages))

        source = (token, own_scores, own_positions, peers, held)
        count = self.dcp * self.k
        threshold, need = self.find_threshold(source, count, self.k, hist, scratch, chosen, tid, lane, warp)

        # This rank's selected candidates, compacted in their (ascending position) order:
        # one block scan of the threads' counts per vector (vector order is list order).
        kept = Int32(0)  # selected candidates of the vectors before this one
        for v in cutlass.range_constexpr(self.vectors):
            index, words, valids, positions, pages = held[v]
            takes = []
            mine = Int32(0)
            for j in cutlass.range_constexpr(4):
                key = order_key(words[j])
                # need == ALL: every candidate at the threshold is taken, no tie count
                take = index >= 0 and valids[j] and (key > threshold or (key == threshold and need == ALL))
                if index >= 0 and valids[j] and key == threshold and need != ALL:
                    take = self.tied_before(source, positions[j], words[j], count) < need
                takes.append(take)
                mine = mine + P.select_i32(take, 1, 0)
            before = P.block_exclusive_sum(mine, scratch, lane, warp, WARPS)
            if tid == THREADS - 1:
                chosen[3] = before + mine
            cute.arch.sync_threads()
            place = kept + before
            for j in cutlass.range_constexpr(4):
                if takes[j]:
                    self.store_slot(
                        out + token * self.k + place, positions[j], pages[j], pages_per_seq, error, token, pool_pages
                    )
                place = place + P.select_i32(takes[j], 1, 0)
            kept = kept + chosen[3]
            cute.arch.sync_threads()  # chosen[3] read by all before the next vector's write
        for i in range(kept + tid, self.k, THREADS):
            P.store_i32(out + token * self.k + i, Int32(-1))

    @cute.jit
    def store_slot(self, at, position, page, pages_per_seq, error, token, pool_pages):
        """The slot of this rank's global `position` (its block-table `page`, loaded where the
        local index is in range) at `at`; -1 (a hole) and a record where the local index or its
        page is out of range."""
        local_ok = P.in_range(position, pages_per_seq * PAGE * self.dcp)  # local index position // dcp
        local = position // self.dcp
        page_ok = P.in_range(page, pool_pages)
        P.store_i32(at, P.select_i32(local_ok and page_ok, page * PAGE + local % PAGE, -1))
        if not local_ok:
            P.record_range(error, guards.DCP_MERGE_POSITION, token, position)
        elif not page_ok:
            P.record_range(error, guards.DCP_MERGE_PAGE, token, page)

    def segment(self, source, start, warp, lane) -> tuple:
        """The elements this thread holds (every one: the whole list is one chunk)."""
        held = source[4]
        return [w for h in held for w in h[1]], [ok for h in held for ok in h[2]]

    @cute.jit
    def tied_before(self, source, position, word, count):
        """How many candidates of any rank have this score (-0.0 as +0.0) and a lower global
        position."""
        token, own_scores, own_positions, peers, _ = source
        tied = Int32(0)
        for c in range(count):
            rank, i = c // self.k, c % self.k
            other, at = Uint32(0), Int32(0)
            if rank == self.rank:
                other = P.load_u32(own_scores + token * self.k + i)
                at = P.load_i32(own_positions + token * self.k + i)
            else:
                other = P.load_u32(self.peer_row(peers, 0, token, rank) + i)
                at = P.load_i32(self.peer_row(peers, 1, token, rank) + i)
            # equal keys, not equal words: -0.0 and +0.0 tie (order_key), as the search counted them
            tied = tied + P.select_i32(order_key(other) == order_key(word) and at < position, 1, 0)
        return tied

    @cute.jit
    def peer_row(self, peers, which: int, token, rank):
        """Where rank `rank`'s scores (which 0) or positions (1) of `token` start."""
        offset = Int64(0)  # elements
        for r in cutlass.range_constexpr(self.dcp):
            offset = offset + P.select_i64(rank == r, peers[2][r], 0)
        return peers[which] + offset + token * peers[3]


def compile_args():
    i32 = P.gmem_ptr(Int32, align=4)
    lists = (P.gmem_ptr(Int32), P.gmem_ptr(Float32))  # the candidate lists, read by 16-byte vectors
    i64 = P.gmem_ptr(Int64, align=8)
    return (*lists, *lists, i32, i32, Int32(1), Int32(1), P.gmem_ptr(Int32, align=8), Int32(1), i64, Int32(1))
