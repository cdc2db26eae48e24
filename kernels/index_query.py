"""IndexQuery: the indexer's wq_b, NeoX RoPE, the Hadamard rotation (`hadamard`), per-(token,
head) e4m3 and the folded head weights in one kernel, reading the 25 MB of wq_b once in one wave.

grid     128 CTAs in clusters of 2: cluster = one of the 64 heads, CTA rank r = its rows
         64 r .. 64 r + 63 (head dims 0-63 carry the RoPE, 64-127 do not), 256 threads,
         112 KB of shared memory (`shared_bytes`) and <= 128 registers: two CTAs fit an SM,
         so the next kernel's CTAs (two of DsaIndex's) can already sit beside one and issue
         their own loads.
project  kernels/projection.py: the CTA's 192 KB of weight rows stream through a ring of
         128-column stages and q_c's tokens through a shallower ring of their own, each
         stage of an operand filled by one TMA tensor copy (128-byte swizzle) that warp 0
         issues onto the slot's full mbarrier (ldmatrix, mma.sync with the tokens as N);
         the weight ring's copies go out before griddepcontrol.wait, q_c's after it. The
         tensor maps are encoded by the launch's host code (`__call__`), so a CUDA graph
         holds them by value.
finish   in the same CTA: the fp32 [token][64 rows] tile in shared memory; 16 threads per
         token take 4 rows each: RoPE on rank 0 (pair (i, i + 32): threads j and j ^ 8),
         |max| over the 16 threads, the two CTAs swap their halves' maxima through
         distributed shared memory (one cluster barrier), then scale = max(amax, 1e-4) /
         448 (with `ue8m0` rounded up to a power of two), values / scale as saturated
         e4m3, and rank 0 writes the head weight w = weights_proj * heads^-0.5 * scale *
         dim^-0.5 (DeepSeek-V3.2's folding). Its global reads (the lengths, their RoPE
         rows, the logits of w) go out right after the PDL wait at <= 32 tokens
         (`EARLY_READS`), so the dependent round trips (a length, then its row) pass under
         the weight stream rather than after the last MMA.
rotation with `hadamard`, DeepSeek-V3.2's Hadamard rotation of the head after RoPE: the
         transform's stages over the CTA's 64 dims in the thread and across the token's
         16 threads (16 shuffles), then the last stage (dim i with i + 64) across the
         cluster with no cluster barrier but the start's (its relaxed arrive after the PDL
         wait, its wait here): once a CTA's threads have read its tile (a CTA barrier), one
         thread arrives remotely (release) on the peer's `free` mbarrier; each thread waits on
         its own `free` (the peer's tile read), pushes its half into the peer's tile (16-byte
         st.async onto the peer's `ready` mbarrier, armed at the start for all the pushes'
         bytes) and waits on its own `ready`. Every remote access into a CTA lands before its
         `ready` completes, so either may exit after it. Both compute all 128 outputs' |max|
         alike, so the maxima need no swap. (Before: two cluster barriers, each ~0.2-0.4 us of
         MEMBAR.ALL.GPU and cluster arrive / wait, docs/levers.md L.1 and L.4 C2.)

RoPE rows are read at context_lens - 1; a length outside [1, rope_rows] reads row 0 (that
token's query is garbage, in bounds) and is recorded for token first_token + t
(kernels/guards.py; first_token: where this launch's chunk of the batch starts).

A variant holds `tokens` (16, 32 or 64) token rows per stage; the host picks the smallest that
holds the batch and launches a batch above 64 in chunks of 64 (`launches`).

The rings' depths (`RINGS`): the weights are the bytes that must stream from HBM (~2 us a
round trip under load by session 10's ring times), q_c a few KB from L2. With one ring of
both (session 10: 5 / 4 / 3 slots) the 16-token variant kept 4 weight stages in flight and
its 12 stages took two HBM round trips after the PDL wait (stages 5-9, then 10-11). Each
variant now gives the weights every KB the two-CTA limit leaves beyond a q_c ring as deep as
session 10's at 32 / 64 tokens (4 slots at 16): 6 / 5 / 4 weight slots (96 / 80 / 64 KB
before the wait; 16 tokens: the 6 remaining stages all go out in the first pass after it,
one round trip). Resident q_c rows (48 KB at 16 tokens) would leave 4 weight slots.
Their MMA order is the one ring's, and the outputs were bit-identical to it on the H200
(session 12, bench/ab_index_query.py at B = 1 / 4 / 16 / 32 / 64): 10.57 / 10.47 / 10.10 /
11.06 / 13.39 us against the one ring's 10.76 / 10.46 / 10.31 / 11.21 / 14.34, a tenth of the
gain predicted, so bytes in flight are not what holds the kernel at 55-58% of 4.3 TB/s (ncu at
B = 1: 12.4% achieved occupancy, DRAM 40-43%; docs/levers.md Part G). The whole slab in flight
before the wait (12 weight slots, 213 KB, one CTA an SM) was 0.4-0.6 us faster alone but 1.1-3.6
us slower in the step at B <= 16 (session 45, H100): nothing else fits beside it, so the two-CTA
limit stays (docs/levers.md Part W).
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

HEADS, DIM, ROPE = 64, 128, 64
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"index_heads": (HEADS,), "index_dim": (DIM,), "index_rope_dim": (ROPE,), "q_lora_rank": (J.K,)}
# (weight slots, q_c slots) per variant: 96 + 16 / 80 + 32 / 64 + 48 KB of shared memory
RINGS = {16: (6, 4), 32: (5, 4), 64: (4, 3)}
TOKENS = tuple(sorted(RINGS))
EARLY_READS = 32  # the variants up to this many tokens read the epilogue's inputs before the rings


def shared_bytes(tokens: int, hadamard: bool, rings: tuple[int, int] | None = None) -> int:
    """The CTA's shared memory as the kernel allocates it (each ring 1024-byte aligned and a
    multiple of 1 KB): both rings, their full and empty mbarriers, and without the rotation
    the peer CTA's maxima, with it the two mbarriers of its exchange."""
    w_ring, q_ring = rings or RINGS[tokens]
    return J.ring_bytes(tokens, w_ring, q_ring) + 16 * (w_ring + q_ring) + (16 if hadamard else 4 * tokens)


