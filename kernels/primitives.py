"""Device primitives shared by every kernel: 16-byte and predicated global accesses and
the L2 bulk prefetch, bf16 / e4m3 packing and unpacking, exact-order FP32 arithmetic, the
warp butterfly and the CTA prefix sum, the q_a norm's rsqrt, the indexer's NeoX RoPE,
Hadamard rotation and per-row e4m3 of a 128-wide row in a warp, bounded mailbox polling
and the warp MMA. Each kernel class launches itself with `use_pdl=self.pdl` (PDL on
unless a benchmark turns it off).

FP32 arithmetic that a torch model must reproduce bit-for-bit goes through explicit
`.rn` PTX instructions (`add_rn`, `mul_rn`, `fma_rn`): ptxas never contracts or
reorders them, whatever the compiler's fast-math defaults.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import AddressSpace
from cutlass.cutlass_dsl import dsl_user_op

from . import guards

BUTTERFLY = (16, 8, 4, 2, 1)  # graphstep/order.py models this order
NORM_COLUMNS = 1536
SENTINEL_WORD = 0xFFFFFFFF  # graphstep/formats.py: no published word can be this
SMS = 132  # an H100 SXM / H200's SMs: the part the kernels' waves are sized and measured on

# -- global memory ------------------------------------------------------------


def _load_v4(ptr, qualifiers: str, dtype):
    kind = "b32" if dtype is Uint32 else "f32"
    return cute.arch.inline_ptx(
        f"ld.{qualifiers}.v4.{kind} {{{{$w0}}, {{$w1}}, {{$w2}}, {{$w3}}}}, [{{$r0}}];",
        write_only_types=[dtype] * 4,
        read_only_args=[ptr],
    )


def load_u32x4(ptr) -> tuple:
    """16-byte global load of data an earlier kernel may have written (after the wait)."""
    return _load_v4(ptr, "global", Uint32)


def load_u32x4_nc(ptr) -> tuple:
    """16-byte read-only (non-coherent) global load: weights, never written by the step."""
    return _load_v4(ptr, "global.nc", Uint32)


def load_u32x4_volatile(ptr) -> tuple:
    """16-byte volatile global load: every poll goes to memory, never a cached copy."""
    return _load_v4(ptr, "volatile.global", Uint32)


def load_f32x4(ptr) -> tuple:
    return _load_v4(ptr, "global", Float32)


def load_f32x4_nc(ptr) -> tuple:
    return _load_v4(ptr, "global.nc", Float32)


def _load_if(ptr, live, count: int, dtype, zero: str):
    """`count` words at ptr by one predicated global load, issued only where `live`
    (nothing is read otherwise, and the words are `zero`), so loads can be issued ahead
    of the branch."""
    kind = "f32" if dtype is Float32 else "b32"
    words = ", ".join(f"{{$w{i}}}" for i in range(count))
    target = f"{{{words}}}" if count > 1 else words
    vector = f".v{count}" if count > 1 else ""
    clear = "".join(f"mov.{'f32' if zero.startswith('0f') else 'b32'} {{$w{i}}}, {zero};\n\t" for i in range(count))
    return cute.arch.inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, {$r1}, 0;\n\t"
        + clear
        + f"@p ld.global{vector}.{kind} {target}, [{{$r0}}];\n\t}}",
        write_only_types=[dtype] * count,
        read_only_args=[ptr, Int32(cutlass.select_(live, Int32(1), Int32(0)))],
    )


def load_u32x4_if(ptr, live) -> tuple:
    """16-byte global load issued only where `live` (0 words otherwise)."""
    return _load_if(ptr, live, 4, Uint32, "0")


def load_u32x2_if(ptr, live) -> tuple:
    """8-byte global load issued only where `live` (0 words otherwise)."""
    return _load_if(ptr, live, 2, Uint32, "0")


def load_i32x4_if(ptr, live) -> tuple:
    """16-byte global load of int32 words issued only where `live` (0 words otherwise)."""
    return _load_if(ptr, live, 4, Int32, "0")


def load_i32_if(ptr, live) -> Int32:
    """4-byte global load issued only where `live` (0 otherwise)."""
    return _load_if(ptr, live, 1, Int32, "0")


def load_f32x4_if(ptr, live) -> tuple:
    return _load_if(ptr, live, 4, Float32, "0f00000000")


def load_f32x2_if(ptr, live) -> tuple:
    return _load_if(ptr, live, 2, Float32, "0f00000000")


def store_u32x4(ptr, words):
    """16-byte global store: one chunk lands whole, as the mailbox protocol needs."""
    cute.arch.inline_ptx(
        "st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[ptr, words[0], words[1], words[2], words[3]],
    )


def store_u32(ptr, word):
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[ptr, word])


def store_i32(ptr, value):
    cute.arch.inline_ptx("st.global.s32 [{$r0}], {$r1};", read_only_args=[ptr, value])


def store_i64(ptr, value):
    cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[ptr, value])


def store_f32(ptr, value):
    cute.arch.inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[ptr, value])


def store_f32x2(ptr, a, b):
    cute.arch.inline_ptx("st.global.v2.f32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[ptr, a, b])


def store_f32x4(ptr, values):
    cute.arch.inline_ptx("st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[ptr, *values])


def store_u32x2(ptr, a, b):
    cute.arch.inline_ptx("st.global.v2.b32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[ptr, a, b])


def prefetch_l2(ptr, size: int):
    """Bulk-prefetch `size` bytes (a multiple of 16) into L2: weights stream in while the
    kernel waits on its predecessor (griddepcontrol) and normalizes."""
    cute.arch.inline_ptx(f"cp.async.bulk.prefetch.L2.global [{{$r0}}], {size};", read_only_args=[ptr])


def load_f32x2(ptr) -> tuple:
    return cute.arch.inline_ptx(
        "ld.global.v2.f32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Float32] * 2, read_only_args=[ptr]
    )


def load_f32_nc(ptr) -> Float32:
    return cute.arch.inline_ptx("ld.global.nc.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[ptr])


def load_u32(ptr) -> Uint32:
    return cute.arch.inline_ptx("ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[ptr])


def load_u32_nc(ptr) -> Uint32:
    return cute.arch.inline_ptx("ld.global.nc.b32 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[ptr])


def load_i32(ptr) -> Int32:
    return cute.arch.inline_ptx("ld.global.s32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[ptr])


def load_i64(ptr) -> Int64:
    return cute.arch.inline_ptx("ld.global.s64 {$w0}, [{$r0}];", write_only_types=[Int64], read_only_args=[ptr])


def load_i64_nc(ptr) -> Int64:
    """8-byte read-only (non-coherent) global load: set up once, never written by the step."""
    return cute.arch.inline_ptx("ld.global.nc.s64 {$w0}, [{$r0}];", write_only_types=[Int64], read_only_args=[ptr])


def load_acquire_i32(ptr) -> Int32:
    """A load that orders every later read of this thread after it, system-wide: the
    reader's side of a ready flag another rank (maybe another GPU) stores with store_release."""
    return cute.arch.inline_ptx(
        "ld.acquire.sys.global.s32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[ptr]
    )


