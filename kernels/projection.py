"""The streamed decode-batch GEMM core of the indexer's wq_b (IndexQuery): a CTA owns 64
weight rows (half of one head, 192 KB of bf16) over the whole K = 1536 and computes
out[row, token] = W[row, :] . q_c[token, :] for up to `tokens` tokens on the tensor cores.

The weights stream once through a shared-memory ring of `ring` stages of 128 k-columns:
each stage holds the 64 rows' 256-byte chunks (16 KB) and the tokens' matching chunks in
rows of PITCH = 272 bytes, so the 8 row addresses of an `ldmatrix` fall in 8 distinct
16-byte bank groups. A producer warp (warp WARPS) fills the stages with one 256-byte
`cp.async.bulk` per row (the bulk copy engine: no registers, no per-thread request
tracking), each stage completing on its `full` mbarrier (two arrivals: the weights', then
the tokens', each with its bytes); the 8 consumer warps wait on `full`, compute the stage
and release it on its `empty` mbarrier, so no CTA barrier stands between stages and the
producer refills a slot as soon as its last reader is done. Weights do not depend on the
previous kernel, so the producer issues every slot's weights before
`griddepcontrol.wait`; the q_c chunks come after it. Token rows past the batch are zeroed
once (the producer never writes them).

Why per-row bulk copies and not cp.async (the version before): with every thread issuing
16-byte cp.async and a CTA barrier per stage the kernel ran latency bound at 51% of
4.3 TB/s (ncu: 0.09 eligible warps per scheduler, 6% issue slots; bench/RESULTS.md).

Compute: 8 warps = 4 m-tiles of 16 rows x 2 k-halves of each stage; `mma.sync m16n8k16`
with the weights as A (ldmatrix.x4) and the tokens as the narrow N side (ldmatrix.x4 gives
two k-steps of one 8-token n-tile). The two k-halves' fp32 sums add in a fixed order
(half 0 + half 1) into an fp32 [token][row] tile in shared memory (reusing the ring), so
results do not depend on scheduling (the same order as the cp.async version: bit-identical).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from . import primitives as P

THREADS = 256  # the consumer warps
WARPS = THREADS // 32
CTA_THREADS = THREADS + 32  # + the producer warp (warp WARPS)
K = 1536
KC = 128  # k-columns per stage
STAGES = K // KC  # 12
ROWS = 64  # weight rows per CTA
CHUNK = KC * 2  # bytes of one row per stage: one bulk copy
PITCH = CHUNK + 16  # bytes per row in a slot (16-byte skew: conflict-free ldmatrix)
OUT_PITCH = ROWS * 4 + 16  # bytes per token in the fp32 [token][row] result tile
CONSUMER_BAR = 1  # the consumers' named barrier (bar.sync 1, THREADS)


def slot_bytes(tokens: int) -> int:
    return (ROWS + tokens) * PITCH


def ring_bytes(tokens: int, ring: int) -> int:
    return ring * slot_bytes(tokens)


def barrier_bytes(ring: int) -> int:
    """full[s] then empty[s], 8 bytes each."""
    return 16 * ring


def init_barriers(bars, ring: int):
    """One thread: full[s] (at bars + 8 s) takes the producer's two arrivals (weights, then
    tokens) and their bytes, empty[s] (bars + 8 (ring + s)) every consumer thread's release."""
    for s in range(ring):
        P.mbar_init(bars + 8 * s, 2)
        P.mbar_init(bars + 8 * (ring + s), THREADS)
    P.mbar_init_fence()


def zero_addr(i, start, per_slot, tokens: int):
    """Shared address of word i of Stream.zero_rows (slots of `tokens` token rows)."""
    return start + i // per_slot * slot_bytes(tokens) + 16 * (i % per_slot)


def consumer_sync():
    cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=THREADS)


