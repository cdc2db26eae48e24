"""SparseCore's transposed 16-row path (TP 8): wgmma at N = 16, both products turned on their side.

partial_transposed_ws  16 query rows a CTA, 384 threads. Warpgroups 1 and 2 load (and
                       dequantize) each 64-slot block into a bf16 tile in the 64-row paths'
                       no-swizzle layout (sparse_core_wgmma.produce_blocks, one share of the
                       block's rows a warpgroup: fp8 rows loaded a block ahead and dequantized,
                       bf16 rows by cp.async), behind full / empty mbarriers. Warpgroup 0 computes, per block:
- S^T[64 slots, 16 heads] = K Q^T: wgmma m64n16k16, A the block's rows (K-major, as stored),
  B the 16 query rows (K-major: chunk c of row h at c x T_CHUNK + 16 h), 36 k steps;
- each head's max over the block's slots: the 8 lanes of a column by shuffles, the 4 warps
  through shared memory (one named barrier); the online softmax per head (log2 units);
- P^T as bf16 into shared memory, K-major as wgmma's B reads it (chunk c of 8 slots of
  head h at c x T_CHUNK + 16 h), a second named barrier;
- O^T[512 dims, 16 heads] += V^T P^T: 8 m64 tiles of dims x 4 k steps of 16 slots, A = the
  same tile read MN-major (wgmma's transposed A), 64 FP32 accumulators a thread.
The 16-row mma.sync paths (sparse_core_mma.py) widen each fp8 row in every consumer warp
per MMA; here each row is dequantized once, by the producers. Why and what was settled on
the CPU first (the N = 16 atoms, transposed A, the shared-memory budget): docs/levers.md S.12.
Selected by sparse_core.TRANSPOSED_BLOCKS (fp8 rows at 1 .. 8 blocks a CTA).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from . import primitives as P
from .sparse_core_layout import CONSUMER_BAR, LATENT, LOG2E
from .sparse_core_wgmma import CHUNK, DESC_V, TILE_BYTES, TILE_CHUNKS, WG_ROWS, wgmma_scores

T_ROWS = 16  # query rows a CTA: wgmma's N
T_CHUNK = T_ROWS * 16  # bytes between k chunks of the query tile and of P^T
# K-major B at N = 16: 8-row core matrices 128 B apart (SBO), k chunks T_CHUNK apart (LBO)
DESC_N16 = (128 >> 4) << 32 | (T_CHUNK >> 4) << 16
T_TILES = LATENT // 64  # m64 tiles of latent dims in O^T
T_THREADS = 128  # the computing warpgroup
T_PRODUCERS = 2  # producer warpgroups, one share of each block's rows each
T_VALUE_STEPS = WG_ROWS // 16  # k steps of 16 slots a block in P @ V


def wgmma_values_t(acc, v_addr, p_addr) -> list:
    """O^T[512 dims, 16 heads] += V^T (the block's rows read MN-major: wgmma's transposed A,
    m64 tile i of dims at v_addr + 8 i CHUNK) x P^T (K-major B), 4 k steps of 16 slots a
    tile; completed on return. acc: 64 FP32, acc[8 i + 4 j + 2 r + e] = dim 64 i + 16 w + g
    + 8 r, head 8 j + 2 t + e; returned updated."""
    count = len(acc)
    lines = ["{", ".reg .b64 a0, b0, a, b;", ".reg .pred more;"]
    lines += P.smem_desc_lines("a0", f"{{$r{count}}}", DESC_V)
    lines += P.smem_desc_lines("b0", f"{{$r{count + 1}}}", DESC_N16)
    lines += ["setp.eq.b32 more, 0, 0;"] + [f"mov.f32 {{$w{i}}}, {{$r{i}}};" for i in range(count)]
    lines += ["wgmma.fence.sync.aligned;"]
    for i in range(T_TILES):
        d = ", ".join(f"{{$w{8 * i + x}}}" for x in range(8))
        for s in range(T_VALUE_STEPS):
            lines.append(f"add.s64 a, a0, {8 * CHUNK * i + 16 * 16 * s >> 4};")
            lines.append(f"add.s64 b, b0, {2 * T_CHUNK * s >> 4};")
            lines.append(f"wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {{{d}}}, a, b, more, 1, 1, 1, 0;")
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return list(
        cute.arch.inline_ptx(
            "\n\t".join(lines), write_only_types=[Float32] * count, read_only_args=list(acc) + [v_addr, p_addr]
        )
    )


class TransposedPaths:
    """partial_transposed_ws and what it calls (SparseCore's mixin, beside WgmmaPaths, whose
    produce_blocks and load_query_tile it uses)."""

    @cute.jit
    def partial_transposed_ws(self, q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots):
        """16-row CTAs (384 threads): warpgroup 0 computes (consume_transposed), warpgroups 1
        and 2 produce (produce_blocks, share 0 / 1 of each block). Shared memory: the query
        rows (bf16, 18 KB), two bf16 tiles of 64 cache rows (2 x 72 KB), P^T (2 KB), the
        two blocks' slot ids, the heads' cross-warp exchange, four mbarriers: full[s] (the
        256 producer threads arrive after their stores) and empty[s] (lane 0 of each
        consumer warp, after its P @ V over the buffer has completed)."""
        tid, _, _ = cute.arch.thread_idx()
        split, _, token = cute.arch.block_idx()
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        q_s = smem.allocate_tensor(Uint8, cute.make_layout(T_ROWS * TILE_CHUNKS * 16), byte_alignment=128)
        kv_s = smem.allocate_tensor(Uint8, cute.make_layout(2 * TILE_BYTES), byte_alignment=128).iterator.toint()
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(WG_ROWS // 8 * T_CHUNK), byte_alignment=128)
        ids_s = smem.allocate_tensor(Int32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(4 * T_ROWS), byte_alignment=16)
        bars = smem.allocate_tensor(Int64, cute.make_layout(4), byte_alignment=8).iterator.toint()
        full0, empty0 = bars, bars + 16  # full[s] at full0 + 8 s, empty[s] at empty0 + 8 s
        if tid == 0:
            for s in cutlass.range_constexpr(2):
                P.mbar_init(full0 + 8 * s, T_PRODUCERS * 128)
                P.mbar_init(empty0 + 8 * s, T_THREADS // 32)
            P.mbar_init_fence()
        cute.arch.sync_threads()  # the mbarriers are initialized (the CTA's only full barrier)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if warp < T_THREADS // 32:
            self.consume_transposed(
                q_rows,
                q_out,
                out,
                lse,
                partial_o,
                partial_ml,
                q_s.iterator.toint(),
                kv_s,
                p_s.iterator.toint(),
                ids_s,
                red,
                full0,
                empty0,
                tid,
                pool_slots,
            )
        else:
            ptid = tid - T_THREADS
            self.produce_blocks(
                slots, cache, kv_s, ids_s, full0, empty0, ptid % 128, split, token, error, pool_slots, None, ptid // 128
            )

    @cute.jit
    def consume_transposed(
        self, q_rows, q_out, out, lse, partial_o, partial_ml, q_s, kv_s, p_s, ids_s, red, full0, empty0, tid, pool_slots
    ):
        """The computing warpgroup: the query tile, then each block between its full and empty
        mbarriers (transposed_block), then finish_transposed."""
        _, group, token = cute.arch.block_idx()
        lane, w = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        head0 = group * T_ROWS
        rows = q_rows + (token * self.q_heads + head0) * self.q_bytes
        self.load_query_tile(rows, head0, q_s, tid, T_ROWS, T_THREADS)
        P.cp_async_commit()
        P.cp_async_wait(0)
        P.fence_proxy_async()  # generic-proxy shared writes (and cp.async data) -> wgmma
        P.named_sync(CONSUMER_BAR, T_THREADS)
        if cutlass.const_expr(self.publish and self.splits == 1):  # this CTA is its rows' only reader
            self.publish_rows(q_rows, q_out, token, head0, T_ROWS, tid, T_THREADS)

        neg_inf = Float32(-math.inf)
        acc = [Float32(0)] * (T_TILES * 8)
        head_max = [neg_inf] * 4  # heads 8 j + 2 t + e at 2 j + e, log2 units
        head_sum = [Float32(0)] * 4  # this thread's share (its slots)
        blocks = self.slots_per_cta // self.block
        for b in range(blocks):
            s = b % 2
            P.mbar_wait(full0 + 8 * s, (b // 2) % 2)
            if cutlass.const_expr(not self.probing("no_math")):
                head_max, head_sum, acc = self.transposed_block(
                    q_s, kv_s + s * TILE_BYTES, p_s, ids_s, s, red, head_max, head_sum, acc, w, g, t, pool_slots
                )
            if lane == 0:  # this warp's reads of buffer s (its wgmmas, the slot ids) are done
                P.mbar_arrive(empty0 + 8 * s)
        self.finish_transposed(acc, head_max, head_sum, red, out, lse, partial_o, partial_ml, head0, w, g, t)

    @cute.jit
    def transposed_block(self, q_s, cur, p_s, ids_s, s, red, head_max, head_sum, acc, w, g, t, pool_slots):
        """One block (buffer s at cur): S^T, holes -inf, each head's max over the block
        (shuffles over the 8 lanes g of a column, then the 4 warps through `red` at one named
        barrier), the online softmax, P^T as bf16 into p_s, the accumulators rescaled where a
        head's max moved (SKIP_UNMOVED's vote), a second named barrier, O^T += V^T P^T.
        `red` and p_s are rewritten a block later only after both barriers: every thread has
        read this block's `red` before the second and completed its P @ V before the next
        block's first."""
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        sc = wgmma_scores(cur, q_s, T_ROWS, DESC_N16, T_CHUNK)  # S^T: A the block's rows, B the query rows
        for r in cutlass.range_constexpr(2):
            live = P.in_range(ids_s[s * WG_ROWS + 16 * w + g + 8 * r], pool_slots)
            for j in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    sc[4 * j + 2 * r + e] = P.select(live, sc[4 * j + 2 * r + e] * scale, neg_inf)
        for j in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(2):
                top = cute.arch.fmax(sc[4 * j + e], sc[4 * j + 2 + e])
                for offset in (4, 8, 16):  # the lanes of column t
                    top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=offset))
                if g == 0:
                    red[16 * w + 8 * j + 2 * t + e] = top
        P.named_sync(CONSUMER_BAR, T_THREADS)  # every warp's maxima
        use = [Float32(0)] * 4
        alpha = [Float32(0)] * 4
        for j in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(2):
                i = 2 * j + e
                top = head_max[i]
                for v in cutlass.range_constexpr(4):
                    top = cute.arch.fmax(top, red[16 * v + 8 * j + 2 * t + e])
                use[i] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
                alpha[i] = P.exp2_approx(head_max[i] - use[i])
                head_max[i] = top
                head_sum[i] = head_sum[i] * alpha[i]
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    p = P.exp2_approx(sc[4 * j + 2 * r + e] - use[2 * j + e])
                    head_sum[2 * j + e] = head_sum[2 * j + e] + p
                    P.st_shared_bf16(p_s + (2 * w + r) * T_CHUNK + 128 * j + 16 * (2 * t + e) + 2 * g, p)
        acc = self.rescale(acc, alpha, lambda x: 2 * ((x // 4) % 2) + x % 2)  # acc[x]: head 8 j + 2 t + e
        P.fence_proxy_async()  # P^T -> the wgmma
        P.named_sync(CONSUMER_BAR, T_THREADS)  # the block's P^T is in shared memory
        acc = wgmma_values_t(acc, cur, p_s)
        return head_max, head_sum, acc

    @cute.jit
    def finish_transposed(self, acc, head_max, head_sum, red, out, lse, partial_o, partial_ml, head0, w, g, t):
        """Each head's sum over the CTA's slots (the 8 lanes g by shuffles, the 4 warps through
        `red`), then out and lse (one split: normalized here) or the split's partials: thread
        (w, g, t) stores dims 64 i + 16 w + g + 8 r of heads 8 j + 2 t + e."""
        split, _, token = cute.arch.block_idx()
        totals = []
        for i in cutlass.range_constexpr(4):
            total = head_sum[i]
            for offset in (4, 8, 16):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
            totals.append(total)
        # (every thread read the last block's `red` before that block's second barrier)
        if g == 0:
            for j in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    red[16 * w + 8 * j + 2 * t + e] = totals[2 * j + e]
        P.named_sync(CONSUMER_BAR, T_THREADS)
        item = token * self.splits + split
        for j in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(2):
                i = 2 * j + e
                head = head0 + 8 * j + 2 * t + e
                total = red[8 * j + 2 * t + e]
                for v in cutlass.range_constexpr(1, 4):
                    total = total + red[16 * v + 8 * j + 2 * t + e]
                if cutlass.const_expr(self.splits == 1):  # the whole selection: normalize here
                    if head < self.gathered:
                        inverse = self.inverse_of(total)
                        at = out + (token * self.gathered + head) * LATENT + 16 * w + g
                        for x in cutlass.range_constexpr(T_TILES):
                            for r in cutlass.range_constexpr(2):
                                P.store_f32(at + 64 * x + 8 * r, acc[8 * x + 4 * j + 2 * r + e] * inverse)
                        if w == 0 and g == 0:
                            P.store_f32(lse + token * self.gathered + head, self.lse_of(head_max[i], total))
                else:
                    at = partial_o + (item * self.q_heads + head) * LATENT + 16 * w + g
                    for x in cutlass.range_constexpr(T_TILES):
                        for r in cutlass.range_constexpr(2):
                            P.store_f32(at + 64 * x + 8 * r, acc[8 * x + 4 * j + 2 * r + e])
                    if w == 0 and g == 0:
                        P.store_f32x2(partial_ml + 2 * (item * self.q_heads + head), head_max[i], total)
