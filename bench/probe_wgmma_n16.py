"""docs/levers.md S.12's CPU probe (compiled for sm_90a, never run): one consumer warpgroup,
CuTe DSL tiled wgmma at N = 16 (bf16 in, fp32 acc).

(1) S^T[64 slots, 16 heads] = K Q^T: A = the block's KV rows (64 x 576, K-major), B = Q (16 x 576, K-major);
(2) O^T[512 dims, 16 heads] = V^T P^T: A = V^T, the SAME KV smem read MN-major (576 x 64 view, first 8 m64 tiles),
    B = P^T (16 heads x 64 slots, K-major).

usage: python bench/probe_wgmma_n16.py KV_KIND [OUT_DIR] [--only2]
KV_KIND: INTER | SW32 | SW64 | SW128   (the K-major wgmma atom the KV tile is tiled from, M first as sparse_core_wgmma)
         STRIDE                        (sparse_core_layout's padded row-major rows: 64 x 576 at 1168 B a row)
Writes OUT_DIR/<kind>/*.ptx (and .cubin); prints the wgmma lines."""

import os
import re
import sys
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float32
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cute.runtime import make_fake_stream, make_ptr

SLOTS, ROW, LATENT, HEADS = 64, 576, 512, 16
K = OperandMajorMode.K
MN = OperandMajorMode.MN

ATOMS = {
    "INTER": warpgroup.SmemLayoutAtomKind.K_INTER,
    "SW32": warpgroup.SmemLayoutAtomKind.K_SW32,
    "SW64": warpgroup.SmemLayoutAtomKind.K_SW64,
    "SW128": warpgroup.SmemLayoutAtomKind.K_SW128,
}


class Probe:
    def __init__(self, kv_kind: str, q_kind: str = "SW128", p_kind: str = "SW128", only2: bool = False):
        self.kv_kind, self.q_kind, self.p_kind, self.only2 = kv_kind, q_kind, p_kind, only2

    def k_major(self, kind, rows, cols):
        """(rows, cols) K-major composed layout (swizzle o outer), atoms tiled along rows first."""
        if kind == "STRIDE":  # 1168 B a row: 584 bf16
            return None, cute.make_layout((rows, cols), stride=(584, 1))
        atom = warpgroup.make_smem_layout_atom(ATOMS[kind], BFloat16)
        full = cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
        return full.inner, full.outer

    @cute.jit
    def __call__(self, out: cute.Pointer, stream: cuda.CUstream):
        self.kernel(out).launch(grid=[1, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Pointer):
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()

        kv_sw, kv_outer = self.k_major(self.kv_kind, SLOTS, ROW)
        q_sw, q_outer = self.k_major(self.q_kind, HEADS, ROW)
        p_sw, p_outer = self.k_major(self.p_kind, HEADS, SLOTS)
        sKV = smem.allocate_tensor(BFloat16, kv_outer, byte_alignment=1024, swizzle=kv_sw)
        sQ = smem.allocate_tensor(BFloat16, q_outer, byte_alignment=1024, swizzle=q_sw)
        sPt = smem.allocate_tensor(BFloat16, p_outer, byte_alignment=1024, swizzle=p_sw)
        if cutlass.const_expr(self.only2):  # (1)'s A from a legal 64-row SW128 tile instead (isolates (2))
            a_sw, a_outer = self.k_major("SW128", SLOTS, ROW)
            sQ2 = smem.allocate_tensor(BFloat16, a_outer, byte_alignment=1024, swizzle=a_sw)
        # V^T: the same bytes, modes swapped: (576 dims, 64 slots); m64 tiles 0 .. 7 are the latent dims
        sVt = cute.local_tile(
            cute.make_tensor(sKV.iterator, cute.select(kv_outer, mode=[1, 0])), (LATENT, SLOTS), (0, 0)
        )

        # (1) S^T = K Q^T, m64n16k16, A K-major from smem, B K-major
        mma1 = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, K, K, Float32, (1, 1, 1), (64, 16))
        thr1 = mma1.get_slice(tid)
        tSsA = thr1.partition_A(sKV)  # (MMA, 1, 36)
        tSsB = thr1.partition_B(sQ)  # (MMA, 1, 36)
        tSrA = mma1.make_fragment_A(tSsA if not self.only2 else thr1.partition_A(sQ2))
        tSrB = mma1.make_fragment_B(tSsB)
        accS = mma1.make_fragment_C(thr1.partition_shape_C((SLOTS, HEADS)))

        # (2) O^T = V^T P^T, m64n16k16, A MN-major (transposed) from the same smem, B K-major
        mma2 = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, MN, K, Float32, (1, 1, 1), (64, 16))
        thr2 = mma2.get_slice(tid)
        tOsA = thr2.partition_A(sVt)  # (MMA, 8, 4)
        tOsB = thr2.partition_B(sPt)  # (MMA, 1, 4)
        tOrA = mma2.make_fragment_A(tOsA)
        tOrB = mma2.make_fragment_B(tOsB)
        accO = mma2.make_fragment_C(thr2.partition_shape_C((LATENT, HEADS)))
        accO.fill(0.0)

        warpgroup.fence()
        mma1.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(ROW // 16):
            cute.gemm(mma1, accS, tSrA[None, None, k], tSrB[None, None, k], accS)
            mma1.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        mma2.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for k in cutlass.range_constexpr(SLOTS // 16):
            cute.gemm(mma2, accO, tOrA[None, None, k], tOrB[None, None, k], accO)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        g = cute.make_tensor(out, cute.make_layout((128, 72), stride=(72, 1)))
        for i in cutlass.range_constexpr(cute.size(accS)):
            g[tid, i] = accS[i]
        for i in cutlass.range_constexpr(cute.size(accO)):
            g[tid, 8 + i] = accO[i]


def compile_probe(kind: str, dump: str, **kw):
    os.makedirs(dump, exist_ok=True)
    opts = (cute.GPUArch("sm_90a"), cute.KeepPTX(), cute.KeepCUBIN(), DumpDir(dump))
    out = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    return cute.compile[opts](Probe(kind, **kw), out, make_fake_stream())


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "INTER"
    root = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/probe_wgmma_n16")
    only2 = "--only2" in sys.argv  # the KV layout is used by (2) only (MN-major A)
    dump = root / (kind + ("_only2" if only2 else ""))
    compile_probe(kind, str(dump), only2=only2)
    ptx = [p for p in dump.iterdir() if p.suffix == ".ptx"]
    text = ptx[0].read_text()
    lines = [line.strip() for line in text.splitlines() if "wgmma.mma_async" in line]
    print(f"{kind}: compiled, {len(lines)} wgmma.mma_async lines, ptx {ptx[0]}")
    seen = {}
    for line in lines:
        key = re.sub(r"\{[^}]*\}", "{..}", line)
        key = re.sub(r"%rd\d+", "%rd", key)
        key = re.sub(r"%p\d+", "%p", key)
        seen[key] = seen.get(key, 0) + 1
    for key, n in seen.items():
        print(f"  {n:3d} x {key}")
