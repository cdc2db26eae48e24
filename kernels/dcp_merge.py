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
ascending position, so the output is a compaction of that list (warp ballots, one block
scan): local slots in ascending position, -1 padded, as graphstep.reference.local_slots
gives them. Guards (kernels/guards.py): a kept candidate whose local index is outside the
block table's width, or whose page is outside [0, pool_pages), becomes slot -1 (a hole),
recorded.

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
from .top_k import ALL, CHUNK, LOADS, PAGE, THREADS, RadixSelect, element, order_key

NEG_INF_BITS = 0xFF800000
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"page_size": (PAGE,)}


class DcpMerge(RadixSelect):
    def __init__(self, k: int, dcp: int, rank: int, pdl: bool = True):
        if dcp < 2:
            raise ValueError(f"DcpMerge needs dcp >= 2, got {dcp}")
        self.k, self.dcp, self.rank, self.pdl = k, dcp, rank, pdl

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
        tid, token, lane, warp, hist, scratch, chosen = self.begin()

        peers = (peer_scores, peer_positions, peer_offsets, token_stride)
        source = (token, own_scores, own_positions, peers)
        count = self.dcp * self.k
        threshold, need = self.find_threshold(source, count, self.k, hist, scratch, chosen, tid, lane, warp)

        # This rank's selected candidates, compacted in their (ascending position) order.
        lower_lanes = (Int32(1) << lane) - Int32(1)
        kept = Int32(0)  # selected candidates of the chunks before this one
        for start in range(0, self.k, CHUNK):
            words, valids = self.segment(source, start, warp, lane, own_only=True)
            takes, positions = [], []
            warp_count = Int32(0)
            for e in cutlass.range_constexpr(4 * LOADS):
                key = order_key(words[e])
                index = cutlass.min(element(start, warp, lane, e), self.k - 1)
                position = P.load_i32(own_positions + token * self.k + index)
                # need == ALL: every candidate at the threshold is taken, no tie count
                take = valids[e] and (key > threshold or (key == threshold and need == ALL))
                if valids[e] and key == threshold and need != ALL:
                    take = self.tied_before(source, position, words[e], count) < need
                takes.append(cute.arch.vote_ballot_sync(take))
                positions.append(position)
                warp_count = warp_count + cute.arch.popc(takes[e])
            before, total = self.warp_scan(warp_count, scratch, lane, warp)
            place = kept + before
            for u in cutlass.range_constexpr(LOADS):
                mine_before = place
                for j in cutlass.range_constexpr(4):
                    mine_before = mine_before + cute.arch.popc(takes[4 * u + j] & lower_lanes)
                for j in cutlass.range_constexpr(4):
                    e = 4 * u + j
                    if ((takes[e] >> lane) & 1) == 1:
                        self.store_slot(
                            out + token * self.k + mine_before,
                            positions[e],
                            block_tables + token * pages_per_seq,
                            pages_per_seq,
                            error,
                            token,
                            pool_pages,
                        )
                    mine_before = mine_before + ((takes[e] >> lane) & 1)
                for j in cutlass.range_constexpr(4):
                    place = place + cute.arch.popc(takes[4 * u + j])
            kept = kept + total
        for i in range(kept + tid, self.k, THREADS):
            P.store_i32(out + token * self.k + i, Int32(-1))

    @cute.jit
    def store_slot(self, at, position, table, pages_per_seq, error, token, pool_pages):
        """The slot of this rank's global `position` through its block-table row `table`
        at `at`; -1 (a hole) and a record where the local index or its page is out of range."""
        local_ok = P.in_range(position, pages_per_seq * PAGE * self.dcp)  # local index position // dcp
        local = position // self.dcp
        page = P.load_i32(table + P.select_i32(local_ok, local, 0) // PAGE)
        page_ok = P.in_range(page, pool_pages)
        P.store_i32(at, P.select_i32(local_ok and page_ok, page * PAGE + local % PAGE, -1))
        if not local_ok:
            P.record_range(error, guards.DCP_MERGE_POSITION, token, position)
        elif not page_ok:
            P.record_range(error, guards.DCP_MERGE_PAGE, token, page)

    @cute.jit
    def segment(self, source, start, warp, lane, own_only: bool = False) -> tuple:
        """A lane's candidates of the chunk at `start` over [rank 0's k | rank 1's k | ...]
        (or the own list alone), as score words, and which are real (not -inf padding)."""
        token, own_scores, _, peers = source
        count = self.k if own_only else self.dcp * self.k
        words, valids = [], []
        for u in cutlass.range_constexpr(LOADS):
            c = cutlass.min(element(start, warp, lane, 4 * u), count - 4)
            vector = []
            if cutlass.const_expr(own_only):
                vector = list(P.load_u32x4(own_scores + token * self.k + c))
            else:
                rank, i = c // self.k, c % self.k
                mine = P.load_u32x4_if(own_scores + token * self.k + i, rank == self.rank)
                theirs = P.load_u32x4_if(self.peer_row(peers, 0, token, rank) + i, rank != self.rank)
                vector = [mine[j] | theirs[j] for j in range(4)]
            for j in cutlass.range_constexpr(4):
                word = vector[j]
                words.append(word)
                valids.append(element(start, warp, lane, 4 * u + j) < count and word != Uint32(NEG_INF_BITS))
        return words, valids

    @cute.jit
    def tied_before(self, source, position, word, count):
        """How many candidates of any rank have this score and a lower global position."""
        token, own_scores, own_positions, peers = source
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
            tied = tied + P.select_i32(other == word and at < position, 1, 0)
        return tied

    @cute.jit
    def peer_row(self, peers, which: int, token, rank):
        """Where rank `rank`'s scores (which 0) or positions (1) of `token` start."""
        base = peers[which]
        return base + P.load_i64(peers[2] + rank) // 4 + token * peers[3]


def compile_args():
    i32, f32 = P.gmem_ptr(Int32, align=4), P.gmem_ptr(Float32, align=4)
    i64 = P.gmem_ptr(Int64, align=8)
    return (i32, f32, i32, f32, i32, i32, Int32(1), Int32(1), P.gmem_ptr(Int32, align=8), Int32(1), i64, Int32(1))
