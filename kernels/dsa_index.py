"""DsaIndex: score every cached token of each sequence on the FP8 tensor cores.

    score[b, i] = k_scale[i] * sum_h w[b, h] * relu(q[b, h] . k[i])     (i < local length)
    score[b, i] = -inf                                                   (past it)

Grid: (page groups of 4 pages, tokens); 128 threads. A CTA keeps its token's 64 e4m3
query rows (8 KB) and head weights in registers; each warp takes 16 cached keys of each of
its 4 pages, all loads issued first (predicated loads: key blocks of 16 that start past
the length are never read), then per page: mma.sync m16n8k32 e4m3 with the keys as A
(16 x 128) and the queries as B (8 heads per MMA, 8 MMA columns for 64 heads), FP32
accumulation; ReLU, the weighted head sum (in registers, then across the 4 lanes of a
row), times the key's scale. The page layout is graphstep/formats.py's: [64 x 128 e4m3 | 64 x fp32 scale].
Every 16-byte word a thread loads from a key row is paired with the same word of the
query rows, so any consistent split of the 128 dims over the MMA's k slots is exact.
Under DCP the local length of a sequence is ceil((len - rank) / dcp).

Tested on the H200 against the reference (tests/test_indexer_gpu.py); DecodeStep's cute
backend runs it. Measured in bench/RESULTS.md.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from . import primitives as P

HEADS, DIM, PAGE = 64, 128, 64
PAGE_BYTES = PAGE * (DIM + 4)
PAGES_PER_CTA = 4
NTILES = HEADS // 8


class DsaIndex:
    def __init__(self, dcp: int = 1, rank: int = 0, pdl: bool = True):
        self.dcp, self.rank, self.pdl = dcp, rank, pdl

    @cute.jit
    def __call__(self, q: cute.Pointer, head_w: cute.Pointer, cache: cute.Pointer, block_tables: cute.Pointer,
                 context_lens: cute.Pointer, scores: cute.Pointer, batch: Int32, pages_per_seq: Int32,
                 stream: cuda.CUstream):
        self.kernel(q, head_w, cache, block_tables, context_lens, scores, pages_per_seq).launch(
            grid=[(pages_per_seq + PAGES_PER_CTA - 1) // PAGES_PER_CTA, batch, 1], block=[128, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, q: cute.Pointer, head_w: cute.Pointer, cache: cute.Pointer, block_tables: cute.Pointer,
               context_lens: cute.Pointer, scores: cute.Pointer, pages_per_seq: Int32):
        tid, _, _ = cute.arch.thread_idx()
        group, token, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        length = cutlass.max((P.load_i32(context_lens + token) - self.rank + self.dcp - 1) // self.dcp, 0)
        # B operands: head nt * 8 + g, its bytes 16t..16t+15 and 64+16t..64+16t+15; and the
        # weights of the two heads (nt * 8 + 2t, + 1) whose scores this thread accumulates.
        queries, weights = [], []
        for nt in cutlass.range_constexpr(NTILES):
            row = q + (token * HEADS + nt * 8 + g) * DIM
            queries.append(list(P.load_u32x4(row + 16 * t)) + list(P.load_u32x4(row + 64 + 16 * t)))
            weights.append(P.load_f32x2(head_w + token * HEADS + nt * 8 + 2 * t))
        width = pages_per_seq * PAGE
        # Every key load of the CTA's pages is issued before the first MMA (predicated off
        # past the length or the table), so a warp has 4 pages x 1 KB in flight.
        keys, scales = [], []
        for p in cutlass.range_constexpr(PAGES_PER_CTA):
            index = group * PAGES_PER_CTA + p
            live = index < pages_per_seq and index * PAGE + warp * 16 < length
            page = P.load_i32(block_tables + token * pages_per_seq + cutlass.min(index, pages_per_seq - 1))
            base = cache + Int64(page) * PAGE_BYTES  # 64-bit: caches pass 2 GiB
            rows = []
            for r in cutlass.range_constexpr(2):
                key = base + (warp * 16 + g + 8 * r) * DIM
                rows.append(list(P.load_u32x4_if(key + 16 * t, live)) + list(P.load_u32x4_if(key + 64 + 16 * t, live)))
                scales.append(P.load_f32_if(base + PAGE * DIM + 4 * (warp * 16 + g + 8 * r), live and t == 0))
            keys.append(rows)
        for p in cutlass.range_constexpr(PAGES_PER_CTA):
            index = group * PAGES_PER_CTA + p
            first = index * PAGE + warp * 16  # this warp's first key position
            if index < pages_per_seq:
                s0, s1 = self.score_rows(queries, weights, keys[p])
                if t == 0:
                    P.store_f32(scores + token * width + first + g,
                                P.select(first + g < length, s0 * scales[2 * p], Float32(float("-inf"))))
                    P.store_f32(scores + token * width + first + g + 8,
                                P.select(first + g + 8 < length, s1 * scales[2 * p + 1], Float32(float("-inf"))))

    @cute.jit
    def score_rows(self, queries, weights, keys):
        """Unscaled scores of a warp's 16 keys, rows g and g + 8 (complete on lane t = 0)."""
        sums = [Float32(0), Float32(0)]
        for nt in cutlass.range_constexpr(NTILES):
            acc = [Float32(0)] * 4
            for step in cutlass.range_constexpr(4):
                a = (keys[0][2 * step], keys[1][2 * step], keys[0][2 * step + 1], keys[1][2 * step + 1])
                acc = P.mma_e4m3_16832(a, (queries[nt][2 * step], queries[nt][2 * step + 1]), acc)
            # acc: rows (g, g + 8) x heads (nt * 8 + 2t, + 1)
            for r in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(2):
                    sums[r] = sums[r] + cute.arch.fmax(acc[2 * r + j], Float32(0)) * weights[nt][j]
        for r in cutlass.range_constexpr(2):  # the row's heads are spread over its 4 lanes
            sums[r] = sums[r] + cute.arch.shuffle_sync_bfly(sums[r], offset=1)
            sums[r] = sums[r] + cute.arch.shuffle_sync_bfly(sums[r], offset=2)
        return sums[0], sums[1]


def compile_args():
    return (P.gmem_ptr(Uint8), P.gmem_ptr(Float32), P.gmem_ptr(Uint8), P.gmem_ptr(Int32, align=4),
            P.gmem_ptr(Int32, align=4), P.gmem_ptr(Float32, align=4), Int32(1), Int32(1))