def fence_acq_rel_sys():
    """Order this thread's earlier-observed writes before its later ones, system-wide."""
    cute.arch.inline_ptx("fence.acq_rel.sys;")


def fence_acq_rel_gpu():
    """Order this thread's earlier-observed writes before its later accesses, GPU-wide: after a
    poll saw data another grid published, the reads that follow see what that grid saw."""
    cute.arch.inline_ptx("fence.acq_rel.gpu;")


def store_release_i32(ptr, value):
    """A store ordered after every write this thread has seen, system-wide (the writer's
    side of a ready flag: a completed kernel's writes before it are seen with it)."""
    cute.arch.inline_ptx("st.release.sys.global.s32 [{$r0}], {$r1};", read_only_args=[ptr, value])


# -- packing ---------------------------------------------------------------------------------


def unpack_bf16x2(word) -> tuple:
    """A word of two bf16 -> (low, high) as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "shl.b32 {$w0}, {$r0}, 16;\n\tand.b32 {$w1}, {$r0}, 0xffff0000;",
        write_only_types=[Float32, Float32],
        read_only_args=[word],
    )


def unpack_bf16x8(words) -> list:
    values = []
    for i in range(4):
        lo, hi = unpack_bf16x2(words[i])
        values += [lo, hi]
    return values


def unpack_e4m3x4(word) -> tuple:
    """A word of four e4m3 (element 0 in bits 0-7) -> four fp32 (exact)."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .b16 lo, hi, f0, f1, f2, f3;\n\t.reg .b32 h01, h23;\n\tmov.b32 {lo, hi}, {$r0};\n\t"
        "cvt.rn.f16x2.e4m3x2 h01, lo;\n\tcvt.rn.f16x2.e4m3x2 h23, hi;\n\tmov.b32 {f0, f1}, h01;\n\t"
        "mov.b32 {f2, f3}, h23;\n\tcvt.f32.f16 {$w0}, f0;\n\tcvt.f32.f16 {$w1}, f1;\n\tcvt.f32.f16 {$w2}, f2;\n\t"
        "cvt.f32.f16 {$w3}, f3;\n\t}",
        write_only_types=[Float32] * 4,
        read_only_args=[word],
    )


def pack_bf16x2(low, high) -> Uint32:
    """Round two fp32 to nearest-even bf16: low in bits 0-15 (NaN -> 0x7FFF)."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32], read_only_args=[high, low]
    )


def pack_f16x2(low, high) -> Uint32:
    """Round two fp32 to nearest-even f16: low in bits 0-15 (past 65504: inf)."""
    return cute.arch.inline_ptx(
        "cvt.rn.f16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32], read_only_args=[high, low]
    )


def e4m3x4_to_f16x2(word) -> tuple:
    """A word of four e4m3 (element 0 in bits 0-7) -> two words of f16 pairs (exact: every
    e4m3 is an f16 normal or zero): elements 0, 1 and elements 2, 3, the lower in bits 0-15."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, {$r0};\n\t"
        "cvt.rn.f16x2.e4m3x2 {$w0}, lo;\n\tcvt.rn.f16x2.e4m3x2 {$w1}, hi;\n\t}",
        write_only_types=[Uint32, Uint32],
        read_only_args=[word],
    )


def abs_max_bits(values) -> Int32:
    """The largest |v| of fp32 values as its bits (an Int32 >= 0: for non-negative floats,
    integer order is float order; NaN above inf)."""
    lines = ["{", ".reg .b32 top, x;", f"and.b32 top, {{$r0}}, {0x7FFFFFFF};"]
    for i in range(1, len(values)):
        lines += [f"and.b32 x, {{$r{i}}}, {0x7FFFFFFF};", "max.u32 top, top, x;"]
    lines += ["mov.b32 {$w0}, top;", "}"]
    return cute.arch.inline_ptx("\n\t".join(lines), write_only_types=[Int32], read_only_args=list(values))


