"""IndexQuery: the indexer's wq_b and its epilogue, as two PDL-chained kernels.

project  (grid: 64 x 128 / 16 = 512 CTAs of 16 wq_b rows, x batch-tile groups)
         q = q_c . wq_b^T through kernels/projection.py into an fp32 workspace [B, 8192].
finish   (one warp per (token, head); lane l holds dims 4l..4l+3)
         NeoX RoPE on the first 64 dims (pair (i, i + 32): lanes l and l ^ 8), the per-head
         e4m3 quantization (scale = max(amax, 1e-4) / 448, values / scale, saturated), the
         queries as e4m3 [B, 64, 128] and the head weights with DeepSeek-V3.2's folding:
         w = weights_proj * heads^-0.5 * q_scale * dim^-0.5, fp32 [B, 64].

Tested on the H200 against the reference (tests/test_indexer_gpu.py); DecodeStep's cute
backend runs it. Measured in bench/RESULTS.md.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8

from . import primitives as P
from . import projection
from .mla_query import tile_groups

HEADS, DIM, ROPE = 64, 128, 64


class IndexQuery:
    def __init__(self, row_stride: int, weights_column: int, pdl: bool = True):
        """row_stride: elements per packed qkv row; weights_column: where idx_w starts in it."""
        self.row_stride, self.weights_column, self.pdl = row_stride, weights_column, pdl

    @cute.jit
    def __call__(self, qc: cute.Pointer, wq_b: cute.Pointer, qkv: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer,
                 context_lens: cute.Pointer, workspace: cute.Pointer, q_out: cute.Pointer, w_out: cute.Pointer,
                 batch: Int32, stream: cuda.CUstream):
        ctas = HEADS * DIM // projection.ROWS
        tiles = (batch + projection.BATCH_TILE - 1) // projection.BATCH_TILE
        self.project(qc, wq_b, workspace, batch).launch(
            grid=[ctas, cutlass.min(tiles, tile_groups(ctas)), 1], block=[projection.THREADS, 1, 1], stream=stream,
            use_pdl=self.pdl)
        self.finish(qkv, cos, sin, context_lens, workspace, q_out, w_out, batch).launch(
            grid=[(batch * HEADS + 3) // 4, 1, 1], block=[128, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def project(self, qc: cute.Pointer, wq_b: cute.Pointer, workspace: cute.Pointer, batch: Int32):
        tid, _, _ = cute.arch.thread_idx()
        mtile, group, _ = cute.arch.block_idx()
        _, groups, _ = cute.arch.grid_dim()
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        smem = cutlass.memory.SmemAllocator()
        partial = projection.partial_buffer(smem)
        weights = wq_b + mtile * projection.ROWS * projection.K
        if tid == 0:
            P.prefetch_l2(weights, projection.ROWS * projection.K * 2)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        lo, hi = projection.load_rows(weights, warp, g, t)
        projection.project_tiles(lo, hi, qc, workspace + mtile * projection.ROWS, HEADS * DIM, partial, batch, group,
                                 groups, tid, warp, g, t)

    @cute.kernel
    def finish(self, qkv: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer, context_lens: cute.Pointer,
               workspace: cute.Pointer, q_out: cute.Pointer, w_out: cute.Pointer, batch: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tid % 32
        item = cta * 4 + tid // 32  # (token, head) of this warp
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if item < batch * HEADS:
            token, head = item // HEADS, item % HEADS
            q = list(P.load_f32x4(workspace + item * DIM + 4 * lane))
            out = P.rope_neox_row(q, cos, sin, P.load_i32(context_lens + token) - 1, lane)
            word, scale = P.quantize_e4m3_row(out)
            P.store_u32(q_out + item * DIM + 4 * lane, word)
            if lane == 0:
                raw = P.unpack_bf16x2(P.load_u32(qkv + token * self.row_stride + self.weights_column + head // 2 * 2))
                proj = P.select(head % 2 == 0, raw[0], raw[1])
                P.store_f32(w_out + item, proj * Float32(HEADS ** -0.5) * scale * Float32(DIM ** -0.5))


def compile_args():
    bf16, f32 = P.gmem_ptr(BFloat16), P.gmem_ptr(Float32)
    return (bf16, bf16, bf16, f32, f32, P.gmem_ptr(Int32, align=4), f32, P.gmem_ptr(Uint8), f32, Int32(1))
