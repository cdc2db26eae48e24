"""SparseCore's 16- and 32-row partial paths (TP 8; DCP 2 at TP 8): warps of mma.sync m16n8k16.

FP32 accumulators, one 16-row M tile per row of warps, COLS column warps per tile; warp
(mt, c) scores the block's 8-slot tiles c x per .. c x per + per - 1 and owns latent dims
512 / COLS x [c, c + 1) of P @ V, rescaled when the row max moves.

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
                  partial score and to P (f16, consume_ring). With 2 .. CLUSTER_SPLITS splits
                  a token's split CTAs combine in their cluster (cluster_combine).

`SparseCore` (kernels/sparse_core.py) takes these methods as a mixin and picks the path (its
knobs, MMA_PRODUCER_BLOCKS, MMA_BULK_SIXTEENTHS and CLUSTER_SPLITS, are its module's); what
bounds them and why each default is what it is: docs/levers.md Part S.1-S.4.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32

from . import guards
from . import primitives as P
from .sparse_core_layout import (
    BF16_CHUNKS,
    CONSUMER_BAR,
    FP8_CHUNKS,
    FP8_ROW,
    K_STEPS,
    LATENT,
    LOG2E,
    PRODUCER_THREADS,
    ROW,
    SMEM_BYTES,
    STRIDE,
)

# Column warps per 16-row M tile, 64 latent dims each.
COLS = 8
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


class MmaPaths:
    """partial_mma_sync and partial_mma_ws with what they call (SparseCore's mixin: the
    configuration they read is SparseCore's, set in its constructor)."""

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
            if cutlass.const_expr(self.probing("no_loads")):  # nothing copied, every block computed
                flag, nbytes = Int32(1), Int32(0)
            if lane == 0:
                live_s[s] = flag
                P.mbar_expect(full0 + 8 * s, nbytes)
            else:
                P.mbar_arrive(full0 + 8 * s)
            cute.arch.sync_warp()  # the bytes are expected before any lane's copies land
            if cutlass.const_expr(not self.probing("no_loads")):
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
            if cutlass.const_expr(not self.probing("no_loads")):
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
            if cutlass.const_expr(not self.probing("no_math")):
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