def pow2_fit(top, floor, target: int) -> tuple:
    """The power of two that brings values up to |top| (an fp32, or its bits) under
    2^(target + 1): e = max(|top|'s biased exponent, floor) and (e, 2^(target + 127 - e),
    2^(e - target - 127)), the second undoing the first exactly; floor > target keeps both
    normal fp32."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .b32 e, d;\n\tshr.b32 e, {$r0}, 23;\n\tand.b32 e, e, 255;\n\tmax.s32 e, e, {$r1};\n\t"
        f"mov.b32 {{$w0}}, e;\n\tsub.s32 d, {target + 254}, e;\n\tshl.b32 {{$w1}}, d, 23;\n\t"
        f"sub.s32 d, e, {target};\n\tshl.b32 {{$w2}}, d, 23;\n\t}}",
        write_only_types=[Int32, Float32, Float32],
        read_only_args=[top, Int32(floor)],
    )


def abs_max_exponent(values) -> Float32:
    """The biased exponent of the largest |v| of fp32 values, as an fp32 e (0 .. 255): every
    |v| < 2^(e - 126)."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .b32 e;\n\tshr.b32 e, {$r0}, 23;\n\tcvt.rn.f32.u32 {$w0}, e;\n\t}",
        write_only_types=[Float32],
        read_only_args=[abs_max_bits(values)],
    )


def pow2_ceil(bound, target: int) -> tuple:
    """pow2_fit for values under 2^(bound - 126), bound an fp32 (a biased log2, as
    abs_max_exponent's): e = ceil(bound) within [target + 1, 254] (-inf and NaN: target + 1),
    and (e as an fp32, 2^(target + 127 - e), 2^(e - target - 127)), both normal."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .f32 c;\n\t.reg .b32 e, d;\n\tcvt.rpi.f32.f32 c, {$r0};\n\t"
        f"max.f32 c, c, {_f32_hex(target + 1)};\n\tmin.f32 c, c, {_f32_hex(254)};\n\tmov.f32 {{$w0}}, c;\n\t"
        f"cvt.rzi.s32.f32 e, c;\n\tsub.s32 d, {target + 254}, e;\n\tshl.b32 {{$w1}}, d, 23;\n\t"
        f"sub.s32 d, e, {target};\n\tshl.b32 {{$w2}}, d, 23;\n\t}}",
        write_only_types=[Float32, Float32, Float32],
        read_only_args=[bound],
    )


def _f32_hex(value: float) -> str:
    """An fp32 immediate as PTX writes it (0fXXXXXXXX)."""
    return f"0f{struct.unpack('<I', struct.pack('<f', value))[0]:08X}"


def byte_perm(a, b, selector: int) -> Uint32:
    """prmt: byte k of the result is byte (nibble k of selector) of {b, a} (a: bytes 0-3)."""
    return cute.arch.inline_ptx(
        f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector:#x};", write_only_types=[Uint32], read_only_args=[a, b]
    )


def pack_e4m3x4(v0, v1, v2, v3) -> Uint32:
    """Round four fp32 to saturated e4m3 bytes, v0 in bits 0-7 (NaN -> 0x7F)."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e4m3x2.f32 lo, {$r1}, {$r0};\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, {$r3}, {$r2};\n\tmov.b32 {$w0}, {lo, hi};\n\t}",
        write_only_types=[Uint32],
        read_only_args=[v0, v1, v2, v3],
    )


def pack_words(values, fp8: bool) -> list:
    """fp32 values -> 32-bit words of bf16 pairs or e4m3 quads."""
    words = []
    if fp8:
        for i in range(0, len(values), 4):
            words.append(pack_e4m3x4(values[i], values[i + 1], values[i + 2], values[i + 3]))
    else:
        for i in range(0, len(values), 2):
            words.append(pack_bf16x2(values[i], values[i + 1]))
    return words


# -- exact-order arithmetic ------------------------------------------------------------------


def select(cond, a, b) -> Float32:
    """a where cond else b, without a branch (lanes of one warp may disagree)."""
    return Float32(cutlass.select_(cond, a, b))


def select_i32(cond, a, b) -> Int32:
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def select_i64(cond, a, b) -> Int64:
    return Int64(cutlass.select_(cond, Int64(a), Int64(b)))


def add_rn(a, b) -> Float32:
    return cute.arch.inline_ptx("add.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b])


def sub_rn(a, b) -> Float32:
    return cute.arch.inline_ptx("sub.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b])


def mul_rn(a, b) -> Float32:
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b])


def fma_rn(a, b, c) -> Float32:
    return cute.arch.inline_ptx(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[Float32], read_only_args=[a, b, c]
    )


def fma2(a, b, c) -> tuple:
    """Packed FP32x2 FMA (two independent lanes; sm_90 issues them as two FMAs)."""
    return fma_rn(a[0], b[0], c[0]), fma_rn(a[1], b[1], c[1])


def mul2(a, b) -> tuple:
    return mul_rn(a[0], b[0]), mul_rn(a[1], b[1])


def warp_sum(value) -> Float32:
    """Butterfly sum: every lane ends with the same total, in BUTTERFLY order."""
    for offset in range(len(BUTTERFLY)):
        value = add_rn(value, cute.arch.shuffle_sync_bfly(value, offset=BUTTERFLY[offset]))
    return value


def warp_max(value) -> Float32:
    for offset in BUTTERFLY:
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


def warp_sum_i32(value) -> Int32:
    """The sum of an Int32 over the warp, in every lane: one `redux.sync` (a 5-shuffle
    butterfly is five dependent round trips)."""
    return cute.arch.inline_ptx(
        "redux.sync.add.s32 {$w0}, {$r0}, 0xffffffff;", write_only_types=[Int32], read_only_args=[Int32(value)]
    )


