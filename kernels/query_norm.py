"""QueryNorm: the q_a RMSNorm of the packed projection rows -> q_c [B, 1536] bf16.

Two variants with different FP32 orders (graphstep/order.py models both):
  query_norm_rows:  one row per CTA of 256 threads; threads < 192 take 8 columns each.
  query_norm_tiled: one row per warp, 8 rows per CTA; lane l takes columns 256 i + 8 l + j.
`batch >= tiled_from(heads)` picks tiled, as MlaQuery does for the same batch, so the
main stream's q_c is bit-identical to the one MlaQuery computes for itself.

Run: `graphstep ptx --out ptx` writes both variants' PTX; tests/test_kernels_gpu.py checks
them against the order model with torch.equal.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from . import primitives as P

# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"q_lora_rank": (P.NORM_COLUMNS,)}


class QueryNorm:
    """Launches the variant chosen at construction over a runtime batch.

    row_stride: elements between consecutive qkv rows (the packed width P); q_c rows are
    dense (1536). pdl: launch with programmatic stream serialization (off only to measure).
    """

    threads = 256

    def __init__(self, tiled: bool, row_stride: int, pdl: bool = True):
        self.tiled = tiled
        self.row_stride = row_stride
        self.pdl = pdl

    @cute.jit
    def __call__(
        self,
        qkv: cute.Pointer,
        gamma: cute.Pointer,
        qc: cute.Pointer,
        batch: Int32,
        eps: Float32,
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(self.tiled):
            self.query_norm_tiled(qkv, gamma, qc, batch, eps).launch(
                grid=[self.ctas(batch), 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl
            )
        else:
            self.query_norm_rows(qkv, gamma, qc, batch, eps).launch(
                grid=[self.ctas(batch), 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl
            )

    def ctas(self, batch):
        """The CTAs of `threads` threads a launch of `batch` rows takes."""
        return (batch + 7) // 8 if cutlass.const_expr(self.tiled) else batch

    @cute.kernel
    def query_norm_rows(self, qkv: cute.Pointer, gamma: cute.Pointer, qc: cute.Pointer, batch: Int32, eps: Float32):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        partials = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        self.norm_row(qkv, gamma, qc, eps, row, tid, partials)

    @cute.jit
    def norm_row(self, qkv, gamma, qc, eps, row, tid, partials):
        """One row per CTA: 8 columns per thread, a sequential FMA chain, warp partials (8
        fp32 of shared memory) in order."""
        lane, warp = tid % 32, tid // 32
        weights = P.unpack_bf16x8(P.load_u32x4_nc(gamma + (tid % 192) * 8))
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        values = [Float32(0)] * 8
        chain = Float32(0)
        if tid < 192:
            values = P.unpack_bf16x8(P.load_u32x4(qkv + row * self.row_stride + tid * 8))
            for i in cutlass.range_constexpr(8):
                chain = P.fma_rn(values[i], values[i], chain)
        chain = P.warp_sum(chain)
        if lane == 0:
            partials[warp] = chain
        cute.arch.sync_threads()
        if tid < 192:
            total = Float32(0)
            for w in cutlass.range_constexpr(8):
                total = P.add_rn(total, partials[w])
            rr = P.query_norm_rsqrt(total, eps)
            out = [P.mul_rn(P.mul_rn(values[i], rr), weights[i]) for i in range(8)]
            P.store_u32x4(qc + row * P.NORM_COLUMNS + tid * 8, P.pack_words(out, False))

    @cute.kernel
    def query_norm_tiled(self, qkv: cute.Pointer, gamma: cute.Pointer, qc: cute.Pointer, batch: Int32, eps: Float32):
        tid, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        self.norm_tile(qkv, gamma, qc, batch, eps, tile, tid)

    @cute.jit
    def norm_tile(self, qkv, gamma, qc, batch, eps, tile, tid):
        """One row per warp, 8 rows per CTA: 48 columns per lane in packed pairs."""
        lane, warp = tid % 32, tid // 32
        row = tile * 8 + warp
        g = []
        for i in cutlass.range_constexpr(6):
            g += P.unpack_bf16x8(P.load_u32x4_nc(gamma + 256 * i + 8 * lane))
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if row < batch:
            values = []
            for i in cutlass.range_constexpr(6):
                values += P.unpack_bf16x8(P.load_u32x4(qkv + row * self.row_stride + 256 * i + 8 * lane))
            rr = P.lane_norm_rr(values, eps)
            for i in cutlass.range_constexpr(6):
                out = []
                for e in cutlass.range_constexpr(8 * i, 8 * i + 8, 2):
                    out += list(P.mul2(P.mul2((values[e], values[e + 1]), (rr, rr)), (g[e], g[e + 1])))
                P.store_u32x4(qc + row * P.NORM_COLUMNS + 256 * i + 8 * lane, P.pack_words(out, False))


def compile_args():
    """Placeholder arguments for cute.compile (no data, no GPU)."""
    return (P.gmem_ptr(BFloat16), P.gmem_ptr(BFloat16), P.gmem_ptr(BFloat16), Int32(1), Float32(1e-6))
