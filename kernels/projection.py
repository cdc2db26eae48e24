"""The streamed decode-batch GEMM core of the indexer's wq_b (IndexQuery) and of MlaQuery's
streamed Q_B (mla_query_stream): a CTA owns 64 weight rows (192 KB of bf16: half of an
indexer head, a third of an MLA head) over the whole K = 1536 and computes
out[row, token] = W[row, :] . q_c[token, :] for up to `tokens` tokens on the tensor cores.

The weights stream once through a shared-memory ring of `w_ring` stages of 128 k-columns,
the tokens through a ring of their own of `q_ring` stages: the weights come from HBM and may
all be in flight before the PDL wait, the tokens come from L2 after it, so the weights get
the deeper ring (a slot holding both would spend the tokens' bytes on weight depth).
Warp 0 fills a stage of an operand with one TMA tensor copy (issued by one elected lane)
(`cp.async.bulk.tensor.3d`): the weights' box is 64 columns x 64 rows x 2 column blocks
(16 KB), the tokens' 64 x `tokens` x 2, both with the 128-byte swizzle (the swizzle bounds a box row to 128 bytes,
hence the third dimension: [column block][row][64 columns], each 128-byte row's 16-byte
chunk c stored at chunk c ^ (row % 8)). So a stage costs one instruction per operand
instead of 16-byte cp.async copies by every thread (the ring was latency bound on those,
bench/RESULTS.md), and the 8 row addresses of an `ldmatrix` still fall in 8 distinct
16-byte bank groups without a padded pitch. Rows of q_c past the batch are outside the
tokens' tensor map and arrive as zeros.

Synchronization, per ring: a full mbarrier per slot (one arrival: lane 0's expect_tx of the
operand's bytes) and an empty one (every thread arrives after its fragments of the stage
are read, behind `fence.proxy.async`: the copy that refills the slot is an async-proxy
write). Only warp 0 waits on an empty barrier, so the other warps run on through the
stages already in the rings instead of meeting at a CTA barrier every stage (`refill`,
`released`, `parity`: the schedule, the same function of each ring's depth).

Compute: 8 warps = 4 m-tiles of 16 rows x 2 k-halves of each stage (a k-half is one
column block of the box); `mma.sync m16n8k16` with the weights as A (ldmatrix.x4) and the
tokens as the narrow N side (ldmatrix.x4 gives two k-steps of one 8-token n-tile). The two
k-halves' fp32 sums add in a fixed order (half 0 + half 1) into an fp32 [token][row] tile
in shared memory (reusing the weight ring), so results do not depend on scheduling.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import primitives as P

THREADS = 256
WARPS = THREADS // 32
K = 1536
KC = 128  # k-columns per stage
STAGES = K // KC  # 12
ROWS = 64  # weight rows per CTA
BLOCK = 64  # k-columns per 128-byte swizzled row (the box's inner dimension)
ROW_BYTES = BLOCK * 2
OUT_PITCH = ROWS * 4 + 16  # bytes per token in the fp32 [token][row] result tile


def operand_bytes(rows: int) -> int:
    """One stage of `rows` rows: 2 column blocks x rows x 128 bytes."""
    return rows * KC * 2


def ring_bytes(tokens: int, w_ring: int, q_ring: int) -> int:
    """Both rings: `w_ring` weight stages, then `q_ring` token stages."""
    return w_ring * operand_bytes(ROWS) + q_ring * operand_bytes(tokens)


def swizzle(offset: int) -> int:
    """The byte a TMA copy with the 128-byte swizzle (CU_TENSOR_MAP_SWIZZLE_128B) puts logical
    byte `offset` of its box at, from a 1024-byte aligned base: 16-byte chunk bits 4-6 XOR
    bits 7-9 (the row within 8 rows of 128 bytes)."""
    return offset ^ ((offset >> 3) & 0x70)


# -- TMA (host side: the tensor maps; device side: the copies) -----------------------------


def operand_layout(rows):
    """A row-major [rows, K] bf16 operand seen as (rows, (64 columns, 24 column blocks)): the
    column blocks become the box's third dimension (a swizzled box row is <= 128 bytes)."""
    return cute.make_layout((rows, (BLOCK, K // BLOCK)), stride=(K, (1, BLOCK)))


def stage_layout(rows: int, ring: int | None = None):
    """Shared layout of one stage (or `ring` stages) of `rows` rows: 128-byte swizzle atoms
    of 8 rows x 64 columns, column block outermost within a stage."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    if ring is None:
        return cute.tile_to_shape(atom, (rows, KC), (0, 1))
    return cute.tile_to_shape(atom, (rows, KC, ring), (0, 1, 2))


def tma_atom(gmem, rows: int):
    """The TMA load atom and coordinate tensor of an operand_layout tensor, one box = one
    stage of `rows` rows (the descriptor is built by the host code of the launch)."""
    info = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), gmem, stage_layout(rows), (rows, (BLOCK, KC // BLOCK))
    )
    return info.atom, info.tma_tensor


class Copies:
    """One operand's TMA copies into its ring: stage s of row block `block` into slot s % ring,
    completing on that slot's full mbarrier (bars: the ring's first full mbarrier's pointer)."""

    def __init__(self, atom, coords, ring_tensor, rows: int, block, bars):
        tiles = cute.local_tile(coords, (rows, (BLOCK, KC // BLOCK)), (block, (0, None)))
        self.dst, self.src = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(ring_tensor, 0, 2), cute.group_modes(tiles, 0, 2)
        )
        self.atom, self.bars, self.ring = atom, bars, cute.size(ring_tensor, mode=[2])


def issue(copies: Copies, stage: int):
    """One TMA copy: stage `stage` of the operand into its slot. (A function, not a method:
    CuTe DSL carries an object whose method a dynamic `if` calls as a runtime value.)"""
    slot = stage % copies.ring
    cute.copy(copies.atom, copies.src[(None, stage)], copies.dst[(None, slot)], tma_bar_ptr=copies.bars + slot)


# -- the stream -----------------------------------------------------------------------


class Stream:
    """One CTA's view of the rings: per-thread fragment offsets, fixed at start.

    tokens: the token rows of a stage (a multiple of 16); w_ring, q_ring: the rings' slots
    (>= 2 each); w_base, q_base: 32-bit shared addresses of the weight and token rings
    (1024-byte aligned)."""

    def __init__(self, tokens: int, w_ring: int, q_ring: int, w_base, q_base, warp, lane):
        assert tokens % 16 == 0 and w_ring >= 2 and q_ring >= 2
        self.tokens, self.w_ring, self.q_ring, self.w_base, self.q_base = tokens, w_ring, q_ring, w_base, q_base
        mtile, khalf = warp % 4, warp // 4
        # ldmatrix row addresses of this lane: A rows 16 mtile + lane % 8 (+ 8), logical
        # chunk lane // 16 (+ 2 for the second k-step, + 4 per k-step pair); B token rows
        # lane % 8 (+ 8 per n-tile), chunk lane // 8 (+ 4 per pair). Row % 8 = lane % 8 in
        # both, and the added chunk bits are disjoint from the lane's, so each address is
        # the lane's swizzled chunk XOR a constant.
        a_row = 16 * mtile + lane % 8 + 8 * ((lane // 8) % 2)
        self.a_off = khalf * operand_bytes(ROWS) // 2 + a_row * ROW_BYTES
        self.a_chunk = ((lane // 16) ^ (lane % 8)) * 16
        self.b_off = khalf * operand_bytes(tokens) // 2 + (lane % 8) * ROW_BYTES
        self.b_chunk = ((lane // 8) ^ (lane % 8)) * 16
        self.mtile, self.khalf = mtile, khalf

    def weights_addr(self, stage: int):
        return self.w_base + (stage % self.w_ring) * operand_bytes(ROWS)

    def tokens_addr(self, stage: int):
        return self.q_base + (stage % self.q_ring) * operand_bytes(self.tokens)

    def compute(self, stage: int, acc: list) -> list:
        """This warp's k-half of `stage`: 4 k-steps x (tokens / 8) n-tiles of m16n8k16."""
        w, q = self.weights_addr(stage) + self.a_off, self.tokens_addr(stage) + self.b_off
        for kp in range(2):  # pairs of k-steps
            a0 = P.ldmatrix_x4(w + (self.a_chunk ^ (64 * kp)))
            a1 = P.ldmatrix_x4(w + (self.a_chunk ^ (64 * kp + 32)))
            for nt in range(self.tokens // 8):
                b = P.ldmatrix_x4(q + 8 * nt * ROW_BYTES + (self.b_chunk ^ (64 * kp)))
                acc[nt] = P.mma_bf16_16816(a0, (b[0], b[1]), acc[nt])
                acc[nt] = P.mma_bf16_16816(a1, (b[2], b[3]), acc[nt])
        return acc

    def zero_acc(self) -> list:
        return [[Float32(0)] * 4 for _ in range(self.tokens // 8)]

    def acc_addrs(self, out, lane) -> list:
        """Shared addresses of this lane's accumulators in the [token][row] fp32 tile."""
        g, t = lane // 4, lane % 4
        addrs = []
        for nt in range(self.tokens // 8):
            for q in range(4):
                row = 16 * self.mtile + g + 8 * (q // 2)
                token = 8 * nt + 2 * t + q % 2
                addrs.append(out + token * OUT_PITCH + 4 * row)
        return addrs


# -- the rings' barriers and the loop (a kernel's shared-memory rings: `Ring` tuples) --------
# A ring is (slots, its first full mbarrier's shared address, its first empty one's, the bytes
# of one fill); slot i's mbarriers are 8 i bytes past the first.


def allocate_rings(smem, tokens: int, w_slots: int, q_slots: int, w_tma, w_coords, q_tma, q_coords, block, warp, lane):
    """A CTA's two rings in shared memory (each 1024-byte aligned) and their mbarriers, as the
    loop works with them: (the Stream, the weights' Copies of row block `block`, q_c's Copies,
    the weight ring's (slots, full, empty, bytes), the token ring's)."""
    w_ring = smem.allocate_tensor(BFloat16, stage_layout(ROWS, w_slots), byte_alignment=1024)
    q_ring = smem.allocate_tensor(BFloat16, stage_layout(tokens, q_slots), byte_alignment=1024)
    w_bars = smem.allocate_tensor(Int64, cute.make_layout(2 * w_slots), byte_alignment=8)
    q_bars = smem.allocate_tensor(Int64, cute.make_layout(2 * q_slots), byte_alignment=8)
    s = Stream(tokens, w_slots, q_slots, w_ring.iterator.toint(), q_ring.iterator.toint(), warp, lane)
    w_sync = (w_slots, w_bars.iterator.toint(), w_bars.iterator.toint() + 8 * w_slots, operand_bytes(ROWS))
    q_sync = (q_slots, q_bars.iterator.toint(), q_bars.iterator.toint() + 8 * q_slots, operand_bytes(tokens))
    weights = Copies(w_tma, w_coords, w_ring, ROWS, block, w_bars.iterator)
    queries = Copies(q_tma, q_coords, q_ring, tokens, 0, q_bars.iterator)
    return s, weights, queries, w_sync, q_sync


def init_rings(rings):
    """Lane 0 of warp 0, before the mbarrier init fence: each slot's full mbarrier (one
    arrival: the expect_tx of a fill) and empty one (every thread releases the slot)."""
    for slots, full, empty, _ in rings:
        for slot in range(slots):
            P.mbar_init(full + 8 * slot, 1)
            P.mbar_init(empty + 8 * slot, THREADS)


def arm_rings(rings):
    """Lane 0 of warp 0, after the fence: every slot's first fill expected (its bytes)."""
    for slots, full, _, nbytes in rings:
        for slot in range(slots):
            P.mbar_expect(full + 8 * slot, Int32(nbytes))


@cute.jit
def stream_stages(s, weights: Copies, queries: Copies, w_sync, q_sync, warp, lane) -> list:
    """The CTA's K loop over both rings, after each ring's first `slots` stages were issued:
    returns this warp's accumulators (Stream.zero_acc's shape), every copy landed and every
    warp done with the rings.

    In each ring, stage `it` lives in slot it % slots, in the full barrier's phase
    it // slots. Warp 0 refills the slots of stage it - 1 once every thread has released
    them (their empty barriers' phase (it - 1) // slots), keeping slots - 1 stages of each
    operand in flight; the other warps wait only for the stage they compute."""
    acc = s.zero_acc()
    for it in cutlass.range_constexpr(STAGES):
        for copies, (slots, full, empty, nbytes) in ((weights, w_sync), (queries, q_sync)):
            nxt = refill(it, slots)
            if cutlass.const_expr(nxt is not None):
                if warp == 0:
                    P.mbar_wait(empty + 8 * (nxt % slots), parity(it - 1, slots))
                    if lane == 0:
                        P.mbar_expect(full + 8 * (nxt % slots), Int32(nbytes))
                    cute.arch.sync_warp()
                    issue(copies, nxt)
        for slots, full, _, _ in (w_sync, q_sync):
            P.mbar_wait(full + 8 * (it % slots), parity(it, slots))
        acc = s.compute(it, acc)
        if cutlass.const_expr(released(it, s.w_ring) or released(it, s.q_ring)):
            P.fence_proxy_async()  # the fragments' reads before the copies' async-proxy writes
            for slots, _, empty, _ in (w_sync, q_sync):
                if cutlass.const_expr(released(it, slots)):  # the slot is refilled: release it
                    P.mbar_arrive(empty + 8 * (it % slots))
    cute.arch.sync_threads()  # every warp is done with the rings (every copy has landed)
    return acc


@cute.jit
def sum_khalves(s, acc, lane):
    """The fp32 [token][row] tile (OUT_PITCH bytes a token) at the weight ring's base, in a fixed
    order: k-half 1 stores, k-half 0 adds its own first. Returns the tile's shared address."""
    out = s.w_base
    addrs = s.acc_addrs(out, lane)
    if s.khalf == 1:
        for i in cutlass.range_constexpr(len(addrs)):
            P.st_shared_f32(addrs[i], acc[i // 4][i % 4])
    cute.arch.sync_threads()
    if s.khalf == 0:
        for i in cutlass.range_constexpr(len(addrs)):
            P.st_shared_f32(addrs[i], P.add_rn(acc[i // 4][i % 4], P.ld_shared_f32(addrs[i])))
    cute.arch.sync_threads()
    return out


# -- a ring's schedule (the kernel's loop and tests/test_projection_layout.py's model) -------


def parity(stage: int, ring: int) -> int:
    """The parity of the mbarrier phase of slot stage % ring that belongs to `stage`: the full
    barrier's phase that lands it, and the empty barrier's phase that releases it."""
    return stage // ring % 2


def refill(it: int, ring: int) -> int | None:
    """The stage warp 0 copies at the top of iteration `it`, into the slot that stage it - 1
    held (after that stage's release), or None: ring - 1 stages stay in flight."""
    stage = it - 1 + ring
    return stage if it >= 1 and stage < STAGES else None


def released(it: int, ring: int) -> bool:
    """Whether the threads release stage `it`'s slot after computing it (only a slot that
    will be refilled is)."""
    return it + ring < STAGES
