"""KeyAndNorm: the main stream's first launch in the fork modes, IndexKey and QueryNorm in one grid.

grid     norm CTAs + key CTAs of 256 threads: CTAs [0, norm.ctas(batch)) run QueryNorm's
         variant (`norm_row`: a row per CTA, or `norm_tile`: 8 rows per CTA, as its own
         kernel), the next ceil(batch / 8) run IndexKey's `key_row`, a token per warp.

Both read only the step's inputs, so the main stream's PDL chain opens with one launch
instead of two in series (IndexKey -> QueryNorm -> IndexQuery becomes KeyAndNorm ->
IndexQuery): IndexQuery's CTAs launch, and its weight loads go out, as soon as this grid
passes its wait instead of after IndexKey's whole grid. Each part runs the very device code
of its own kernel, so the keys and q_c are bit-identical to IndexKey's and QueryNorm's (and
so to the q_c MlaQuery computes for itself). Guards and records as IndexKey's
(kernels/guards.py).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import index_key, query_norm

THREADS = 256
KEY_WARPS = THREADS // 32  # tokens per key CTA
# The ModelShape sizes its parts are written for (kernels/catalog.py rejects others).
SUPPORTED = {**index_key.SUPPORTED, **query_norm.SUPPORTED}


class KeyAndNorm:
    """key: the IndexKey op, norm: the QueryNorm op (its `tiled` variant) this launch runs."""

    def __init__(self, key: index_key.IndexKey, norm: query_norm.QueryNorm, pdl: bool = True):
        if norm.threads != THREADS:
            raise ValueError(f"QueryNorm's CTAs have {norm.threads} threads, KeyAndNorm's {THREADS}")
        self.key, self.norm, self.pdl = key, norm, pdl

    @cute.jit
    def __call__(
        self,
        qkv: cute.Pointer,
        gamma: cute.Pointer,
        qc: cute.Pointer,
        key_weight: cute.Pointer,
        key_bias: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        eps: Float32,
        pool_slots: Int32,
        rope_rows: Int32,
        stream: cuda.CUstream,
    ):
        key_ctas = (batch + KEY_WARPS - 1) // KEY_WARPS
        self.key_and_query_norm(
            qkv, gamma, qc, key_weight, key_bias, cos, sin, context_lens, slots, cache, error, batch, eps,
            pool_slots, rope_rows,
        ).launch(
            grid=[self.norm.ctas(batch) + key_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )  # fmt: skip

    @cute.kernel
    def key_and_query_norm(
        self,
        qkv: cute.Pointer,
        gamma: cute.Pointer,
        qc: cute.Pointer,
        key_weight: cute.Pointer,
        key_bias: cute.Pointer,
        cos: cute.Pointer,
        sin: cute.Pointer,
        context_lens: cute.Pointer,
        slots: cute.Pointer,
        cache: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        eps: Float32,
        pool_slots: Int32,
        rope_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        partials = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        norm_ctas = self.norm.ctas(batch)
        if cta < norm_ctas:
            if cutlass.const_expr(self.norm.tiled):
                self.norm.norm_tile(qkv, gamma, qc, batch, eps, cta, tid)
            else:
                self.norm.norm_row(qkv, gamma, qc, eps, cta, tid, partials)
        else:
            lane = tid % 32
            self.key.key_row(
                qkv, key_weight, key_bias, cos, sin, context_lens, slots, cache, error, batch, pool_slots,
                rope_rows, (cta - norm_ctas) * KEY_WARPS + tid // 32, lane,
            )  # fmt: skip


def compile_args():
    """Placeholder arguments for cute.compile (no data, no GPU): QueryNorm's, then IndexKey's."""
    qkv, gamma, qc, batch, eps = query_norm.compile_args()
    _, weight, bias, cos, sin, lens, slots, cache, error, _, pool_slots, rope_rows = index_key.compile_args()
    return (qkv, gamma, qc, weight, bias, cos, sin, lens, slots, cache, error, batch, eps, pool_slots, rope_rows)
