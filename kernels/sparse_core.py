"""SparseCore: sparse MLA decode over each token's selected cache slots, flash-decoding style.

    out[b, h] = softmax_k(scale x q[b, h] . row[slot_k]) @ row[slot_k][:512],  lse[b, h]

partial  grid (splits, q_heads / heads_per_cta, tokens). A CTA owns `heads_per_cta` query
         rows (16, 32 or 64: one 16-row MMA tile per row of warps) of one token and a run
         of `slots_per_cta` consecutive entries of its slot list, walked in blocks of
         `block` slots. Warp (mt, c): M tile mt, column c of COLS. Per block:
         - the block's cache rows are copied into shared memory once (cp.async, 16-byte
           chunks, -1 slots zero-filled), the next block's copies in flight while this
           one is computed; fp8 rows (656 B) land raw and are dequantized to bf16 rows in
           shared memory once per block;
         - scores on the tensor cores (mma.sync m16n8k16 bf16, fp32 accumulators): the
           query rows are A (ldmatrix from shared memory), the block's rows B (ldmatrix),
           column warp c takes the block's 8-slot tiles c, c + COLS, ...;
         - online softmax in the log2 domain: the row max of the block over the column
           warps through shared memory, P = 2^(s - max) written to shared memory as bf16;
         - P @ V on the tensor cores: P is A, the same shared rows' first 512 dims are B
           (ldmatrix.trans), column warp c owns latent dims 128 c .. 128 c + 127 of its
           M tile's 16 rows in registers, rescaled when the max moves.
         Writes the split's unnormalized output and (max, sum), max in log2 units.
combine  grid (4 quarters of the 512 latent dims, gathered heads, tokens), 128 threads:
         the splits' (max, sum) -> weights 2^(max_s - max), then the weighted sum of the
         splits' partial outputs (warp w takes splits w, w + 4, ..., 8 loads in flight),
         out = sum / total, lse = (max + log2(total)) x ln 2 (natural log).

`plan(batch, q_heads, k)` picks heads_per_cta and slots_per_cta on the host so that a
launch is about one wave of CTAs (bench/RESULTS.md has the measured sweep).

Slot -1 scores -inf and loads nothing; a token with no slot gets out 0 and lse -inf, as
graphstep.reference.sparse_attention. Query rows: bf16, or e4m3 widened exactly to bf16;
rows past `gathered` (the 16-row padding of the mailbox, never published) are zeros.
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

ROW, LATENT = 576, 512
COLS = 4  # column warps per M tile: QK slot tiles and P @ V's 128-dim quarters of the latent
STRIDE = 2 * ROW + 16  # bytes per bf16 row in shared memory (+16: ldmatrix rows hit distinct banks)
FP8_ROW = 656  # 512 e4m3 | 4 fp32 scales | 64 bf16 rope
BF16_CHUNKS, FP8_CHUNKS = 2 * ROW // 16, FP8_ROW // 16  # 16-byte chunks per cache row
STAGES = 2
LOG2E = 1.4426950408889634
MAX_CTA_HEADS = 64
WAVE = 128  # CTAs a plan aims for (132 SMs, one CTA each)


def heads_per_cta(q_heads: int) -> int:
    """Query rows per CTA: 64 where they divide (KV rows read once per 64 heads), else 32 or 16."""
    for m in (64, 32, 16):
        if q_heads % m == 0:
            return m
    raise ValueError(f"SparseCore needs q_heads % 16 == 0, got {q_heads}")


def block_for(heads: int, slots_per_cta: int) -> int:
    """Slots per shared-memory block: 64, or 32 for 64-row CTAs (their query rows take 74 KB)."""
    return min(32 if heads == 64 else 64, slots_per_cta)


def plan(batch: int, q_heads: int, k: int) -> int:
    """slots_per_cta for a launch of `batch` tokens: the largest power of two >= 16 that
    still gives about one wave (>= WAVE CTAs), at most k."""
    groups = q_heads // heads_per_cta(q_heads)
    slots = 16
    while slots * 2 <= k and k % (slots * 2) == 0 and batch * groups * (k // (slots * 2)) >= WAVE:
        slots *= 2
    return slots


def slot_choices(k: int, q_heads: int, max_batch: int = 1024) -> list[int]:
    """Every slots_per_cta `plan` can pick for this shape (the variants to compile)."""
    return sorted({plan(b, q_heads, k) for b in range(1, max_batch + 1)})


def partial_rows(batch: int, q_heads: int, k: int) -> int:
    """Partial-output rows (token x split) a launch of `batch` tokens needs."""
    return batch * (k // plan(batch, q_heads, k))


class SparseCore:
    def __init__(self, q_heads: int, gathered: int, k: int, q_fp8: bool, mla_fp8: bool, softmax_scale: float,
                 slots_per_cta: int, pdl: bool = True):
        if slots_per_cta % 16 or k % slots_per_cta:
            raise ValueError(f"SparseCore needs slots_per_cta % 16 == 0 dividing k, got {slots_per_cta}, k={k}")
        self.q_heads, self.gathered, self.k, self.q_fp8, self.mla_fp8 = q_heads, gathered, k, q_fp8, mla_fp8
        self.softmax_scale, self.slots_per_cta, self.pdl = softmax_scale, slots_per_cta, pdl
        self.heads = heads_per_cta(q_heads)
        self.block = block_for(self.heads, slots_per_cta)
        self.splits = k // slots_per_cta
        self.threads = self.heads // 16 * COLS * 32
        self.q_bytes = ROW * (1 if q_fp8 else 2)
        self.row_bytes = FP8_ROW if mla_fp8 else 2 * ROW

    @cute.jit
    def __call__(self, q_rows: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, partial_o: cute.Pointer,
                 partial_ml: cute.Pointer, out: cute.Pointer, lse: cute.Pointer, batch: Int32, stream: cuda.CUstream):
        self.partial(q_rows, slots, cache, partial_o, partial_ml).launch(
            grid=[self.splits, self.q_heads // self.heads, batch], block=[self.threads, 1, 1], stream=stream,
            use_pdl=self.pdl)
        self.combine(partial_o, partial_ml, out, lse).launch(
            grid=[LATENT // 128, self.gathered, batch], block=[128, 1, 1], stream=stream, use_pdl=self.pdl)

    # -- partial --------------------------------------------------------------------------

    @cute.kernel
    def partial(self, q_rows: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, partial_o: cute.Pointer,
                partial_ml: cute.Pointer):
        tid, _, _ = cute.arch.thread_idx()
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        mt, col = warp // COLS, warp % COLS
        m, block = self.heads, self.block
        smem = cutlass.memory.SmemAllocator()
        q_s = smem.allocate_tensor(Uint8, cute.make_layout(m * STRIDE), byte_alignment=128).iterator
        kv_s = smem.allocate_tensor(Uint8, cute.make_layout((1 if self.mla_fp8 else STAGES) * block * STRIDE),
                                    byte_alignment=128).iterator
        raw_s = kv_s
        if cutlass.const_expr(self.mla_fp8):
            raw_s = smem.allocate_tensor(Uint8, cute.make_layout(STAGES * block * FP8_ROW), byte_alignment=128).iterator
        p_stride = 2 * block + 16
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(m * p_stride), byte_alignment=128).iterator
        ids = smem.allocate_tensor(Int32, cute.make_layout(self.slots_per_cta), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(COLS * m), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        head0 = group * m
        first_slot = token * self.k + split * self.slots_per_cta
        for i in range(tid, self.slots_per_cta, self.threads):
            ids[i] = P.load_i32(slots + first_slot + i)
        self.load_queries(q_rows + (token * self.q_heads + head0) * self.q_bytes, head0, q_s, tid)
        cute.arch.sync_threads()

        # lane -> ldmatrix row address parts (matrix i = lane / 8, row j = lane % 8)
        mi, mj = lane // 8, lane % 8
        a_row, a_col = mj + 8 * (mi % 2), 8 * (mi // 2)  # A tiles: (rows 0-7 | 8-15) x (k 0-7 | 8-15)
        q_lane = q_s + (mt * 16 + a_row) * STRIDE + 2 * a_col
        p_lane = p_s + (mt * 16 + a_row) * p_stride + 2 * a_col
        stage_bytes = block * (FP8_ROW if self.mla_fp8 else STRIDE)
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)

        acc_o = [[Float32(0)] * 4 for _ in range(16)]  # 16 rows x 128 dims: 16 n-tiles of 8
        row_max = [neg_inf, neg_inf]  # rows g, g + 8 (log2 units)
        row_sum = [Float32(0), Float32(0)]  # this thread's share
        self.issue_block(cache, ids, raw_s, 0, tid)
        P.cp_async_commit()
        for b in range(self.slots_per_cta // block):
            if b + 1 < self.slots_per_cta // block:
                self.issue_block(cache, ids, raw_s + (b + 1) % STAGES * stage_bytes, (b + 1) * block, tid)
            P.cp_async_commit()
            P.cp_async_wait(1)  # block b's copies (this thread's) have landed
            cute.arch.sync_threads()
            kv = kv_s + b % STAGES * stage_bytes
            if cutlass.const_expr(self.mla_fp8):
                self.dequantize_block(raw_s + b % STAGES * stage_bytes, kv_s, tid)
                cute.arch.sync_threads()
                kv = kv_s

            # scores: column warp c takes 8-slot tiles c * per .. c * per + per - 1
            per = max(1, block // 8 // COLS)
            scores = [[neg_inf] * 4 for _ in range(per)]
            if col * per < block // 8:
                scores = self.score_tiles(q_lane, kv, col * per, per, lane, mi, mj)
                for j in cutlass.range_constexpr(per):
                    for q in cutlass.range_constexpr(4):
                        live = ids[b * block + (col * per + j) * 8 + 2 * t + q % 2] >= 0
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
                for c in cutlass.range_constexpr(COLS):
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

            # P @ V: this warp's 16 rows x dims 128 col .. + 127
            for n in cutlass.range_constexpr(16):
                for q in cutlass.range_constexpr(4):
                    acc_o[n][q] = acc_o[n][q] * alpha[q // 2]
            v_lane = kv + (mj + 8 * (mi % 2)) * STRIDE + 2 * (128 * col + 8 * (mi // 2))
            for ks in cutlass.range_constexpr(block // 16):
                a = P.ldmatrix_x4(p_lane + 2 * 16 * ks)
                for n2 in cutlass.range_constexpr(8):
                    v = P.ldmatrix_x4_trans(v_lane + 16 * ks * STRIDE + 2 * 16 * n2)
                    acc_o[2 * n2] = P.mma_bf16_16816(a, (v[0], v[1]), acc_o[2 * n2])
                    acc_o[2 * n2 + 1] = P.mma_bf16_16816(a, (v[2], v[3]), acc_o[2 * n2 + 1])
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
            row = (item * self.q_heads + head) * LATENT + 128 * col + 2 * t
            for n in cutlass.range_constexpr(16):
                P.store_f32x2(partial_o + row + 8 * n, acc_o[n][2 * r], acc_o[n][2 * r + 1])
            if col == 0 and t == 0:
                total = Float32(0)
                for c in cutlass.range_constexpr(COLS):
                    total = total + red[c * m + mt * 16 + g + 8 * r]
                P.store_f32x2(partial_ml + 2 * (item * self.q_heads + head), row_max[r], total)

    @cute.jit
    def score_tiles(self, q_lane, kv, first_tile, per: int, lane, mi, mj) -> list:
        """Scores of the M tile's 16 rows x slot tiles first_tile .. + per - 1 (unscaled):
        per tile, c0 c1 = row g, slots 2t, 2t + 1; c2 c3 = row g + 8. Two accumulators per
        tile (even and odd k steps) keep two MMA chains in flight."""
        acc = [[[Float32(0)] * 4 for _ in range(2)] for _ in range(per)]
        k_lane = kv + (first_tile * 8 + mj) * STRIDE + 2 * 8 * mi  # B tiles: 8 slots x 4 x 8 dims
        for kk in cutlass.range_constexpr(ROW // 32):
            a0 = P.ldmatrix_x4(q_lane + 2 * 32 * kk)
            a1 = P.ldmatrix_x4(q_lane + 2 * (32 * kk + 16))
            for j in cutlass.range_constexpr(per):
                b = P.ldmatrix_x4(k_lane + j * 8 * STRIDE + 2 * 32 * kk)
                acc[j][0] = P.mma_bf16_16816(a0, (b[0], b[1]), acc[j][0])
                acc[j][1] = P.mma_bf16_16816(a1, (b[2], b[3]), acc[j][1])
        return [[acc[j][0][q] + acc[j][1][q] for q in range(4)] for j in range(per)]

    @cute.jit
    def issue_block(self, cache, ids, dst, first, tid):
        """cp.async the cache rows of slots ids[first .. first + block) into dst (bf16 rows
        at STRIDE, or raw fp8 rows at FP8_ROW); -1 slots are zero-filled."""
        chunks = BF16_CHUNKS if not self.mla_fp8 else FP8_CHUNKS
        stride = STRIDE if not self.mla_fp8 else FP8_ROW
        total = self.block * chunks
        for i in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
            index = tid + i * self.threads
            if index < total:
                r, c = index // chunks, index % chunks
                slot = ids[first + r]
                src = cache + Int64(cutlass.max(slot, 0)) * self.row_bytes + 16 * c
                P.cp_async_16(dst + r * stride + 16 * c, src, slot >= 0)

    @cute.jit
    def dequantize_block(self, raw, kv, tid):
        """Raw fp8 rows -> bf16 rows: 8 latent dims (e4m3 x its 128-dim scale) or 8 rope
        dims (copied) per item, 72 items per row."""
        total = self.block * BF16_CHUNKS
        for i in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
            index = tid + i * self.threads
            if index < total:
                r, c = index // BF16_CHUNKS, index % BF16_CHUNKS
                src = raw + r * FP8_ROW
                dst = kv + r * STRIDE + 16 * c
                if c < LATENT // 8:
                    words = P.ld_shared_u32x2(src + 8 * c)
                    scale = P.ld_shared_f32(src + LATENT + 4 * (c // 16))
                    out = []
                    for j in cutlass.range_constexpr(2):
                        f = P.unpack_e4m3x4(words[j])
                        out.append(P.pack_bf16x2(f[0] * scale, f[1] * scale))
                        out.append(P.pack_bf16x2(f[2] * scale, f[3] * scale))
                    P.st_shared_u32x4(dst, out)
                else:
                    P.st_shared_u32x4(dst, P.ld_shared_u32x4(src + LATENT + 16 + 16 * (c - LATENT // 8)))

    @cute.jit
    def load_queries(self, rows, head0, q_s, tid):
        """The CTA's query rows -> shared memory as bf16 rows at STRIDE (e4m3 widens
        exactly); rows at or past `gathered` are zeros."""
        if cutlass.const_expr(self.q_fp8):
            for i in range(tid, self.heads * (ROW // 16), self.threads):
                h, c = i // (ROW // 16), i % (ROW // 16)
                live = head0 + h < self.gathered
                words = P.load_u32x4_if(rows + h * self.q_bytes + 16 * c, live)
                out = []
                for j in cutlass.range_constexpr(4):
                    f = P.unpack_e4m3x4(words[j])
                    out.append(P.pack_bf16x2(f[0], f[1]))
                    out.append(P.pack_bf16x2(f[2], f[3]))
                P.st_shared_u32x4(q_s + h * STRIDE + 32 * c, out[:4])
                P.st_shared_u32x4(q_s + h * STRIDE + 32 * c + 16, out[4:])
        else:
            for i in range(tid, self.heads * BF16_CHUNKS, self.threads):
                h, c = i // BF16_CHUNKS, i % BF16_CHUNKS
                words = P.load_u32x4_if(rows + h * self.q_bytes + 16 * c, head0 + h < self.gathered)
                P.st_shared_u32x4(q_s + h * STRIDE + 16 * c, words)

    # -- combine --------------------------------------------------------------------------

    @cute.kernel
    def combine(self, partial_o: cute.Pointer, partial_ml: cute.Pointer, out: cute.Pointer, lse: cute.Pointer):
        tid, _, _ = cute.arch.thread_idx()
        quarter, head, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        smem = cutlass.memory.SmemAllocator()
        weights = smem.allocate_tensor(Float32, cute.make_layout(self.splits), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(4 * 128), byte_alignment=16)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        first = token * self.splits * self.q_heads + head  # split s at first + s x q_heads
        # the global max and the weights 2^(max_s - max), splits over the CTA's threads
        stats = []
        for s0 in cutlass.range_constexpr(0, self.splits, 128):
            live = s0 + tid < self.splits
            ml = P.load_f32x2_if(partial_ml + 2 * (first + cutlass.min(s0 + tid, self.splits - 1) * self.q_heads), live)
            stats.append((P.select(live, ml[0], Float32(-math.inf)), ml[1], live))
        top = Float32(-math.inf)
        for i in cutlass.range_constexpr(len(stats)):
            top = cute.arch.fmax(top, stats[i][0])
        top = self.block_reduce(top, red, lane, warp, True)
        use = P.select(top == Float32(-math.inf), Float32(0), top)
        total = Float32(0)
        for i in cutlass.range_constexpr(len(stats)):
            split_max, split_sum, live = stats[i]
            w = P.exp2_approx(split_max - use)  # 0 for a split with no live slot, or past the splits
            if live:
                weights[128 * i + tid] = w
            total = total + w * split_sum
        total = self.block_reduce(total, red, lane, warp, False)

        # the weighted sum: warp w takes splits w, w + 4, ...; lane l dims 4l .. 4l + 3 of the quarter
        dims = quarter * 128 + 4 * lane
        sums = [Float32(0)] * 4
        in_flight = 8
        for s0 in range(0, self.splits, 4 * in_flight):
            loads = []
            for u in cutlass.range_constexpr(in_flight):
                s = s0 + 4 * u + warp
                live = s < self.splits
                loads.append((P.load_f32x4_if(partial_o + (first + cutlass.min(s, self.splits - 1) * self.q_heads)
                                              * LATENT + dims, live), s, live))
            for u in cutlass.range_constexpr(in_flight):
                words, s, live = loads[u]
                w = P.select(live, weights[cutlass.min(s, self.splits - 1)], Float32(0))
                for d in cutlass.range_constexpr(4):
                    sums[d] = sums[d] + w * words[d]
        for d in cutlass.range_constexpr(4):
            red[warp * 128 + 4 * lane + d] = sums[d]
        cute.arch.sync_threads()
        if warp == 0:
            inverse = P.select(total > Float32(0), Float32(1) / total, Float32(0))
            o = []
            for d in cutlass.range_constexpr(4):
                v = red[4 * lane + d] + red[128 + 4 * lane + d] + red[256 + 4 * lane + d] + red[384 + 4 * lane + d]
                o.append(v * inverse)
            dst = out + (token * self.gathered + head) * LATENT + dims
            P.store_f32x2(dst, o[0], o[1])
            P.store_f32x2(dst + 2, o[2], o[3])
            if quarter == 0 and lane == 0:
                P.store_f32(lse + token * self.gathered + head,
                            P.select(total > Float32(0), (top + cute.math.log2(total)) * Float32(math.log(2.0)),
                                     Float32(-math.inf)))

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
    return (P.gmem_ptr(Uint8), P.gmem_ptr(Int32, align=4), P.gmem_ptr(Uint8), f32, P.gmem_ptr(Float32, align=8), f32,
            P.gmem_ptr(Float32, align=4), Int32(1))
