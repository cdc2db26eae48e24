"""IndexQuery's projection for batches of at most 16 tokens (the 16-token variant): the
CTA's whole 192 KB slab of weight rows in flight at once, 3 KB per bulk copy.

Why not 128-column stages (kernels/projection.py): a stage there is 64 pieces of 256 bytes,
16 bytes per cp.async (latency bound: 51% of 4.3 TB/s) or one 256-byte bulk copy each
(measured 18.1 us at B = 1 against 11.45 with cp.async: the bulk copy engine takes ~25 ns
per copy of an SM, so small copies bound it; bench/RESULTS.md). Here each weight row
(3072 contiguous bytes) is one `cp.async.bulk`, 64 per CTA, all issued by the producer warp
before griddepcontrol.wait (weights never change within a step) into rows of RPITCH = 3088
bytes (16-byte skew: an ldmatrix's 8 row addresses fall in 8 distinct bank groups). The
rows land in STAGES groups of 8, each completing on its own mbarrier, used once: no slot is
reused, so no empty barriers and no CTA barrier until the end.

Compute, per 8-row stage: the tokens are the M side of `mma.sync m16n8k16` (16 token rows,
past the batch zero) and the stage's 8 weight rows the N side (ldmatrix.x4: two k-steps of
the 8 rows). Warp w owns k = 192 w .. 192 w + 191 (12 k-steps): its A fragments of q_c
are loaded once from global memory after the wait and stay in registers (48 words), its
sums of every stage in 32 more. The 8 warps' partial sums then add in a fixed order (warp
0 + 1 + ... + 7) into the fp32 [token][row] tile (OUT_PITCH, as projection.py's), so results
do not depend on scheduling. The k order differs from projection.py's (there: two k-halves
per 128-column stage), so the two variants' sums may differ in the last bits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

from . import primitives as P
from .projection import OUT_PITCH, ROWS, K

THREADS = 256  # the consumer warps
WARPS = THREADS // 32
CTA_THREADS = THREADS + 32  # + the producer warp (warp WARPS)
TOKENS = 16  # one m-tile
ROW_BYTES = K * 2  # one weight row: one bulk copy
RPITCH = ROW_BYTES + 16  # bytes per row in shared memory (16-byte skew)
STAGE_ROWS = 8  # an mma's N
STAGES = ROWS // STAGE_ROWS  # 8 mbarriers, each used once
SLAB_BYTES = ROWS * RPITCH  # 197,632
KW = K // WARPS  # k-columns per consumer warp (192)
KSTEPS = KW // 16  # 12
PARTIALS = OUT_PITCH * TOKENS  # where the warps' partial sums start (after the tile)
CONSUMER_BAR = 1  # the consumers' named barrier (bar.sync 1, THREADS)


def consumer_sync():
    cute.arch.barrier(barrier_id=CONSUMER_BAR, number_of_threads=THREADS)


def init_barriers(bars):
    """One thread: full[s] (bars + 8 s) completes on the producer's one arrival and the
    stage's 8 x 3072 bytes."""
    for s in range(STAGES):
        P.mbar_init(bars + 8 * s, 1)
    P.mbar_init_fence()


def row_copy(slab, weights, stage: int, lane):
    """(dst, src) of the row lane (< 8) of `stage` copies (weights: bf16 pointer to the
    CTA's first row)."""
    row = STAGE_ROWS * stage + lane
    return slab + row * RPITCH, weights + row * K


def a_words(qc, ntok, warp, lane) -> list:
    """(address, live) of this lane's A words of q_c, 4 per k-step (mma.m16n8k16's A
    fragment: (g, 2t) (g + 8, 2t) (g, 2t + 8) (g + 8, 2t + 8), 2 bf16 each); token rows
    past ntok read row ntok - 1 and are zeroed (live False)."""
    g, t = lane // 4, lane % 4
    out = []
    for s in range(KSTEPS):
        k = KW * warp + 16 * s + 2 * t
        for token, dk in ((g, 0), (g + 8, 0), (g, 8), (g + 8, 8)):
            out.append((qc + cutlass.min(token, ntok - 1) * K + k + dk, token < ntok))
    return out


def b_addr(slab, stage: int, pair: int, warp, lane):
    """ldmatrix.x4 row address of this lane for k-steps 2 pair, 2 pair + 1 of `stage`: lanes
    8 i .. 8 i + 7 give the 8 rows' 16 bytes at k + 8 i."""
    row = STAGE_ROWS * stage + lane % 8
    return slab + row * RPITCH + 2 * (KW * warp + 32 * pair) + 16 * (lane // 8)


def load_a(qc, ntok, warp, lane) -> list:
    """The A fragments (KSTEPS x 4 words), zero past the batch."""
    words = []
    for addr, live in a_words(qc, ntok, warp, lane):
        words.append(Uint32(cutlass.select_(live, P.load_u32(addr), Uint32(0))))
    return [words[4 * s : 4 * s + 4] for s in range(KSTEPS)]


def compute(slab, stage: int, a: list, warp, lane) -> list:
    """This warp's k-range of `stage`: 12 m16n8k16 (tokens x the stage's 8 rows)."""
    acc = [Float32(0)] * 4
    for pair in range(KSTEPS // 2):
        b = P.ldmatrix_x4(b_addr(slab, stage, pair, warp, lane))
        acc = P.mma_bf16_16816(a[2 * pair], (b[0], b[1]), acc)
        acc = P.mma_bf16_16816(a[2 * pair + 1], (b[2], b[3]), acc)
    return acc


def partial_addrs(slab, stage: int, warp, lane) -> list:
    """Where this lane's 4 sums of `stage` go: warp's [token][row] fp32 partial tile
    (c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1); token, row in stage)."""
    g, t = lane // 4, lane % 4
    base = slab + PARTIALS + warp * TOKENS * ROWS * 4
    out = []
    for q in range(4):
        token, row = g + 8 * (q // 2), STAGE_ROWS * stage + 2 * t + q % 2
        out.append(base + (token * ROWS + row) * 4)
    return out


def sum_addrs(slab, tid) -> tuple:
    """Thread tid's 4 rows (4 j .. 4 j + 3) of token tid // 16: the 16-byte partial of each
    warp in order, and the tile's."""
    token, j = tid // 16, tid % 16
    parts = [slab + PARTIALS + ((w * TOKENS + token) * ROWS + 4 * j) * 4 for w in range(WARPS)]
    return parts, slab + token * OUT_PITCH + 16 * j