@cute.jit
def block_exclusive_sum(value, scratch, lane, warp, warps: int) -> Int32:
    """The sum of `value` over the CTA's lower threads (Int32; every thread calls it).
    scratch: shared Int32 [>= warps]; free again when this returns."""
    inclusive = value
    for offset in (1, 2, 4, 8, 16):
        below = cute.arch.shuffle_sync_up(inclusive, offset=offset)
        inclusive = inclusive + select_i32(lane >= offset, below, 0)
    if lane == 31:
        scratch[warp] = inclusive
    cute.arch.sync_threads()
    total = select_i32(lane < warps, scratch[cutlass.min(lane, warps - 1)], 0)
    warp_inclusive = total
    for offset in (1, 2, 4, 8, 16):
        below = cute.arch.shuffle_sync_up(warp_inclusive, offset=offset)
        warp_inclusive = warp_inclusive + select_i32(lane >= offset, below, 0)
    warps_before = cute.arch.shuffle_sync(warp_inclusive - total, offset=warp)
    cute.arch.sync_threads()
    return warps_before + inclusive - value


def rope_neox_row(q, cos, sin, pos, lane) -> list:
    """NeoX RoPE of a 128-wide row held 4 per lane (lane l: dims 4l..4l+3) with its first
    64 dims rotated in pairs (i, i + 32): lanes 0-7 hold the first halves, lanes 8-15 the
    second (partner lane l ^ 8), lanes 16-31 pass through. cos/sin: fp32 [positions, 32]."""
    partner = [cute.arch.shuffle_sync_bfly(q[j], offset=8) for j in range(4)]
    pair = 4 * (lane % 8)  # first rope pair of this lane's four dims
    c = load_f32x4_nc(cos + pos * 32 + pair)
    s = load_f32x4_nc(sin + pos * 32 + pair)
    first = [q[j] * c[j] - partner[j] * s[j] for j in range(4)]
    second = [partner[j] * s[j] + q[j] * c[j] for j in range(4)]
    return [select(lane < 8, first[j], select(lane < 16, second[j], q[j])) for j in range(4)]


HADAMARD_SCALE = 128**-0.5


def hadamard_in_lane(x: list) -> list:
    """Stages h = 1 and 2 of the transform over four consecutive dims: pairs (0, 1), (2, 3),
    then (0, 2), (1, 3), each (a + b, a - b) exactly rounded."""
    x = [add_rn(x[0], x[1]), sub_rn(x[0], x[1]), add_rn(x[2], x[3]), sub_rn(x[2], x[3])]
    return [add_rn(x[0], x[2]), add_rn(x[1], x[3]), sub_rn(x[0], x[2]), sub_rn(x[1], x[3])]


def hadamard_across(partner: list, own: list, upper) -> list:
    """A stage whose pairs span two threads: own holds a (b where `upper`), partner the other
    -> a + b (a - b where `upper`) as fma(own, +-1, partner): one exact rounding, the same in
    both threads."""
    sign = select(upper, Float32(-1.0), Float32(1.0))
    return [fma_rn(own[j], sign, partner[j]) for j in range(len(own))]


def hadamard_lanes(x: list, lane, offsets) -> list:
    """Unscaled fast Walsh-Hadamard stages over the dims held 4 per lane (lane l: 4l..4l+3):
    h = 1, 2 in the lane, then h = 4 x offset with lane l ^ offset for each shuffle offset,
    in the order and roundings of graphstep.reference.hadamard."""
    x = hadamard_in_lane(x)
    for offset in offsets:
        partner = [cute.arch.shuffle_sync_bfly(x[j], offset=offset) for j in range(4)]
        x = hadamard_across(partner, x, (lane & offset) != 0)
    return x


def hadamard_row(x, lane) -> list:
    """The indexer's rotation of a 128-wide row held 4 per lane by a warp: the transform
    (20 shuffles) scaled by 128^-0.5 (DeepSeek-V3.2's rotate_activation)."""
    return [mul_rn(v, Float32(HADAMARD_SCALE)) for v in hadamard_lanes(x, lane, (1, 2, 4, 8, 16))]


