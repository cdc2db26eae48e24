"""What every SparseCore path shares: the MLA cache-row formats, the bf16 row stride in
shared memory, the shared-memory budget and the named barrier of the consumer warps.
kernels/sparse_core.py is the op; kernels/sparse_core_mma.py and kernels/sparse_core_wgmma.py
its two families of partial paths."""

ROW, LATENT = 576, 512  # a cache row / query row: 512 latent dims | 64 rope dims
STRIDE = 2 * ROW + 16  # bytes per bf16 row in shared memory (+16: ldmatrix rows hit distinct banks)
FP8_ROW = 656  # 512 e4m3 | 4 fp32 scales | 64 bf16 rope
BF16_CHUNKS, FP8_CHUNKS = 2 * ROW // 16, FP8_ROW // 16  # 16-byte chunks per cache row
K_STEPS = ROW // 16  # MMA k steps of a score
SMEM_BYTES = 232448  # the H100/H200 per-CTA opt-in limit (227 KB)
LOG2E = 1.4426950408889634
CONSUMER_BAR = 1  # the named barrier of the consumer warps (bar.sync 1, their count)
PRODUCER_THREADS = 128  # setmaxnreg acts on whole warpgroups
