"""The decode-batch projection core of the indexer's wq_b (IndexQuery), the same loop as
MlaQuery.project's Q_B, which keeps its own H200-tested copy until a GPU run validates it on
this one: out[b, n] = q_c[b, :] . W[n, :] for a CTA's 16 weight rows, K = 1536, 128 threads.

Each warp holds its quarter of K of the 16 rows in registers (load_rows, issued right
after griddepcontrol_wait) and, for every batch tile of 16 tokens, runs mma.sync
m16n8k16 with the weights as A (the batch is the narrow N side); the four warps' partial
sums are added in a fixed order, so results do not depend on scheduling. The 16-byte
weight and q_c words are split the same way over two MMAs (k 8t..8t+3, then 8t+4..8t+7):
any consistent permutation of K gives the same dot products.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import primitives as P

THREADS = 128
BATCH_TILE = 16
ROWS = 16  # weight rows per CTA
K = 1536
CHUNKS = K // 4 // 32  # 32-wide K chunks per warp


def load_rows(weights, warp, g, t):
    """This thread's share of the CTA's 16 rows (row-major, K contiguous): (lo, hi) lists
    of CHUNKS 16-byte words of rows g and g + 8."""
    lo, hi = [], []
    for c in range(CHUNKS):
        k = warp * (K // 4) + 32 * c + 8 * t
        lo.append(P.load_u32x4_nc(weights + g * K + k))
        hi.append(P.load_u32x4_nc(weights + (g + 8) * K + k))
    return lo, hi


def partial_buffer(smem):
    return smem.allocate_tensor(Float32, cute.make_layout(4 * ROWS * BATCH_TILE), byte_alignment=16)


@cute.jit
def project_tiles(lo, hi, qc, out, out_stride, partial, batch, group, groups, tid, warp, g, t):
    """For batch tiles group, group + groups, ...: out[row * out_stride + r] (r < 16) as
    fp32 for every token row < batch. Tokens past the batch repeat the last one; their
    columns are discarded."""
    for tile in range(group, (batch + BATCH_TILE - 1) // BATCH_TILE, groups):
        acc = [[Float32(0)] * 4 for _ in range(2)]
        for c in cutlass.range_constexpr(CHUNKS):
            k = warp * (K // 4) + 32 * c + 8 * t
            for nt in cutlass.range_constexpr(2):
                b = P.load_u32x4(qc + cutlass.min(tile * BATCH_TILE + nt * 8 + g, batch - 1) * K + k)
                acc[nt] = P.mma_bf16_16816((lo[c][0], hi[c][0], lo[c][1], hi[c][1]), (b[0], b[1]), acc[nt])
                acc[nt] = P.mma_bf16_16816((lo[c][2], hi[c][2], lo[c][3], hi[c][3]), (b[2], b[3]), acc[nt])
        for nt in cutlass.range_constexpr(2):
            col = nt * 8 + 2 * t
            for q in cutlass.range_constexpr(4):
                partial[(warp * ROWS + g + 8 * (q // 2)) * BATCH_TILE + col + q % 2] = acc[nt][q]
        cute.arch.sync_threads()

        # Fixed-order reduction over the four K quarters; thread -> (token, two rows).
        token, pair = tid % BATCH_TILE, tid // BATCH_TILE
        sums = [Float32(0), Float32(0)]
        for w in cutlass.range_constexpr(4):
            for j in cutlass.range_constexpr(2):
                sums[j] = P.add_rn(sums[j], partial[(w * ROWS + 2 * pair + j) * BATCH_TILE + token])
        row = tile * BATCH_TILE + token
        if row < batch:
            P.store_f32x2(out + row * out_stride + 2 * pair, sums[0], sums[1])
        cute.arch.sync_threads()  # the next tile reuses `partial`