def ue8m0_scale(amax) -> Float32:
    """The power of two at or above amax x fp32(1 / 448): DeepSeek's act_quant with scale_fmt
    "ue8m0" (graphstep.formats.ue8m0_scale): adding 2^23 - 1 to the bits carries into the
    exponent unless the mantissa is zero."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .b32 b;\n\tmul.rn.f32 b, {$r0}, 0f3B124925;\n\tadd.u32 b, b, 8388607;\n\t"
        "and.b32 {$w0}, b, 2139095040;\n\t}",
        write_only_types=[Float32],
        read_only_args=[amax],
    )


def e4m3_scale(amax, ue8m0: bool) -> Float32:
    """max(amax, 1e-4) / 448, or its ue8m0 power of two."""
    amax = cute.arch.fmax(amax, Float32(1e-4))
    return ue8m0_scale(amax) if ue8m0 else amax / Float32(448.0)


def quantize_e4m3_row(x, ue8m0: bool = False) -> tuple:
    """Per-row e4m3 of a 128-wide row held 4 per lane: scale = max(amax, 1e-4) / 448, or that
    rounded up to a power of two (graphstep.formats.quantize_fp8_rows). Returns (this
    lane's 4 bytes as a word, scale)."""
    amax = cute.arch.fmax(
        cute.arch.fmax(cute.math.abs(x[0]), cute.math.abs(x[1])),
        cute.arch.fmax(cute.math.abs(x[2]), cute.math.abs(x[3])),
    )
    scale = e4m3_scale(warp_max(amax), ue8m0)
    return pack_e4m3x4(x[0] / scale, x[1] / scale, x[2] / scale, x[3] / scale), scale


def query_norm_rsqrt(total, eps) -> Float32:
    """1 / sqrt(total / 1536 + eps), each op IEEE-rounded (graphstep/order.py)."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .f32 m, s;\n\tdiv.rn.f32 m, {$r0}, 0f44C00000;\n\tadd.rn.f32 m, m, {$r1};\n\t"
        "sqrt.rn.f32 s, m;\n\trcp.rn.f32 {$w0}, s;\n\t}",
        write_only_types=[Float32],
        read_only_args=[total, eps],
    )


def lane_norm_rr(values, eps) -> Float32:
    """1 / rms of one 1536-wide row held by one warp (lane l: columns 256 i + 8 l + j as
    values[8 i + j]) in the tiled QueryNorm's order: element e feeds accumulator e % 4 (two
    packed FMA chains), lane total (c0 + c1) + (c2 + c3), one butterfly (graphstep/order.py
    query_norm_tiled)."""
    zero = (Float32(0), Float32(0))
    chains = [zero, zero]
    for e in range(0, 48, 2):
        x = (values[e], values[e + 1])
        chains[e % 4 // 2] = fma2(x, x, chains[e % 4 // 2])
    (c0, c1), (c2, c3) = chains
    total = warp_sum(add_rn(add_rn(c0, c1), add_rn(c2, c3)))
    return query_norm_rsqrt(total, eps)


# -- mailbox ------------------------------------------------------------------------------


def chunk_published(words) -> cutlass.Boolean:
    """A chunk has landed when none of its four words is the sentinel word."""
    landed = words[0] != Uint32(SENTINEL_WORD)
    for i in range(1, 4):
        landed = landed & (words[i] != Uint32(SENTINEL_WORD))
    return landed


def globaltimer() -> Int64:
    """The GPU-wide nanosecond timer (the same on every SM, unlike clock64)."""
    return Int64(cute.arch.globaltimer())


def report_missing(error, linear_chunk):
    """error: int32 [2] = (flag, lowest missing chunk index): set the flag, keep the minimum."""
    cute.arch.inline_ptx(
        "red.global.min.s32 [{$r0}], {$r1};\n\tst.global.s32 [{$r2}], 1;",
        read_only_args=[error + 1, linear_chunk, error],
    )


def in_range(value, bound) -> cutlass.Boolean:
    """0 <= value < bound (bound >= 0) in one unsigned compare: every negative id, -1
    included, is out of range."""
    return Uint32(value) < Uint32(bound)


def record_range(error, check: int, token, value):
    """error: the int32 [4] error word; (check, token, value) into its 64-bit record at
    words 2-3 by atomic min, so the lowest (check, token) wins (kernels/guards.py)."""
    cute.arch.inline_ptx(
        "{\n\t.reg .b64 hi, lo;\n\tcvt.u64.u32 hi, {$r1};\n\tshl.b64 hi, hi, 32;\n\t"
        "cvt.u64.u32 lo, {$r2};\n\tor.b64 hi, hi, lo;\n\tred.global.min.s64 [{$r0}], hi;\n\t}",
        read_only_args=[error + 2, Int32(check << 24) + Int32(token), Int32(value)],
    )


POLL_IN_FLIGHT = 8


@cute.jit
def poll_mailbox(
    mailbox: cute.Pointer,
    error: cute.Pointer,
    first: Int32,
    threads: Int32,
    batch: Int32,
    deadline: Int64,
    gathered: cutlass.Constexpr[int],
    q_heads: cutlass.Constexpr[int],
    row_chunks: cutlass.Constexpr[int],
    skip_lo: cutlass.Constexpr[int],
    skip_n: cutlass.Constexpr[int],
    reported_from: Int32,
):
    """Spin until every chunk of head rows [0, gathered) but [skip_lo, skip_lo + skip_n) of
    `batch` tokens is published, this thread taking chunks first, first + threads, ...
    with 8 volatile loads in flight. A chunk still missing at `deadline` (globaltimer ns)
    goes to report_missing as its linear index over [batch, gathered, row_chunks], plus
    reported_from (where `mailbox` starts in the whole mailbox's index)."""
    token_chunks = (gathered - skip_n) * row_chunks
    chunks = batch * token_chunks
    steps = (chunks + threads - 1) // threads
    for i0 in range(0, steps, POLL_IN_FLIGHT):
        picks = [cutlass.min(first + (i0 + i) * threads, chunks - 1) for i in range(POLL_IN_FLIGHT)]
        tokens = [c // token_chunks for c in picks]
        rows = [c % token_chunks // row_chunks for c in picks]
        if skip_n:
            rows = [r + Int32(cutlass.select_(r >= skip_lo, skip_n, 0)) for r in rows]
        parts = [c % row_chunks for c in picks]
        sources = [
            mailbox + ((tokens[i] * q_heads + rows[i]) * row_chunks + parts[i]) * 16 for i in range(POLL_IN_FLIGHT)
        ]
        loads = [load_u32x4_volatile(source) for source in sources]
        for i in cutlass.range_constexpr(POLL_IN_FLIGHT):  # the loads above are in flight
            landed = chunk_published(loads[i])
            while not landed and globaltimer() < deadline:
                landed = chunk_published(load_u32x4_volatile(sources[i]))
            if not landed:
                report_missing(error, reported_from + (tokens[i] * gathered + rows[i]) * row_chunks + parts[i])


# -- warp MMA -----------------------------------------------------------------------------


def _mma(shape_and_types: str, a, b, c) -> list:
    """One warp MMA with fp32 accumulators: a 4 words, b 2 words, c 4 fp32 (accumulated).
    Fragment layouts are the PTX ISA's for .row.col (g = lane / 4, t = lane % 4)."""
    out = cute.arch.inline_ptx(
        f"mma.sync.aligned.{shape_and_types} {{{{$w0}}, {{$w1}}, {{$w2}}, {{$w3}}}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4,
        read_only_args=[a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]],
    )
    return list(out)


def mma_bf16_16816(a, b, c) -> list:
    """m16n8k16, bf16 pairs in each word."""
    return _mma("m16n8k16.row.col.f32.bf16.bf16.f32", a, b, c)


def mma_f16_16816(a, b, c) -> list:
    """m16n8k16, f16 pairs in each word."""
    return _mma("m16n8k16.row.col.f32.f16.f16.f32", a, b, c)


# A wgmma shared-memory matrix descriptor's start address: bits 4 .. 17 of the operand's
# shared address in its 14-bit field (PTX: encode(x) = (x & 0x3FFFF) >> 4). The 32-bit shared
# address a kernel holds is wider: in a cluster launch it carries the CTA's rank in the
# cluster at bit 24 up (SASS: the shared base is SR_CgaCtaId << 24 | offset), which shifted
# down unmasked lands in the descriptor's leading byte offset (bits 16 .. 29) -- rank 1 of a
# pair read its operands 256 B per k-chunk off. So the field is masked, never just shifted.
DESC_ADDR_MASK = 0x3FFF


def smem_desc_lines(reg: str, operand: str, layout: int) -> list:
    """PTX lines: the 64-bit wgmma descriptor in `reg` of the 32-bit shared address
    `operand` with the layout bits `layout` (LBO, SBO, swizzle): (address >> 4) masked to
    the start-address field (DESC_ADDR_MASK), then the layout or-ed in."""
    return [
        f"cvt.u64.u32 {reg}, {operand};",
        f"shr.u64 {reg}, {reg}, 4;",
        f"and.b64 {reg}, {reg}, {DESC_ADDR_MASK:#x};",
        f"or.b64 {reg}, {reg}, {layout:#018x};",
    ]


def wgmma_bf16_rs(acc, a, b_addr, b_layout: int, b_step: int, b_mn_major: bool, wait: bool = True) -> list:
    """Warpgroup MMA with A in registers: acc[64 rows, 2 len(acc)] += A x B, bf16, FP32
    accumulators (acc in wgmma's C layout, returned updated). a: 4 bf16x2 words per k step
    of 16, mma.sync m16n8k16's A fragment of the warp's 16 rows -- so an m64nN FP32 C
    fragment converts in place, word i = its elements 2i, 2i + 1. B in shared memory:
    descriptor bits b_layout over the 32-bit address b_addr, k step s at b_addr + s x
    b_step bytes, K-major or MN-major (transposed). Issued and committed; wait=False leaves
    it in flight (wgmma.wait_group before acc is read)."""
    count, steps = len(acc), len(a) // 4
    d = ", ".join(f"{{$w{i}}}" for i in range(count))
    lines = ["{", ".reg .b64 b0, b;", ".reg .pred more;"]
    lines += smem_desc_lines("b0", f"{{$r{count + len(a)}}}", b_layout)
    lines += ["setp.eq.b32 more, 0, 0;"] + [f"mov.f32 {{$w{i}}}, {{$r{i}}};" for i in range(count)]
    lines += ["wgmma.fence.sync.aligned;"]
    for s in range(steps):
        words = ", ".join(f"{{$r{count + 4 * s + i}}}" for i in range(4))
        lines.append(f"add.s64 b, b0, {s * b_step >> 4};")
        lines.append(
            f"wgmma.mma_async.sync.aligned.m64n{2 * count}k16.f32.bf16.bf16 {{{d}}}, {{{words}}}, b, more, 1, 1, "
            f"{int(b_mn_major)};"
        )
    lines += ["wgmma.commit_group.sync.aligned;"] + (["wgmma.wait_group.sync.aligned 0;"] if wait else []) + ["}"]
    out = cute.arch.inline_ptx(
        "\n\t".join(lines), write_only_types=[Float32] * count, read_only_args=list(acc) + list(a) + [b_addr]
    )
    return list(out)


# -- shared memory, asynchronous copies, ldmatrix --------------------------------------------
# Shared-memory pointers (a smem tensor's `.iterator` plus a byte offset) lower to 32-bit
# `.shared` addresses in PTX.


def cp_async_16(dst, src, live=True):
    """Copy 16 bytes global -> shared without blocking (`cp.async.cg`, L2 only); where not
    `live` nothing is read and the 16 bytes are zero-filled (live=True: no predicate)."""
    if live is True:
        cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[dst, src])
        return
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
        read_only_args=[dst, src, Int32(cutlass.select_(live, Int32(16), Int32(0)))],
    )


