"""IndexKey: the new tokens' indexer keys into the paged FP8 indexer cache.

One warp per token (lane l holds dims 4l..4l+3 of the 128): LayerNorm(128) with weight
and bias in FP32, NeoX RoPE on the first 64 dims at position len - 1, with `hadamard` the
rotation of the 128 (a fast Walsh-Hadamard transform, 20 lane shuffles), per-token e4m3
(scale = max(amax, 1e-4) / 448, with `ue8m0` rounded up to a power of two), written at
the token's slot: the 128 key bytes at page x 8448 + offset x 128 and the fp32 scale at
page x 8448 + 8192 + offset x 4 (graphstep/formats.py). Slot -1 (a pad row) writes nothing.
Guards (kernels/guards.py): a slot outside [0, pool_slots) writes nothing, recorded unless
-1; a length outside [1, rope_rows] reads RoPE row 0 (the key is garbage, in bounds),
recorded. It needs only the step's inputs, so it opens the main stream's PDL chain
(IndexKey -> QueryNorm -> IndexQuery -> DsaIndex -> TopK) and DsaIndex sees the new keys.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from . import guards
from . import primitives as P

DIM, PAGE = 128, 64
PAGE_BYTES = PAGE * (DIM + 4)
WARPS = 4
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"index_dim": (DIM,), "index_rope_dim": (64,), "page_size": (PAGE,)}


class IndexKey:
    def __init__(
        self,
        row_stride: int,
        key_column: int,
        eps: float,
        pdl: bool = True,
        hadamard: bool = False,
        ue8m0: bool = False,
    ):
        """row_stride: elements per packed qkv row; key_column: where idx_k starts in it;
        hadamard: rotate the key before quantizing it; ue8m0: power-of-two scales."""
        self.row_stride, self.key_column, self.eps, self.pdl = row_stride, key_column, eps, pdl
        self.hadamard, self.ue8m0 = hadamard, ue8m0

    @cute.jit
    def __call__(
        self,
        qkv: cute.Pointer,
        weight: cute.Pointer,
        bias: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        pool_slots: Int32,
        rope_rows: Int32,
        stream: cuda.CUstream,
    ):
        self.index_key(
            qkv, weight, bias, cos, sin, context_lens, slots, cache, error, batch, pool_slots, rope_rows
        ).launch(grid=[(batch + WARPS - 1) // WARPS, 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def index_key(
        self,
        qkv: cute.Pointer,
        weight: cute.Pointer,
        bias: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        pool_slots: Int32,
        rope_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tid % 32
        self.key_row(
            qkv, weight, bias, cos, sin, context_lens, slots, cache, error, batch, pool_slots, rope_rows,
            cta * WARPS + tid // 32, lane,
        )  # fmt: skip

    @cute.jit
    def key_row(
        self, qkv, weight, bias, cos, sin, context_lens, slots, cache, error, batch, pool_slots, rope_rows, token, lane
    ):
        """Token `token`'s key by one warp (this thread: lane `lane`), as the module says."""
        gamma = P.unpack_bf16x2(P.load_u32_nc(weight + 4 * lane)) + P.unpack_bf16x2(
            P.load_u32_nc(weight + 4 * lane + 2)
        )
        beta = P.unpack_bf16x2(P.load_u32_nc(bias + 4 * lane)) + P.unpack_bf16x2(P.load_u32_nc(bias + 4 * lane + 2))
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if token < batch:
            slot = P.load_i32(slots + token)
            if lane == 0 and slot != -1 and not P.in_range(slot, pool_slots):
                P.record_range(error, guards.INDEX_KEY_SLOT, token, slot)
            if P.in_range(slot, pool_slots):
                row = qkv + token * self.row_stride + self.key_column + 4 * lane
                x = P.unpack_bf16x2(P.load_u32(row)) + P.unpack_bf16x2(P.load_u32(row + 2))
                mean = P.warp_sum(x[0] + x[1] + x[2] + x[3]) / Float32(DIM)
                d = [x[j] - mean for j in range(4)]
                var = P.warp_sum(d[0] * d[0] + d[1] * d[1] + d[2] * d[2] + d[3] * d[3]) / Float32(DIM)
                rstd = cute.math.rsqrt(var + Float32(self.eps))
                y = [d[j] * rstd * gamma[j] + beta[j] for j in range(4)]
                length = P.load_i32(context_lens + token)
                row_ok = P.in_range(length - 1, rope_rows)
                if lane == 0 and not row_ok:
                    P.record_range(error, guards.INDEX_KEY_LENGTH, token, length)
                k = P.rope_neox_row(y, cos, sin, P.select_i32(row_ok, length - 1, 0), lane)
                if cutlass.const_expr(self.hadamard):
                    k = P.hadamard_row(k, lane)
                word, scale = P.quantize_e4m3_row(k, self.ue8m0)
                page = cache + Int64(slot // PAGE) * PAGE_BYTES  # 64-bit: caches pass 2 GiB
                P.store_u32(page + (slot % PAGE) * DIM + 4 * lane, word)
                if lane == 0:
                    P.store_f32(page + PAGE * DIM + 4 * (slot % PAGE), scale)


def compile_args():
    bf16, f32, i32 = P.gmem_ptr(BFloat16), P.gmem_ptr(Float32), P.gmem_ptr(Int32, align=4)
    error = P.gmem_ptr(Int32, align=8)
    return (bf16, bf16, bf16, f32, f32, i32, i32, P.gmem_ptr(Uint8), error, Int32(1), Int32(64), Int32(1))