class Stream:
    """One CTA's view of the ring: per-thread copy and fragment offsets, fixed at start.

    tokens: the token rows of a slot (a multiple of 16); ring: slots (>= 2); base: the
    ring's shared address; bars: its mbarriers' (barrier_bytes)."""

    def __init__(self, tokens: int, ring: int, base, bars, tid, warp, lane):
        assert tokens % 16 == 0 and ring >= 2
        self.tokens, self.ring, self.base, self.bars, self.tid, self.lane = tokens, ring, base, bars, tid, lane
        self.slot = slot_bytes(tokens)
        # fragments: warp = (k-half, m-tile); ldmatrix row addresses of this lane
        mtile, khalf = warp % 4, warp // 4
        k_bytes = khalf * (KC // 2) * 2
        a_row = 16 * mtile + lane % 8 + 8 * ((lane // 8) % 2)
        self.a_off = a_row * PITCH + 16 * (lane // 16) + k_bytes
        self.b_off = (ROWS + lane % 8) * PITCH + 16 * (lane // 8) + k_bytes
        self.mtile, self.khalf = mtile, khalf

    def slot_addr(self, stage: int):
        return self.base + (stage % self.ring) * self.slot

    def full(self, stage: int):
        return self.bars + 8 * (stage % self.ring)

    def empty(self, stage: int):
        return self.bars + 8 * (self.ring + stage % self.ring)

    # -- the producer warp (the caller holds the control flow: lane 0 expects the bytes,
    # a token copy only where token < ntok) --

    def acquire(self, stage: int):
        """Wait until the consumers released the slot's previous stage (stage - ring)."""
        if stage >= self.ring:
            P.mbar_wait(self.empty(stage), (stage // self.ring - 1) % 2)

    def weight_copies(self, weights, stage: int) -> list:
        """(dst, src) of this lane's rows of `stage` (weights: bf16 pointer to the CTA's
        first row): rows lane and lane + 32, one CHUNK-byte bulk copy each."""
        slot = self.slot_addr(stage)
        rows = [self.lane + 32 * i for i in range(ROWS // 32)]
        return [(slot + row * PITCH, weights + row * K + stage * KC) for row in rows]

    def token_copies(self, qc, stage: int) -> list:
        """(token, dst, src) of this lane's tokens of `stage`: lane, lane + 32, ... below
        `tokens` (copied where token < ntok)."""
        slot = self.slot_addr(stage) + ROWS * PITCH
        tokens = [self.lane + 32 * i for i in range(max(self.tokens // 32, 1))]
        return [(token, slot + token * PITCH, qc + token * K + stage * KC) for token in tokens]

    # -- the consumer warps --

    def zero_rows(self, ntok) -> tuple:
        """Token rows ntok .. tokens - 1 of every slot, zeroed once (no copy ever writes them,
        so those columns of the product are zero): (16-byte words in all, the first word's
        address, words per slot); word i is at zero_addr(i, ...)."""
        per_slot = (self.tokens - ntok) * (PITCH // 16)
        return self.ring * per_slot, self.base + (ROWS + ntok) * PITCH, per_slot

    def wait_full(self, stage: int):
        P.mbar_wait(self.full(stage), (stage // self.ring) % 2)

    def release(self, stage: int):
        """This thread is done reading the slot: the fence orders its ldmatrix reads before
        the bulk copy that refills it (kernels/primitives.py, mbarriers)."""
        P.fence_proxy_async()
        P.mbar_arrive(self.empty(stage))

    def compute(self, stage: int, acc: list) -> list:
        """This warp's k-half of `stage`: 4 k-steps x (tokens / 8) n-tiles of m16n8k16."""
        slot = self.slot_addr(stage)
        for kp in range(KC // 64):  # pairs of k-steps
            a0 = P.ldmatrix_x4(slot + self.a_off + 64 * kp)
            a1 = P.ldmatrix_x4(slot + self.a_off + 64 * kp + 32)
            for nt in range(self.tokens // 8):
                b = P.ldmatrix_x4(slot + self.b_off + 8 * nt * PITCH + 64 * kp)
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