def cp_async_mbar_arrive_noinc(addr):
    """An arrival on the mbarrier at addr once every cp.async this thread has issued so far
    has landed (asynchronous: the thread goes on), which then makes those copies visible to
    the barrier's waiters. .noinc: the barrier's init count includes this arrival."""
    cute.arch.inline_ptx("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{$r0}];", read_only_args=[addr])


def cp_async_commit():
    cute.arch.inline_ptx("cp.async.commit_group;")


def cp_async_wait(pending: int):
    """Wait until at most `pending` of this thread's committed copy groups are in flight."""
    cute.arch.inline_ptx(f"cp.async.wait_group {pending};")


def ld_shared_u32x4(ptr) -> tuple:
    return cute.arch.inline_ptx(
        "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];", write_only_types=[Uint32] * 4, read_only_args=[ptr]
    )


def ld_shared_u32x2(ptr) -> tuple:
    return cute.arch.inline_ptx(
        "ld.shared.v2.b32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Uint32] * 2, read_only_args=[ptr]
    )


def ld_shared_i32(address) -> Int32:
    return cute.arch.inline_ptx(
        "ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[Int32(address)]
    )


def ld_shared_f32(ptr) -> Float32:
    return cute.arch.inline_ptx("ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[ptr])


def ld_shared_f32x4(ptr) -> tuple:
    return cute.arch.inline_ptx(
        "ld.shared.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];", write_only_types=[Float32] * 4, read_only_args=[ptr]
    )


def st_shared_f32(ptr, value):
    cute.arch.inline_ptx("st.shared.f32 [{$r0}], {$r1};", read_only_args=[ptr, value])


def st_shared_f32x2(ptr, a, b):
    cute.arch.inline_ptx("st.shared.v2.f32 [{$r0}], {{$r1}, {$r2}};", read_only_args=[ptr, a, b])


def dsmem_load(address, cta, dtype, count: int) -> tuple:
    """`count` (2 or 4) 32-bit values of `dtype` (Float32 or Int32) at shared address `address`
    (aligned to their bytes) in CTA `cta` of the cluster (mapa, then ld.shared::cluster)."""
    regs = "{" + ", ".join("{$w%d}" % i for i in range(count)) + "}"
    kind = "f32" if dtype is Float32 else "b32"
    return cute.arch.inline_ptx(
        "{\n\t.reg .b32 remote;\n\tmapa.shared::cluster.u32 remote, {$r0}, {$r1};\n\t"
        + f"ld.shared::cluster.v{count}.{kind} {regs}, [remote];\n\t}}",
        write_only_types=[dtype] * count,
        read_only_args=[address, cta],
    )


def dsmem_store(address, cta, dtype, values):
    """Store 1, 2 or 4 32-bit values of `dtype` (Float32 or Int32) at shared address `address`
    (aligned to their bytes) in CTA `cta` of the cluster (`mapa`, then st.shared::cluster)."""
    count = len(values)
    regs = "{$r1}" if count == 1 else "{" + ", ".join("{$r%d}" % (1 + i) for i in range(count)) + "}"
    shape = "" if count == 1 else f".v{count}"
    kind = "f32" if dtype is Float32 else "b32"
    cute.arch.inline_ptx(
        f"st.shared::cluster{shape}.{kind} [{{$r0}}], {regs};", read_only_args=[mapa(address, cta), *values]
    )


def dsmem_push_u32x4(address, cta, words, bar):
    """st.async: 4 words to shared address `address` (16-byte aligned) in CTA `cta` of the
    cluster, their 16 bytes counted (complete_tx) on that CTA's mbarrier at `bar`: a one-way
    hand-off the receiver waits for with `mbar_wait(..., cluster=True)`, no cluster barrier.
    Both addresses mapped here (mapa) for a single push; st_async_u32x4 takes them mapped."""
    st_async_u32x4(mapa(address, cta), words, mapa(bar, cta))


def mbar_arrive_remote(addr, cta):
    """Arrive once on the mbarrier at shared address `addr` in CTA `cta` of the cluster, with
    release at CTA scope: CUTLASS's consumer-release form, enough where the arriving thread
    only hands back shared memory whose reads have completed (their values used, their
    wgmmas waited) for the receiver to overwrite. (Release at cluster scope would order
    everything this CTA wrote before, but ptxas puts MEMBAR.ALL.GPU and ERRBAR before it,
    ~1,000 cycles: it lost in IndexQuery's exchange and SparseCore's crossover, docs/levers.md
    S.10.)"""
    cute.arch.inline_ptx(
        "mbarrier.arrive.release.cta.shared::cluster.b64 _, [{$r0}];", read_only_args=[mapa(addr, cta)]
    )


def mapa(address, cta) -> Int32:
    """The shared::cluster address of shared address `address` in CTA `cta` of the cluster.
    A CTA's window is contiguous: mapa(a) + d addresses a + d there, so a thread pushing
    many chunks maps its base once (st_async_u32x4) instead of once a chunk
    (dsmem_push_u32x4)."""
    return cute.arch.inline_ptx(
        "mapa.shared::cluster.u32 {$w0}, {$r0}, {$r1};", write_only_types=[Int32], read_only_args=[address, cta]
    )


def st_async_u32x4(remote, words, remote_bar):
    """dsmem_push_u32x4 at addresses already mapped (`mapa`): 4 words to shared::cluster
    address `remote` (16-byte aligned), their 16 bytes counted (complete_tx) on the mbarrier
    at shared::cluster address `remote_bar` (in the same CTA as `remote`)."""
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}}, [{$r5}];",
        read_only_args=[remote, *words, remote_bar],
    )


