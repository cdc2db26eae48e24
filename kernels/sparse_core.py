"""SparseCore: sparse MLA decode over each token's selected cache slots, flash-decoding style.

    out[b, h] = softmax_k(scale x q[b, h] . row[slot_k]) @ row[slot_k][:512],  lse[b, h]

partial  grid (k / 64 slot splits, q_heads / 16 head tiles, tokens); 128 threads.
         The tile's 16 query rows (bf16, or e4m3 widened exactly to bf16) go to shared
         memory; each warp scores 4 groups of 8 slots with mma.sync m16n8k16 (heads as M,
         slots as N, the 576 dims as K: every 16-byte key load is paired with the same
         dims of the query rows, the consistent-permutation trick of kernels/projection.py);
         a softmax per head over the split's 64 slots (max and sum over 8 lanes); then
         P @ V on the CUDA cores, thread t owning latent dims 4t..4t+3 of all 16 heads, the
         next eight value rows in flight while the current eight are accumulated. Writes
         the unnormalized partial output and (max, sum).
combine  one warp per (token, head): the splits' partials rescaled to the global max,
         out = sum / total, lse = max + log(total) (natural log).

Slot -1 scores -inf and loads nothing (predicated loads); a token with no slot gets out 0
and lse -inf, as graphstep.reference.sparse_attention. Caches: bf16 [576] rows, or the
fp8 656-byte rows (e4m3 latent x its per-128 scale, rounded to bf16 for the score MMA and
kept fp32 for P @ V; bf16 rope).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32

from . import primitives as P

HEADS = 16  # head tile: the MMA's M
SLOTS = 64  # slots per split: 32 CTAs per token and head tile (parallelism at small batch)
GROUPS = SLOTS // 8 // 4  # 8-slot MMA groups per warp
PER_THREAD = SLOTS // 8  # slots per thread in the softmax (8 threads per head)
THREADS = 128
ROW, LATENT = 576, 512
WORDS = ROW // 2  # bf16 pairs per query row in shared memory
UNROLL = 8  # value rows loaded ahead in P @ V


class SparseCore:
    def __init__(self, q_heads: int, gathered: int, k: int, q_fp8: bool, mla_fp8: bool, softmax_scale: float,
                 pdl: bool = True):
        if q_heads % HEADS or k % SLOTS:
            raise ValueError(f"SparseCore needs q_heads % {HEADS} == 0 and k % {SLOTS} == 0, got {q_heads}, {k}")
        self.q_heads, self.gathered, self.k, self.q_fp8, self.mla_fp8 = q_heads, gathered, k, q_fp8, mla_fp8
        self.softmax_scale, self.pdl = softmax_scale, pdl
        self.splits = k // SLOTS
        self.q_bytes = ROW * (1 if q_fp8 else 2)
        self.row_bytes = 656 if mla_fp8 else 2 * ROW

    @cute.jit
    def __call__(self, q_rows: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, partial_o: cute.Pointer,
                 partial_ml: cute.Pointer, out: cute.Pointer, lse: cute.Pointer, batch: Int32, stream: cuda.CUstream):
        self.partial(q_rows, slots, cache, partial_o, partial_ml).launch(
            grid=[self.splits, self.q_heads // HEADS, batch], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)
        self.combine(partial_o, partial_ml, out, lse, batch).launch(
            grid=[(batch * self.gathered + 3) // 4, 1, 1], block=[128, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def partial(self, q_rows: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, partial_o: cute.Pointer,
                partial_ml: cute.Pointer):
        tid, _, _ = cute.arch.thread_idx()
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        smem = cutlass.memory.SmemAllocator()
        qs = smem.allocate_tensor(Uint32, cute.make_layout(HEADS * WORDS), byte_alignment=16)
        ps = smem.allocate_tensor(Float32, cute.make_layout(HEADS * SLOTS), byte_alignment=16)
        ids = smem.allocate_tensor(Int32, cute.make_layout(SLOTS), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        head0 = group * HEADS
        if tid < SLOTS:
            ids[tid] = P.load_i32(slots + token * self.k + split * SLOTS + tid)
        self.load_queries(q_rows + (token * self.q_heads + head0) * self.q_bytes, qs, tid)
        cute.arch.sync_threads()

        # scores: GROUPS groups of 8 slots per warp, 16 heads x 8 slots per MMA tile
        for grp in cutlass.range_constexpr(GROUPS):
            col0 = (warp * GROUPS + grp) * 8
            slot = ids[col0 + g]
            row = cache + Int64(cutlass.max(slot, 0)) * self.row_bytes
            acc = [Float32(0)] * 4
            for c in cutlass.range_constexpr(ROW // 32):
                d0 = 32 * c + 8 * t  # this thread's 8 dims of the chunk
                key = self.key_words(row, c, d0, slot >= 0)
                qa, qb = [], []
                for j in cutlass.range_constexpr(4):
                    qa.append(qs[g * WORDS + d0 // 2 + j])
                    qb.append(qs[(g + 8) * WORDS + d0 // 2 + j])
                acc = P.mma_bf16_16816((qa[0], qb[0], qa[1], qb[1]), (key[0], key[1]), acc)
                acc = P.mma_bf16_16816((qa[2], qb[2], qa[3], qb[3]), (key[2], key[3]), acc)
            for q in cutlass.range_constexpr(4):  # acc: heads (g, g + 8) x slots (2t, 2t + 1)
                col = col0 + 2 * t + q % 2
                ps[(g + 8 * (q // 2)) * SLOTS + col] = P.select(ids[col] >= 0, acc[q] * Float32(self.softmax_scale),
                                                                Float32(-math.inf))
        cute.arch.sync_threads()

        # softmax over the split's slots: 8 threads per head, PER_THREAD slots each
        head, part = tid // 8, tid % 8
        values = []
        for i in cutlass.range_constexpr(PER_THREAD):
            values.append(ps[head * SLOTS + part * PER_THREAD + i])
        top = values[0]
        for i in cutlass.range_constexpr(1, PER_THREAD):
            top = cute.arch.fmax(top, values[i])
        for offset in cutlass.range_constexpr(3):
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1 << offset))
        total = Float32(0)
        for i in cutlass.range_constexpr(PER_THREAD):
            p = P.select(top > Float32(-math.inf), cute.math.exp(values[i] - top), Float32(0))
            ps[head * SLOTS + part * PER_THREAD + i] = p
            total = total + p
        for offset in cutlass.range_constexpr(3):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
        where = (token * self.splits + split) * self.q_heads + head0 + head
        if part == 0:
            P.store_f32x2(partial_ml + 2 * where, top, total)
        cute.arch.sync_threads()

        # P @ V: thread t owns latent dims 4t..4t+3 of every head of the tile; the next
        # UNROLL value rows are loaded while the current ones are accumulated
        acc_o = [[Float32(0)] * 4 for _ in range(HEADS)]
        rows = self.value_rows(cache, ids, 0, tid)
        for j0 in range(0, SLOTS, UNROLL):
            ahead = self.value_rows(cache, ids, cutlass.min(j0 + UNROLL, SLOTS - UNROLL), tid)
            for u in cutlass.range_constexpr(UNROLL):
                for h in cutlass.range_constexpr(HEADS):
                    p = ps[h * SLOTS + j0 + u]
                    for d in cutlass.range_constexpr(4):
                        acc_o[h][d] = acc_o[h][d] + p * rows[u][d]
            rows = ahead
        for h in cutlass.range_constexpr(HEADS):
            dst = partial_o + ((token * self.splits + split) * self.q_heads + head0 + h) * LATENT + 4 * tid
            P.store_f32x2(dst, acc_o[h][0], acc_o[h][1])
            P.store_f32x2(dst + 2, acc_o[h][2], acc_o[h][3])

    @cute.jit
    def load_queries(self, rows, qs, tid):
        """The tile's 16 query rows -> shared memory as bf16 pairs (e4m3 widens exactly)."""
        if cutlass.const_expr(self.q_fp8):
            for i in range(tid, HEADS * (ROW // 16), THREADS):
                h, c = i // (ROW // 16), i % (ROW // 16)
                words = P.load_u32x4(rows + h * self.q_bytes + 16 * c)
                for j in cutlass.range_constexpr(4):
                    f = P.unpack_e4m3x4(words[j])
                    qs[h * WORDS + 8 * c + 2 * j] = P.pack_bf16x2(f[0], f[1])
                    qs[h * WORDS + 8 * c + 2 * j + 1] = P.pack_bf16x2(f[2], f[3])
        else:
            for i in range(tid, HEADS * (ROW // 8), THREADS):
                h, c = i // (ROW // 8), i % (ROW // 8)
                words = P.load_u32x4(rows + h * self.q_bytes + 16 * c)
                for j in cutlass.range_constexpr(4):
                    qs[h * WORDS + 4 * c + j] = words[j]

    @cute.jit
    def key_words(self, row, c: int, d0, live):
        """Dims d0..d0+7 of a cache row as 4 bf16 pairs (0 where not live)."""
        words = []
        if cutlass.const_expr(not self.mla_fp8):
            words = list(P.load_u32x4_if(row + 2 * d0, live))
        elif cutlass.const_expr(32 * c < LATENT):
            raw = P.load_u32x2_if(row + d0, live)
            scale = P.load_f32_if(row + LATENT + 4 * (32 * c // 128), live)
            for j in cutlass.range_constexpr(2):
                f = P.unpack_e4m3x4(raw[j])
                words.append(P.pack_bf16x2(f[0] * scale, f[1] * scale))
                words.append(P.pack_bf16x2(f[2] * scale, f[3] * scale))
        else:  # the bf16 rope after the 512 e4m3 and 4 scales
            words = list(P.load_u32x4_if(row + LATENT + 16 + 2 * (d0 - LATENT), live))
        return words

    @cute.jit
    def value_rows(self, cache, ids, first, tid) -> list:
        """Latent dims 4 tid .. + 3 of the UNROLL cache rows of slots ids[first ..]."""
        rows = []
        for u in cutlass.range_constexpr(UNROLL):
            slot = ids[first + u]
            rows.append(self.value4(cache + Int64(cutlass.max(slot, 0)) * self.row_bytes, tid, slot >= 0))
        return rows

    @cute.jit
    def value4(self, row, tid, live):
        """Latent dims 4 tid .. 4 tid + 3 of a cache row as fp32 (0 where not live)."""
        values = []
        if cutlass.const_expr(self.mla_fp8):
            f = P.unpack_e4m3x4(P.load_u32_if(row + 4 * tid, live))
            scale = P.load_f32_if(row + LATENT + 4 * (tid // 32), live)
            values = [f[d] * scale for d in range(4)]
        else:
            words = P.load_u32x2_if(row + 8 * tid, live)
            values = list(P.unpack_bf16x2(words[0])) + list(P.unpack_bf16x2(words[1]))
        return values

    @cute.kernel
    def combine(self, partial_o: cute.Pointer, partial_ml: cute.Pointer, out: cute.Pointer, lse: cute.Pointer,
                batch: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tid % 32
        item = cta * 4 + tid // 32
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if item < batch * self.gathered:
            token, head = item // self.gathered, item % self.gathered
            first = token * self.splits * self.q_heads + head  # split s at first + s x q_heads
            stats = []
            for s in cutlass.range_constexpr(self.splits):
                stats.append(P.load_f32x2(partial_ml + 2 * (first + s * self.q_heads)))
            top = stats[0][0]
            for s in cutlass.range_constexpr(1, self.splits):
                top = cute.arch.fmax(top, stats[s][0])
            live = top > Float32(-math.inf)
            weights, total = [], Float32(0)
            for s in cutlass.range_constexpr(self.splits):
                w = P.select(live, cute.math.exp(stats[s][0] - top), Float32(0))
                weights.append(w)
                total = total + w * stats[s][1]
            inverse = P.select(total > Float32(0), Float32(1) / total, Float32(0))
            for i in cutlass.range_constexpr(4):
                sums = [Float32(0)] * 4
                for s in cutlass.range_constexpr(self.splits):
                    o = P.load_f32x4(partial_o + (first + s * self.q_heads) * LATENT + 16 * lane + 4 * i)
                    for d in cutlass.range_constexpr(4):
                        sums[d] = sums[d] + weights[s] * o[d]
                dst = out + item * LATENT + 16 * lane + 4 * i
                P.store_f32x2(dst, sums[0] * inverse, sums[1] * inverse)
                P.store_f32x2(dst + 2, sums[2] * inverse, sums[3] * inverse)
            if lane == 0:
                P.store_f32(lse + item, P.select(total > Float32(0), top + cute.math.log(total), Float32(-math.inf)))


def compile_args():
    f32 = P.gmem_ptr(Float32)
    return (P.gmem_ptr(Uint8), P.gmem_ptr(Int32, align=4), P.gmem_ptr(Uint8), f32, f32, f32,
            P.gmem_ptr(Float32, align=4), Int32(1))
