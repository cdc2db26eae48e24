"""The streamed decode-batch GEMM core of the indexer's wq_b (IndexQuery): a CTA owns 64
weight rows (half of one head, 192 KB of bf16) over the whole K = 1536 and computes
out[row, token] = W[row, :] . q_c[token, :] for up to `tokens` tokens on the tensor cores.

The weights stream once through a shared-memory ring of `ring` stages of 128 k-columns:
each stage holds the 64 rows' 256-byte chunks (16 KB) and the tokens' matching chunks,
copied by every thread with 16-byte `cp.async.cg` (L2 only, no registers held) into rows
of PITCH = 272 bytes, so the 8 row addresses of an `ldmatrix` fall in 8 distinct 16-byte
bank groups. The multistage loop keeps `ring - 1` stages in flight while it computes
one: wait for the oldest group, one CTA barrier, refill the slot everybody just finished,
then compute. Weights do not depend on the previous kernel, so the kernel fills every
slot before `griddepcontrol.wait` and requests the AHEAD stages after the ring into L2
(`prefetch.global.L2`, one 128-byte line per thread), staying AHEAD stages ahead of the
ring from then on; the q_c chunks come after the wait.

Compute: 8 warps = 4 m-tiles of 16 rows x 2 k-halves of each stage; `mma.sync m16n8k16`
with the weights as A (ldmatrix.x4) and the tokens as the narrow N side (ldmatrix.x4 gives
two k-steps of one 8-token n-tile). The two k-halves' fp32 sums add in a fixed order
(half 0 + half 1) into an fp32 [token][row] tile in shared memory (reusing the ring), so
results do not depend on scheduling.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import primitives as P

THREADS = 256
WARPS = THREADS // 32
K = 1536
KC = 128  # k-columns per stage
STAGES = K // KC  # 12
ROWS = 64  # weight rows per CTA
PITCH = KC * 2 + 16  # bytes per row in a slot (16-byte skew: conflict-free ldmatrix)
ROW_CHUNKS = KC * 2 // 16  # 16-byte chunks per row per stage
OUT_PITCH = ROWS * 4 + 16  # bytes per token in the fp32 [token][row] result tile
AHEAD = 3  # stages past the ring whose weights are already requested into L2


def slot_bytes(tokens: int) -> int:
    return (ROWS + tokens) * PITCH


def ring_bytes(tokens: int, ring: int) -> int:
    return ring * slot_bytes(tokens)


# -- shared-memory primitives (32-bit shared addresses) -----------------------------------


def prefetch_l2_line(ptr, live):
    """Request the 128-byte line at `ptr` into L2 where `live` (a hint: nothing returns)."""
    cute.arch.inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, {$r1}, 0;\n\t@p prefetch.global.L2 [{$r0}];\n\t}",
        read_only_args=[ptr, Int32(cutlass.select_(live, Int32(1), Int32(0)))],
    )


# -- the stream -----------------------------------------------------------------------


class Stream:
    """One CTA's view of the ring: per-thread copy and fragment offsets, fixed at start.

    tokens: the token rows of a slot (a multiple of 16); ring: slots (>= 2)."""

    def __init__(self, tokens: int, ring: int, base, tid, warp, lane):
        assert tokens % 16 == 0 and ring >= 2
        self.tokens, self.ring, self.base, self.tid = tokens, ring, base, tid
        self.slot = slot_bytes(tokens)
        # copies: thread tid takes 16-byte chunk tid % 16 of rows tid // 16 + 16 i
        self.chunk, self.first_row = tid % ROW_CHUNKS, tid // ROW_CHUNKS
        # fragments: warp = (k-half, m-tile); ldmatrix row addresses of this lane
        mtile, khalf = warp % 4, warp // 4
        k_bytes = khalf * (KC // 2) * 2
        a_row = 16 * mtile + lane % 8 + 8 * ((lane // 8) % 2)
        self.a_off = a_row * PITCH + 16 * (lane // 16) + k_bytes
        self.b_off = (ROWS + lane % 8) * PITCH + 16 * (lane // 8) + k_bytes
        self.mtile, self.khalf = mtile, khalf

    def slot_addr(self, stage: int):
        return self.base + (stage % self.ring) * self.slot

    def issue_weights(self, weights, stage: int):
        """The 64 rows' chunk of `stage` (weights: bf16 pointer to the CTA's first row)."""
        slot = self.slot_addr(stage)
        for i in range(ROWS * ROW_CHUNKS // THREADS):
            row = self.first_row + (THREADS // ROW_CHUNKS) * i
            P.cp_async_16(slot + row * PITCH + 16 * self.chunk, weights + row * K + stage * KC + 8 * self.chunk)

    def prefetch_weights(self, weights, stage: int):
        """The 64 rows' chunk of `stage` into L2 only: threads 0-127 one 128-byte line each."""
        row, half = self.tid // 2 % ROWS, self.tid % 2
        prefetch_l2_line(weights + row * K + stage * KC + (KC // 2) * half, self.tid < 2 * ROWS)

    def issue_tokens(self, qc, ntok, stage: int):
        """The tokens' chunk of `stage`; rows >= ntok are zero-filled (q_c is not read there)."""
        slot = self.slot_addr(stage) + ROWS * PITCH
        for i in range(self.tokens * ROW_CHUNKS // THREADS):
            token = self.first_row + (THREADS // ROW_CHUNKS) * i
            src = qc + cutlass.min(token, ntok - 1) * K + stage * KC + 8 * self.chunk
            P.cp_async_16(slot + token * PITCH + 16 * self.chunk, src, token < ntok)

    def compute(self, stage: int, acc: list) -> list:
        """This warp's k-half of `stage`: 4 k-steps x (tokens / 8) n-tiles of m16n8k16."""
        slot = self.slot_addr(stage)
        for kp in range(2):  # pairs of k-steps
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