def st_shared_u32x4(ptr, words):
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[ptr, words[0], words[1], words[2], words[3]],
    )


def st_shared_u32(ptr, word):
    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[ptr, word])


def st_shared_bf16(ptr, value):
    """One fp32 value rounded to bf16 (nearest even) into the 2 bytes at shared ptr."""
    cute.arch.inline_ptx(
        "{\n\t.reg .b16 h;\n\tcvt.rn.bf16.f32 h, {$r1};\n\tst.shared.b16 [{$r0}], h;\n\t}", read_only_args=[ptr, value]
    )


def ldmatrix_x4(ptr) -> tuple:
    """Four 8 x 8 b16 matrices: lanes 8i..8i+7 give the row addresses of matrix i; lane
    (g = lane / 4, t = lane % 4) receives row g, columns 2t, 2t + 1 of each."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[ptr],
    )


def ldmatrix_x4_trans(ptr) -> tuple:
    """As ldmatrix_x4, transposed: lane (g, t) receives rows 2t, 2t + 1 of column g."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[ptr],
    )


def exp2_approx(x) -> Float32:
    """2^x (ex2.approx: about 2 ulp; -inf -> +0)."""
    return cute.arch.inline_ptx("ex2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x])


# -- host side ----------------------------------------------------------------------------


def gmem_ptr(dtype, address: int = 0, align: int = 16):
    """A global pointer argument (address 0 for compilation only)."""
    return make_ptr(dtype, address, AddressSpace.gmem, assumed_align=align)


# -- mbarriers and bulk copies (32-bit shared addresses) ----------------------------------
# A ring stage filled by bulk copies (the async proxy) and read with ld.shared / ldmatrix
# (the generic proxy) must be handed back only after `fence_proxy_async` by every reader:
# ptxas may issue an mbarrier arrive or bar.sync before the loads' data has returned
# (measured on the H200: bench/RESULTS.md, the DsaIndex ring-reuse race).


def mbar_init(addr, count: int):
    cute.arch.inline_ptx(f"mbarrier.init.shared::cta.b64 [{{$r0}}], {count};", read_only_args=[addr])


def mbar_init_fence():
    """The mbarrier initializations visible to the async proxy (bulk copies) and to the
    cluster's other CTAs (st.async pushes), before the barrier that publishes them."""
    cute.arch.inline_ptx("fence.mbarrier_init.release.cluster;")


def mbar_expect(addr, nbytes):
    """Arrive once and expect `nbytes` more in the current phase (bulk copies, st.async)."""
    cute.arch.inline_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{$r0}], {$r1};", read_only_args=[addr, nbytes])


