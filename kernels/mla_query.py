"""MlaQuery: the query side of MLA for one rank, as three PDL-chained kernels.

query_norm_rows / query_norm_tiled
         QueryNorm's own kernel (the variant of this batch) writing q_c where MlaQuery
         reads it: the indexer's q_c buffer in serial mode (store_qc), a private one
         otherwise. Being the same kernel, its q_c is bit-identical to QueryNorm's.
mla_query_project
         (grid: H x 12 m-tiles of 16 Q_B rows, x batch-tile groups; 128 threads)
         holds its 16 rows of Q_B in registers, each warp a quarter of K, and for each
         batch tile of 16 rows runs Q_B on the tensor cores (mma.sync m16n8k16, weights
         as A so the batch is the narrow N side), reduces the four K quarters in a fixed
         order and writes raw q [B, H, 192] fp32 to a workspace. Its first CTAs also do
         the MLA KV insert of the new tokens (kv_a RMSNorm 512 + interleaved-RoPE k_pe 64,
         bf16 or the fp8 656-byte row; slot -1 writes nothing, and a slot outside
         [0, pool_slots) too, recorded in the error word: kernels/guards.py).
mla_query_stream
         (`tokens` 16, 32 or 64: the streamed project, in place of mla_query_project where
         `stream_tokens` says; grid: ceil(B / 8) CTAs of KV inserts, then H x 3 CTAs of 64
         Q_B rows; 256 threads; batch <= tokens) the same q from IndexQuery's streamed GEMM
         core (kernels/projection.py): the CTA's 192 KB of Q_B rows stream once through a
         shared-memory ring of TMA copies (the first stages issued before
         griddepcontrol.wait), q_c's tokens through a ring of their own, each token read
         once per CTA instead of once per MMA; the two k-halves summed in a fixed order
         into an fp32 [token][row] tile, stored to the workspace. The KV insert has CTAs of
         its own (a warp a token), so its dependent reads stay off the rings' schedule.
mla_query_absorb
         (grid: H x 8 latent slices of 64, x batch-tile groups; W_UK slice in registers)
         W_UK absorption of q_nope into the 512-wide latent (weights pre-transposed to
         [H, 512, 128] so K is contiguous), interleaved RoPE of the 64 rope dims, and the
         query rows written in whole 16-byte chunks (bf16 or e4m3) at head rows
         head_base + h of q_rows: under DCP that is the mailbox publish. In a DCP group
         (`targets` = dcp) each chunk is also stored at the same place of every other
         rank's mailbox, `mailbox_offsets` bytes away (peer memory: another tensor of this
         GPU, or another GPU's over P2P). With poll, every
         thread then polls a share of the peers' head rows (its own rank's rows are
         written by this very grid, whose CTAs need not all be resident).

RoPE rows are read at context_lens - 1; a length outside [1, rope_rows] reads row 0 instead
(that token's rows are garbage, in bounds) and is recorded (kernels/guards.py).

mla_query_project and mla_query_absorb hold their weight rows in registers and run the same
16 x 16 tensor-core tile (`held_rows`, `tile_mma`); they bulk-prefetch their weight slices
into L2 before griddepcontrol_wait, so the weight stream starts while the kernel before them
drains. (mla_query_stream, like IndexQuery's wq_b, streams through shared memory instead.)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass.cute.nvgpu import cpasync

from . import guards
from . import primitives as P
from . import projection as J
from .query_norm import QueryNorm

THREADS = 128
BATCH_TILE = 16
QB_TILES = 12  # 192 Q_B rows per head / 16
LATENT_SLICES = 8  # 512 latent / 64
K = 1536
TARGET_CTAS = 528  # ~4 per SM of an H100/H200: batch tiles split over more CTAs up to this
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"q_lora_rank": (K,), "kv_lora_rank": (512,), "qk_nope_dim": (128,), "qk_rope_dim": (64,)}
# mla_query_stream: (weight slots, q_c slots) per `tokens`, IndexQuery's rings (two CTAs an SM)
STREAM_RINGS = {16: (6, 4), 32: (5, 4), 64: (4, 3)}
STREAM_TOKENS = tuple(sorted(STREAM_RINGS))
# The streamed project from this many heads per rank, at batches up to STREAM_TOKENS[-1];
# None: never. 128: TP 1 only. Measured on an H100 (bench/RESULTS.md): session 26, the TP 1 fp8
# step -27.1 / -2.7 / +0.4 / +0.8 us at B = 64 / 16 / 4 / 1 (TP 8: -1.4..+1.1); session 28, once
# its step test (tests/test_step_gpu.py, streamed) had passed, -28.0 / -5.0 / -1.0 / +1.0 us (fork_poll).
STREAM_FROM_HEADS = 128
# mla_query_absorb: True stages each tile's q_nope in shared memory as bf16 once per CTA (a
# 16-byte load per thread per 8 dims, NOPE_PITCH bytes a token: ldmatrix-free B fragments
# without bank conflicts) instead of every warp loading it from the workspace per MMA (4x the
# L2 reads: ~134 MB at TP 1, B = 64). Same bf16 words, same MMAs: bit-identical. Not yet
# measured on a GPU (plan s25_d), so off.
ABSORB_STAGED = False
NOPE_PITCH = 320  # 128 bf16 + 64 bytes: a quarter-warp's 8 fragment loads hit 8 distinct 16-byte bank groups
# The constants a run may change, and the types each takes (graphstep's --knob)
KNOBS = {"STREAM_FROM_HEADS": (int, type(None)), "TARGET_CTAS": int, "ABSORB_STAGED": bool}


def stream_tokens(batch: int, heads: int) -> int:
    """The streamed project's token rows for a launch of `batch` tokens at `heads` heads per
    rank (the smallest of STREAM_TOKENS that holds the batch), or 0: the register kernel."""
    if STREAM_FROM_HEADS is None or heads < STREAM_FROM_HEADS or batch > STREAM_TOKENS[-1]:
        return 0
    return next(t for t in STREAM_TOKENS if batch <= t)


def tile_groups(ctas: int, target: int) -> int:
    """How many CTA rows share the batch tiles when the grid has `ctas` CTAs per row and
    aims at `target` CTAs (TARGET_CTAS, as the op was built with)."""
    return max(1, target // ctas)


def held_rows(weights, stride: int, chunks: int, column, g) -> tuple[list, list]:
    """A thread's share of 16 weight rows (K contiguous, `stride` elements apart), held in
    registers across every batch tile: the 16-byte words at k = column(c), c < chunks, of
    rows g and g + 8 (lo, hi)."""
    lo, hi = [], []
    for c in range(chunks):
        k = column(c)
        lo.append(P.load_u32x4_nc(weights + g * stride + k))
        hi.append(P.load_u32x4_nc(weights + (g + 8) * stride + k))
    return lo, hi


def tile_mma(lo, hi, column, tile, g, batch, token_word) -> list:
    """D[16 rows, 16 tokens of batch tile `tile`] in fp32 on the tensor cores (mma.sync
    m16n8k16, the held rows as A so the batch is the narrow N side). token_word(row, k):
    the 16-byte word (8 bf16) at k of token row `row`; tokens past the batch repeat the last
    one (their columns are discarded). The weight and token words split the same way
    (k 8t..8t+3, then 8t+4..8t+7) over two MMAs."""
    acc = [[Float32(0)] * 4 for _ in range(2)]
    for c in range(len(lo)):
        k = column(c)
        for nt in range(2):
            b = token_word(cutlass.min(tile * BATCH_TILE + nt * 8 + g, batch - 1), k)
            acc[nt] = P.mma_bf16_16816((lo[c][0], hi[c][0], lo[c][1], hi[c][1]), (b[0], b[1]), acc[nt])
            acc[nt] = P.mma_bf16_16816((lo[c][2], hi[c][2], lo[c][3], hi[c][3]), (b[2], b[3]), acc[nt])
    return acc


class MlaQuery:
    def __init__(
        self,
        heads: int,
        head_base: int,
        q_heads: int,
        gathered: int,
        row_stride: int,
        tiled: bool,
        poll: bool,
        q_fp8: bool,
        mla_fp8: bool,
        pdl: bool = True,
        ue8m0: bool = False,
        targets: int = 1,
        tokens: int = 0,
    ):
        """ue8m0: the fp8 MLA cache's scales rounded up to powers of two. targets: the
        mailboxes each chunk is stored into (1: this rank's; dcp: every rank's of a group).
        tokens: 0, the register project kernel (any batch); or 16, 32, 64, the streamed one
        (mla_query_stream) with that many token rows a stage (launch with batch <= tokens)."""
        if tokens and tokens not in STREAM_RINGS:
            raise ValueError(f"MlaQuery's streamed project takes tokens in {STREAM_TOKENS} (or 0), got {tokens}")
        self.heads, self.head_base, self.q_heads, self.gathered = heads, head_base, q_heads, gathered
        self.row_stride, self.tiled, self.poll = row_stride, tiled, poll
        self.q_fp8, self.mla_fp8, self.pdl, self.ue8m0 = q_fp8, mla_fp8, pdl, ue8m0
        self.targets, self.tokens = targets, tokens
        self.staged, self.target_ctas = ABSORB_STAGED, TARGET_CTAS  # (knobs: part of the compile-cache key)
        self.q_bytes = 1 if q_fp8 else 2
        self.row_chunks = 36 * self.q_bytes
        self.norm = QueryNorm(tiled, row_stride, pdl)

    @cute.jit
    def __call__(
        self,
        qkv: cute.Pointer,
        gamma_q: cute.Pointer,
        gamma_kv: cute.Pointer,
        w_qb: cute.Pointer,
        w_uk_t: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        qc: cute.Pointer,
        workspace: cute.Pointer,
        q_rows: cute.Pointer,
        mailbox_offsets: cute.Pointer,
        mla_cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        eps: Float32,
        budget_ns: Int64,
        pool_slots: Int32,
        rope_rows: Int32,
        stream: cuda.CUstream,
    ):
        tiles = (batch + BATCH_TILE - 1) // BATCH_TILE
        self.norm(qkv, gamma_q, qc, batch, eps, stream)
        if cutlass.const_expr(self.tokens):
            # The tensor maps are encoded here, on the host (a graph holds them by value);
            # q_c's holds only the batch's rows (the box's rows past it arrive as zeros).
            w_tma, w_coords = J.tma_atom(cute.make_tensor(w_qb, J.operand_layout(self.heads * 192)), J.ROWS)
            q_tma, q_coords = J.tma_atom(
                cute.make_tensor(qc, J.operand_layout(cutlass.min(batch, self.tokens))), self.tokens
            )
            self.mla_query_stream(
                w_tma, w_coords, q_tma, q_coords, qkv, gamma_kv, cos, sin, context_lens, slots, workspace, mla_cache,
                error, batch, eps, pool_slots, rope_rows,
            ).launch(
                grid=[(batch + J.WARPS - 1) // J.WARPS + self.heads * 192 // J.ROWS, 1, 1],
                block=[J.THREADS, 1, 1],
                stream=stream,
                use_pdl=self.pdl,
                min_blocks_per_mp=2,
                preferred_smem_carveout=100,
            )  # fmt: skip
        else:
            project_ctas = self.heads * QB_TILES
            self.mla_query_project(
                qkv, gamma_kv, w_qb, cos, sin, context_lens, slots, qc, workspace, mla_cache, error, batch, eps,
                pool_slots, rope_rows,
            ).launch(
                grid=[project_ctas, cutlass.min(tiles, tile_groups(project_ctas, self.target_ctas)), 1],
                block=[THREADS, 1, 1],
                stream=stream,
                use_pdl=self.pdl,
            )  # fmt: skip
        absorb_ctas = self.heads * LATENT_SLICES
        self.mla_query_absorb(
            w_uk_t, cos, sin, context_lens, workspace, q_rows, mailbox_offsets, error, batch, budget_ns, rope_rows
        ).launch(
            grid=[absorb_ctas, cutlass.min(tiles, tile_groups(absorb_ctas, self.target_ctas)), 1],
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    # -- project ----------------------------------------------------------------------

    @cute.kernel
    def mla_query_project(
        self,
        qkv: cute.Pointer,
        gamma_kv: cute.Pointer,
        w_qb: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        qc: cute.Pointer,
        workspace: cute.Pointer,
        mla_cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        eps: Float32,
        pool_slots: Int32,
        rope_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        mtile, group, _ = cute.arch.block_idx()
        ctas, groups, _ = cute.arch.grid_dim()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate_tensor(Float32, cute.make_layout(4 * 16 * BATCH_TILE), byte_alignment=16)
        weights = w_qb + mtile * 16 * K
        if tid == 0:
            P.prefetch_l2(weights, 16 * K * 2)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # This warp's quarter of K of the CTA's 16 Q_B rows stays in registers for all of
        # its batch tiles: the weights are read once per CTA row whatever the batch.
        column = lambda c: warp * (K // 4) + 32 * c + 8 * t
        lo, hi = held_rows(weights, K, K // 4 // 32, column, g)

        if group == 0:  # the KV insert, one warp per new token, spread over the CTA row
            for row in range(mtile * 4 + warp, batch, ctas * 4):
                self.kv_insert(
                    qkv, gamma_kv, cos, sin, context_lens, slots, mla_cache, error, row, lane, eps, pool_slots,
                    rope_rows,
                )  # fmt: skip

        for tile in range(group, (batch + BATCH_TILE - 1) // BATCH_TILE, groups):
            # Q_B over this warp's quarter of K, from q_c
            acc = tile_mma(lo, hi, column, tile, g, batch, lambda row, k: P.load_u32x4(qc + row * K + k))
            for nt in cutlass.range_constexpr(2):
                col = nt * 8 + 2 * t
                for q in cutlass.range_constexpr(4):
                    partial[(warp * 16 + g + 8 * (q // 2)) * BATCH_TILE + col + q % 2] = acc[nt][q]
            cute.arch.sync_threads()

            # Fixed-order reduction over the four K quarters; thread -> (token, two rows).
            token, pair = tid % BATCH_TILE, tid // BATCH_TILE
            sums = [Float32(0), Float32(0)]
            for w in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(2):
                    sums[j] = P.add_rn(sums[j], partial[(w * 16 + 2 * pair + j) * BATCH_TILE + token])
            row = tile * BATCH_TILE + token
            if row < batch:
                head, d0 = mtile // QB_TILES, mtile % QB_TILES * 16
                P.store_f32x2(workspace + (row * self.heads + head) * 192 + d0 + 2 * pair, sums[0], sums[1])
            cute.arch.sync_threads()  # the next tile reuses `partial`

    @cute.kernel
    def mla_query_stream(
        self,
        w_tma: cute.CopyAtom,
        w_coords: cute.Tensor,
        q_tma: cute.CopyAtom,
        q_coords: cute.Tensor,
        qkv: cute.Pointer,
        gamma_kv: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        workspace: cute.Pointer,
        mla_cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        eps: Float32,
        pool_slots: Int32,
        rope_rows: Int32,
    ):
        tokens, (w_slots, q_slots) = self.tokens, STREAM_RINGS[self.tokens]
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        # CTAs [0, inserts) do the KV insert, a warp per new token; the rest stream 64 Q_B rows
        # each (`block`): the inserts' dependent reads stay off the rings' schedule
        inserts = (batch + J.WARPS - 1) // J.WARPS
        block = cta - inserts
        smem = cutlass.memory.SmemAllocator()
        s, weights, queries, w_sync, q_sync = J.allocate_rings(
            smem, tokens, w_slots, q_slots, w_tma, w_coords, q_tma, q_coords, block, warp, lane
        )
        if cta < inserts:
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            row = cta * J.WARPS + warp
            if row < batch:
                self.kv_insert(
                    qkv, gamma_kv, cos, sin, context_lens, slots, mla_cache, error, row, lane, eps, pool_slots,
                    rope_rows,
                )  # fmt: skip
        else:
            if warp == 0:
                if lane == 0:
                    cpasync.prefetch_descriptor(w_tma)
                    cpasync.prefetch_descriptor(q_tma)
                    J.init_rings((w_sync, q_sync))
                    P.mbar_init_fence()
                    J.arm_rings((w_sync, q_sync))
            cute.arch.sync_threads()  # the mbarriers are initialized before any copy completes on them
            if warp == 0:  # Q_B never changes within a step: its first stages go out before the wait
                for stage in cutlass.range_constexpr(w_slots):
                    J.issue(weights, stage)
            cute.arch.griddepcontrol_wait()  # q_c comes from the QueryNorm launch before this one
            cute.arch.griddepcontrol_launch_dependents()
            if warp == 0:
                for stage in cutlass.range_constexpr(q_slots):
                    J.issue(queries, stage)
            acc = J.stream_stages(s, weights, queries, w_sync, q_sync, warp, lane)
            out = J.sum_khalves(s, acc, lane)

            # The workspace's q [token, head, 192] fp32: this CTA's rows are dims d0 .. d0 + 63
            # of one head; 16 threads per token, 4 rows each.
            head, d0 = block // 3, block % 3 * J.ROWS
            j, row0 = tid % 16, tid // 16
            for p in cutlass.range_constexpr(tokens // 16):
                token = row0 + 16 * p
                if token < batch:
                    values = P.ld_shared_f32x4(out + token * J.OUT_PITCH + 16 * j)
                    P.store_f32x4(workspace + (token * self.heads + head) * 192 + d0 + 4 * j, values)

    @cute.jit
    def kv_insert(
        self, qkv, gamma_kv, cos, sin, context_lens, slots, mla_cache, error, row, lane, eps, pool_slots, rope_rows
    ):
        """The new token's MLA cache row: kv_a RMSNorm (512) then interleaved-RoPE k_pe (64).
        A slot outside [0, pool_slots) writes nothing (recorded unless -1)."""
        slot = P.load_i32(slots + row)
        if lane == 0 and slot != -1 and not P.in_range(slot, pool_slots):
            P.record_range(error, guards.MLA_QUERY_SLOT, row, slot)
        if P.in_range(slot, pool_slots):
            base = qkv + row * self.row_stride + K
            values, gammas = [], []
            for j in cutlass.range_constexpr(2):
                values += P.unpack_bf16x8(P.load_u32x4(base + 256 * j + 8 * lane))
                gammas += P.unpack_bf16x8(P.load_u32x4_nc(gamma_kv + 256 * j + 8 * lane))
            total = Float32(0)
            for e in cutlass.range_constexpr(16):
                total = P.fma_rn(values[e], values[e], total)
            rr = cute.math.rsqrt(P.warp_sum(total) / Float32(512) + eps)
            latent = [values[e] * rr * gammas[e] for e in range(16)]
            pe = P.unpack_bf16x2(P.load_u32(base + 512 + 2 * lane))
            length = P.load_i32(context_lens + row)
            row_ok = P.in_range(length - 1, rope_rows)
            if lane == 0 and not row_ok:
                P.record_range(error, guards.MLA_QUERY_LENGTH, row, length)
            pos = P.select_i32(row_ok, length - 1, 0)
            c, s = P.load_f32_nc(cos + pos * 32 + lane), P.load_f32_nc(sin + pos * 32 + lane)
            rope = P.pack_bf16x2(pe[0] * c - pe[1] * s, pe[0] * s + pe[1] * c)
            if cutlass.const_expr(self.mla_fp8):
                # mla_cache is a byte pointer in both formats.
                # [512 e4m3 | 4 fp32 scales, one per 128 | 64 bf16 rope] = 656 bytes
                dst = mla_cache + Int64(slot) * 656  # 64-bit: caches pass 2 GiB
                for j in cutlass.range_constexpr(2):
                    amax = Float32(0)
                    for e in cutlass.range_constexpr(8):
                        amax = cute.arch.fmax(amax, cute.math.abs(latent[8 * j + e]))
                    for offset in cutlass.range_constexpr(4):  # the 16 lanes of one 128 block
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=8 >> offset))
                    scale = P.e4m3_scale(amax, self.ue8m0)
                    quads = P.pack_words([latent[8 * j + e] / scale for e in range(8)], True)
                    P.store_u32x2(dst + 256 * j + 8 * lane, quads[0], quads[1])
                    if lane % 16 == 0:
                        P.store_f32(dst + 512 + 4 * (2 * j + lane // 16), scale)
                P.store_u32(dst + 528 + 4 * lane, rope)
            else:
                dst = mla_cache + Int64(slot) * 1152  # bf16 [576]; 64-bit offset
                for j in cutlass.range_constexpr(2):
                    P.store_u32x4(dst + (256 * j + 8 * lane) * 2, P.pack_words(latent[8 * j : 8 * j + 8], False))
                P.store_u32(dst + 1024 + 4 * lane, rope)

    # -- absorb -------------------------------------------------------------------------

    @cute.kernel
    def mla_query_absorb(
        self,
        w_uk_t: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        workspace: cute.Pointer,
        q_rows: cute.Pointer,
        mailbox_offsets: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        budget_ns: Int64,
        rope_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        x, group, _ = cute.arch.block_idx()
        ctas, groups, _ = cute.arch.grid_dim()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        head, part = x // LATENT_SLICES, x % LATENT_SLICES
        smem = cutlass.memory.SmemAllocator()
        out = smem.allocate_tensor(Float32, cute.make_layout(BATCH_TILE * 68), byte_alignment=16)
        nope_s = 0  # staged: the tile's q_nope as bf16, NOPE_PITCH bytes a token
        if cutlass.const_expr(self.staged):
            nope_s = smem.allocate_tensor(Uint8, cute.make_layout(BATCH_TILE * NOPE_PITCH), byte_alignment=16)
            nope_s = nope_s.iterator.toint()
        slice_base = w_uk_t + (head * 512 + part * 64) * 128
        if tid == 0:
            P.prefetch_l2(slice_base, 64 * 128 * 2)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        # where each chunk goes: this rank's mailbox, or every rank's of a group (rank s's
        # mailbox_offsets[s] bytes from this one's; 0 for this rank)
        mailboxes = [q_rows]
        if cutlass.const_expr(self.targets > 1):
            mailboxes = [q_rows + P.load_i64(mailbox_offsets + s) for s in range(self.targets)]

        column = lambda c: 32 * c + 8 * t
        lo, hi = held_rows(slice_base + warp * 16 * 128, 128, 4, column, g)  # this warp's 16 latent rows, all of K
        chunks = 64 * self.q_bytes // 16  # 16-byte chunks per token of this slice (and of the rope)
        for tile in range(group, (batch + BATCH_TILE - 1) // BATCH_TILE, groups):
            # W_UK over q_nope, read from the workspace as bf16
            if cutlass.const_expr(self.staged):
                # thread -> (token tid // 8 of the tile, dims 8 (tid % 8) + 64 h): its two words
                # (a quarter-warp's stores 16 bytes apart: no bank conflict), tokens past the
                # batch as the last one (as tile_mma reads them)
                first = tile * BATCH_TILE
                row = cutlass.min(first + tid // 8, batch - 1)
                for h in cutlass.range_constexpr(2):
                    k = 8 * (tid % 8) + 64 * h
                    P.st_shared_u32x4(nope_s + (tid // 8) * NOPE_PITCH + 2 * k, self.nope_word(workspace, row, head, k))
                cute.arch.sync_threads()
                acc = tile_mma(
                    lo, hi, column, tile, g, batch,
                    lambda row, k: P.ld_shared_u32x4(nope_s + (row - first) * NOPE_PITCH + 2 * k),
                )  # fmt: skip
            else:
                acc = tile_mma(lo, hi, column, tile, g, batch, lambda row, k: self.nope_word(workspace, row, head, k))
            for nt in cutlass.range_constexpr(2):
                for q in cutlass.range_constexpr(4):
                    out[(nt * 8 + 2 * t + q % 2) * 68 + warp * 16 + g + 8 * (q // 2)] = acc[nt][q]
            cute.arch.sync_threads()
            token, chunk = tid // chunks, tid % chunks
            row = tile * BATCH_TILE + token
            if token < BATCH_TILE and row < batch:
                self.publish(
                    cos, sin, context_lens, workspace, mailboxes, error, out, row, token, chunk, head, part, rope_rows
                )
            cute.arch.sync_threads()  # the next tile reuses `out`

        if cutlass.const_expr(self.poll and self.gathered > self.heads):
            P.poll_mailbox(
                q_rows,
                error,
                (group * ctas + x) * THREADS + tid,
                groups * ctas * THREADS,
                batch,
                P.globaltimer() + budget_ns,
                self.gathered,
                self.q_heads,
                self.row_chunks,
                self.head_base,
                self.heads,
                Int32(0),
            )

    def nope_word(self, workspace, row, head, k):
        """The raw q_nope of (token row, head) at k .. k + 7 as one 16-byte bf16 word."""
        src = workspace + (row * self.heads + head) * 192 + k
        return P.pack_words(list(P.load_f32x4(src)) + list(P.load_f32x4(src + 4)), False)

    @cute.jit
    def publish(self, cos, sin, context_lens, workspace, mailboxes, error, out, row, token, chunk, head, part, rows):
        """One whole 16-byte chunk of a query row into every mailbox: this slice's latent
        and, in slice 0, the rope."""
        per_chunk = 16 // self.q_bytes
        at = ((row * self.q_heads + self.head_base + head) * 576) * self.q_bytes
        latent = P.pack_words([out[token * 68 + chunk * per_chunk + e] for e in range(per_chunk)], self.q_fp8)
        for i in cutlass.range_constexpr(self.targets):
            P.store_u32x4(mailboxes[i] + at + (part * 64 + chunk * per_chunk) * self.q_bytes, latent)
        if part == 0:
            src = workspace + (row * self.heads + head) * 192 + 128 + chunk * per_chunk
            raw = []
            for i in cutlass.range_constexpr(per_chunk // 4):
                raw += list(P.load_f32x4(src + 4 * i))
            length = P.load_i32(context_lens + row)
            row_ok = P.in_range(length - 1, rows)
            if head == 0 and chunk == 0 and not row_ok:  # one record per token
                P.record_range(error, guards.MLA_QUERY_LENGTH, row, length)
            pos = P.select_i32(row_ok, length - 1, 0)
            first = chunk * per_chunk // 2  # first rope pair of this chunk
            cs = []
            for i in cutlass.range_constexpr(per_chunk // 8):
                cs.append(
                    (P.load_f32x4_nc(cos + pos * 32 + first + 4 * i), P.load_f32x4_nc(sin + pos * 32 + first + 4 * i))
                )
            rope = []
            for p in cutlass.range_constexpr(per_chunk // 2):
                c, s = cs[p // 4][0][p % 4], cs[p // 4][1][p % 4]
                even, odd = raw[2 * p], raw[2 * p + 1]
                rope += [even * c - odd * s, even * s + odd * c]
            rope = P.pack_words(rope, self.q_fp8)
            for i in cutlass.range_constexpr(self.targets):
                P.store_u32x4(mailboxes[i] + at + (512 + chunk * per_chunk) * self.q_bytes, rope)


def compile_args():
    bf16 = P.gmem_ptr(BFloat16)
    f32 = P.gmem_ptr(Float32)
    i32 = P.gmem_ptr(Int32, align=4)
    return (
        bf16,
        bf16,
        bf16,
        bf16,
        bf16,
        f32,
        f32,
        i32,
        i32,
        bf16,
        f32,
        P.gmem_ptr(Uint8),
        P.gmem_ptr(Int64, align=8),
        P.gmem_ptr(Uint8),
        P.gmem_ptr(Int32, align=8),
        Int32(1),
        Float32(1e-6),
        Int64(1),
        Int32(1),
        Int32(1),
    )