def launches(batch: int) -> list[tuple[int, int, int]]:
    """How the host runs `batch` tokens: (first token, tokens, variant) per launch, the
    smallest variant that holds each chunk of at most 64 tokens."""
    out = []
    for start in range(0, batch, TOKENS[-1]):
        rows = min(TOKENS[-1], batch - start)
        out.append((start, rows, next(t for t in TOKENS if rows <= t)))
    return out


# -- cluster primitives -----------------------------------------------------------------


class IndexQuery:
    def __init__(
        self,
        row_stride: int,
        weights_column: int,
        tokens: int = 16,
        pdl: bool = True,
        hadamard: bool = False,
        ue8m0: bool = False,
        rings: tuple[int, int] | None = None,
    ):
        """row_stride: elements per packed qkv row; weights_column: where idx_w starts in
        it; tokens: token rows per stage (a key of RINGS); launch with batch <= tokens;
        hadamard: rotate each head before quantizing it; ue8m0: power-of-two scales;
        rings: (weight slots, q_c slots), RINGS[tokens] unless given (any depths >= 2 give
        the same outputs: the GPU tests compare session 10's single ring depths)."""
        if tokens not in RINGS:
            raise ValueError(f"tokens must be one of {TOKENS}, got {tokens}")
        self.row_stride, self.weights_column, self.tokens, self.pdl = row_stride, weights_column, tokens, pdl
        self.hadamard, self.ue8m0, self.rings = hadamard, ue8m0, rings or RINGS[tokens]

    @cute.jit
    def __call__(
        self,
        qc: cute.Pointer,
        wq_b: cute.Pointer,
        qkv: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        q_out: cute.Pointer,
        w_out: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        rope_rows: Int32,
        first_token: Int32,
        stream: cuda.CUstream,
    ):
        # The TMA descriptors (tensor maps) are encoded here, on the host, at each call: a
        # graph captures them by value with the launch, so a replay pays nothing. q_c's map
        # holds only the batch's rows (the box's rows past it arrive as zeros).
        w_tma, w_coords = J.tma_atom(cute.make_tensor(wq_b, J.operand_layout(HEADS * DIM)), J.ROWS)
        q_rows = cutlass.min(batch, self.tokens)
        q_tma, q_coords = J.tma_atom(cute.make_tensor(qc, J.operand_layout(q_rows)), self.tokens)
        self.index_query(
            w_tma,
            w_coords,
            q_tma,
            q_coords,
            qkv,
            cos,
            sin,
            context_lens,
            q_out,
            w_out,
            error,
            batch,
            rope_rows,
            first_token,
        ).launch(
            grid=[2 * HEADS, 1, 1],
            block=[J.THREADS, 1, 1],
            cluster=[2, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
            min_blocks_per_mp=2,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def index_query(
        self,
        w_tma: cute.CopyAtom,
        w_coords: cute.Tensor,
        q_tma: cute.CopyAtom,
        q_coords: cute.Tensor,
        qkv: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        q_out: cute.Pointer,
        w_out: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        rope_rows: Int32,
        first_token: Int32,
    ):
        tokens, (w_slots, q_slots) = self.tokens, self.rings
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        head, rank = cta // 2, cta % 2  # the cluster is (2, 1, 1): rank = cta % 2
        smem = cutlass.memory.SmemAllocator()
        # per ring: (slots, its full mbarriers' address, its empty ones', the bytes of a fill)
        s, weights, queries, w_sync, q_sync = J.allocate_rings(
            smem, tokens, w_slots, q_slots, w_tma, w_coords, q_tma, q_coords, cta, warp, lane
        )
        if cutlass.const_expr(not self.hadamard):
            peer_amax = smem.allocate_tensor(Float32, cute.make_layout(tokens), byte_alignment=16)
        else:  # the rotation's exchange: the peer's tile read (`free`), the peer's half landed (`ready`)
            swap = smem.allocate_tensor(Int64, cute.make_layout(2), byte_alignment=8)
        if cutlass.const_expr(not self.hadamard):
            cute.arch.cluster_arrive_relaxed(aligned=True)  # waited on before the first store into the peer CTA

        # Warp 0 produces: lane 0 initializes the barriers and arms each fill (one arrival
        # expecting the operand's bytes); the copies are cute.copy's, which issues each from
        # one elected lane (elect.sync: the whole warp must reach it). Weights never change
        # within a step, so the weight ring's stages go out before the wait, q_c's after it.
        if warp == 0:
            if lane == 0:
                cpasync.prefetch_descriptor(w_tma)
                cpasync.prefetch_descriptor(q_tma)
                J.init_rings((w_sync, q_sync))
                if cutlass.const_expr(self.hadamard):
                    P.mbar_init(swap.iterator.toint(), 1)
                    P.mbar_init(swap.iterator.toint() + 8, 1)
                P.mbar_init_fence()
                J.arm_rings((w_sync, q_sync))
                if cutlass.const_expr(self.hadamard):  # armed before any push can land: no negative tx count
                    P.mbar_expect(swap.iterator.toint() + 8, Int32(tokens * J.ROWS * 4))
        # the mbarriers are initialized before anyone waits on them or a copy completes on
        # them (init, fence, CTA barrier, then the copies: CUTLASS's and DsaIndex's order)
        cute.arch.sync_threads()
        if warp == 0:
            for stage in cutlass.range_constexpr(w_slots):
                J.issue(weights, stage)
        cute.arch.griddepcontrol_wait()  # q_c, context_lens and qkv come from earlier kernels
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.hadamard):
            # publishes the swap mbarriers (initialized and fenced above); waited on in the epilogue
            cute.arch.cluster_arrive_relaxed(aligned=True)
        ntok = cutlass.min(batch, tokens)
        if warp == 0:
            for stage in cutlass.range_constexpr(q_slots):
                J.issue(queries, stage)
        # Up to 32 tokens the epilogue's global reads go out here (2 x 11 registers at most
        # held through the rings), so their dependent latencies (length, then its RoPE row)
        # pass under the stream instead of after the last MMA; 64 tokens would need 44.
        j, row0 = tid % 16, tid // 16
        if cutlass.const_expr(tokens <= EARLY_READS):
            reads = self.epilogue_reads(row0, ntok, j, head, qkv, cos, sin, context_lens, rope_rows)

        acc = J.stream_stages(s, weights, queries, w_sync, q_sync, warp, lane)
        out = J.sum_khalves(s, acc, lane)

        # Epilogue: 16 threads per token, thread j holds rows 4 j .. 4 j + 3.
        if cutlass.const_expr(tokens > EARLY_READS):
            reads = self.epilogue_reads(row0, ntok, j, head, qkv, cos, sin, context_lens, rope_rows)
        values, amaxes = [], []
        for p in cutlass.range_constexpr(tokens // 16):
            token = row0 + 16 * p
            v = list(P.ld_shared_f32x4(out + token * J.OUT_PITCH + 16 * j))
            partner = [cute.arch.shuffle_sync_bfly(v[q], offset=8) for q in range(4)]
            length, row_ok, c, sn, _ = reads[p]
            if cta == 0 and j == 0 and token < ntok and not row_ok:  # one record per token
                P.record_range(error, guards.INDEX_QUERY_LENGTH, first_token + token, length)
            first = [v[q] * c[q] - partner[q] * sn[q] for q in range(4)]
            second = [partner[q] * sn[q] + v[q] * c[q] for q in range(4)]
            v = [P.select(rank == 0, P.select(j < 8, first[q], second[q]), v[q]) for q in range(4)]
            if cutlass.const_expr(self.hadamard):
                v = P.hadamard_lanes(v, j, (1, 2, 4, 8))  # dims 64 rank .. 64 rank + 63
            else:
                amax = cute.arch.fmax(
                    cute.arch.fmax(cute.math.abs(v[0]), cute.math.abs(v[1])),
                    cute.arch.fmax(cute.math.abs(v[2]), cute.math.abs(v[3])),
                )
                for offset in (8, 4, 2, 1):  # the 16 threads of this token
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
                amaxes.append(amax)
            values.append(v)

        if cutlass.const_expr(self.hadamard):
            free, ready = swap.iterator.toint(), swap.iterator.toint() + 8
            cute.arch.sync_threads()  # this CTA's tile is read (into values)
            cute.arch.cluster_wait()  # the peer's swap mbarriers are initialized
            if tid == 0:
                # the peer may overwrite this CTA's tile: release at CTA scope (the tile's reads are
                # complete, their values in registers, before the CTA barrier above); at cluster scope
                # the rotated IndexQuery took 0.3-0.5 us more (session 30, H100)
                P.mbar_arrive_remote(free, 1 - rank)
            P.mbar_wait(free, 0, cluster=True)  # the peer's tile is read
            for p in cutlass.range_constexpr(tokens // 16):
                at = out + (row0 + 16 * p) * J.OUT_PITCH + 16 * j
                P.dsmem_push_u32x4(at, 1 - rank, values[p], ready)
            # the peer's half is in: every remote access into this CTA (the peer's arrival, its
            # pushes) is done, so it may exit whenever; no shared access crosses CTAs after this
            P.mbar_wait(ready, 0, cluster=True)
            sign = P.select(rank == 0, Float32(1.0), Float32(-1.0))
            for p in cutlass.range_constexpr(tokens // 16):
                own = values[p]
                peer = P.ld_shared_f32x4(out + (row0 + 16 * p) * J.OUT_PITCH + 16 * j)
                # the last stage: a + b on rank 0, a - b on rank 1 (a: rank 0's dim), and the
                # other rank's output for the head's |max|
                mine = [P.mul_rn(P.fma_rn(own[q], sign, peer[q]), Float32(P.HADAMARD_SCALE)) for q in range(4)]
                other = [P.mul_rn(P.fma_rn(peer[q], -sign, own[q]), Float32(P.HADAMARD_SCALE)) for q in range(4)]
                amax = cute.arch.fmax(cute.math.abs(mine[0]), cute.math.abs(other[0]))
                for q in cutlass.range_constexpr(1, 4):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(cute.math.abs(mine[q]), cute.math.abs(other[q])))
                for offset in (8, 4, 2, 1):  # the 16 threads of this token
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
                values[p] = mine
                amaxes.append(amax)
        else:
            peer_base = peer_amax.iterator.toint()
            cute.arch.cluster_wait()  # the peer CTA is running: its shared memory may be written
            if j == 0:
                for p in cutlass.range_constexpr(tokens // 16):
                    P.dsmem_store(peer_base + 4 * (row0 + 16 * p), 1 - rank, Float32, [amaxes[p]])
            cute.arch.cluster_arrive(aligned=True)
            cute.arch.cluster_wait()  # both halves' maxima are in; no shared access crosses CTAs after this

        for p in cutlass.range_constexpr(tokens // 16):
            token = row0 + 16 * p
            v = values[p]
            amax = amaxes[p]
            if cutlass.const_expr(not self.hadamard):
                amax = cute.arch.fmax(amax, P.ld_shared_f32(peer_base + 4 * token))
            scale = P.e4m3_scale(amax, self.ue8m0)
            word = P.pack_e4m3x4(v[0] / scale, v[1] / scale, v[2] / scale, v[3] / scale)
            if token < ntok:
                item = token * HEADS + head
                P.store_u32(q_out + item * DIM + J.ROWS * rank + 4 * j, word)
                if rank + j == 0:  # rank 0, thread 0 of the token
                    raw = P.unpack_bf16x2(reads[p][4])
                    proj = P.select(head % 2 == 0, raw[0], raw[1])
                    P.store_f32(w_out + item, proj * Float32(HEADS**-0.5) * scale * Float32(DIM**-0.5))

    def epilogue_reads(self, row0, ntok, j, head, qkv, cos, sin, context_lens, rope_rows) -> list:
        """What thread j of each of its tokens' 16 (row0 + 16 p) reads from global memory (a
        token past the batch reads the batch's last one's), the lengths first: per token
        (length, whether length - 1 is a RoPE row, the 4 cos and 4 sin of that row (row 0
        where it is not) for its dims, the bf16 pair of head-weight logits holding the head's)."""
        rows = [cutlass.min(row0 + 16 * p, ntok - 1) for p in range(self.tokens // 16)]
        lengths = [P.load_i32(context_lens + row) for row in rows]
        out = []
        for row, length in zip(rows, lengths):
            row_ok = P.in_range(length - 1, rope_rows)
            pos = P.select_i32(row_ok, length - 1, 0)
            c = P.load_f32x4_nc(cos + pos * 32 + 4 * (j % 8))
            sn = P.load_f32x4_nc(sin + pos * 32 + 4 * (j % 8))
            logit = P.load_u32(qkv + row * self.row_stride + self.weights_column + head // 2 * 2)
            out.append((length, row_ok, c, sn, logit))
        return out


def compile_args():
    bf16, f32 = P.gmem_ptr(BFloat16), P.gmem_ptr(Float32)
    i32, error = P.gmem_ptr(Int32, align=4), P.gmem_ptr(Int32, align=8)
    return (bf16, bf16, bf16, f32, f32, i32, P.gmem_ptr(Uint8), f32, error, Int32(1), Int32(1), Int32(0))