def mbar_arrive(addr):
    cute.arch.inline_ptx("mbarrier.arrive.shared::cta.b64 _, [{$r0}];", read_only_args=[addr])


@dsl_user_op
def mbar_wait(addr, parity, cluster: bool = False, *, loc=None, ip=None):
    """Spin until the mbarrier's phase with this parity has completed. cluster: acquire at
    cluster scope, so what other CTAs stored into this CTA (st.async completing on this
    mbarrier) is visible once the phase completes. A wait that has spun
    guards.MBAR_WAIT_LIMIT_NS executes `trap` (a kernel bug: the launch fails instead of
    hanging).

    One asm block through LLVM's inline asm (inline_ptx cannot name `%globaltimer_hi`): a
    first try that branches on its own predicate, so a completed phase costs what an
    unbounded spin's does, then a spin that reads the clock only after a failed try (the
    DSL-control-flow form cost TopK ~1 us at 128K, bench/RESULTS.md sessions 21-22). The
    memory clobber keeps loads and stores on their side of the wait. The clock is the
    timer's high word (2**32 ns units): one register across the spin. It traps once that
    word has advanced by more than guards.wait_limit_units(), compared signed, so a timer
    that stepped back never traps a healthy wait. Labels are local to the block's braces."""
    order = ".acquire.cluster" if cluster else ""
    attempt = f"mbarrier.try_wait.parity{order}.shared::cta.b64 p, [$0], $1;"
    asm = (
        "{\n\t.reg .pred p;\n\t.reg .b32 t0, t1;\n\t"
        f"{attempt}\n\t@p bra DONE;\n\tmov.u32 t0, %globaltimer_hi;\n"
        f"SPIN:\n\t{attempt}\n\t@p bra DONE;\n\tmov.u32 t1, %globaltimer_hi;\n\t"
        f"sub.s32 t1, t1, t0;\n\tsetp.gt.s32 p, t1, {guards.wait_limit_units()};\n\t@p trap;\n\t"
        "bra SPIN;\nDONE:\n\t}"
    )
    # a parity known when the kernel is traced is an immediate, as in a hand-written wait
    parity_constraint = "n" if isinstance(parity, int) else "r"
    llvm.inline_asm(
        res=None,
        operands_=[Int32(addr).ir_value(loc=loc, ip=ip), Int32(parity).ir_value(loc=loc, ip=ip)],
        asm_string=asm,
        constraints=f"r,{parity_constraint},~{{memory}}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def bulk_copy_g2s(dst, src, nbytes, bar):
    """Global -> shared bulk copy (a multiple of 16 bytes, both ends 16-byte aligned), its
    bytes completing on the mbarrier at `bar`."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[dst, src, nbytes, bar],
    )


def fence_proxy_async():
    """Order this thread's generic-proxy shared-memory accesses with the async proxy's: its
    writes visible to wgmma / bulk copies, its reads done before a bulk copy overwrites them."""
    cute.arch.inline_ptx("fence.proxy.async.shared::cta;")


def named_sync(barrier: int, threads: int):
    """Wait at named barrier `barrier` until `threads` threads (whole warps) have arrived. The
    non-aligned form (`barrier.sync`, not `bar.sync`): warps of different roles may reach it at
    different instructions, which the aligned form leaves undefined by the PTX spec. ptxas
    assembles both to the same BAR.SYNC (SparseCore's `.text` is byte-identical either way,
    session 27) but lists only this one in the cubin's member-mask instructions (EIATTR 0x28),
    which compute-sanitizer's synccheck reads (session 28: the aligned form in role branches is
    reported as divergent, this one is not)."""
    cute.arch.inline_ptx(f"barrier.sync {barrier}, {threads};")


def named_arrive(barrier: int, threads: int):
    """Arrive at named barrier `barrier` (of `threads` threads) without waiting; non-aligned, as
    named_sync."""
    cute.arch.inline_ptx(f"barrier.arrive {barrier}, {threads};")
