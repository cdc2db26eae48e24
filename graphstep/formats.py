"""Byte formats shared by the reference and the kernels (docs/design.md §3).

Indexer cache page (64 tokens): [64 x 128 fp8 e4m3 keys | 64 x fp32 scales] = 64 x 132 B.
MLA cache token: bf16 [576], or fp8 656 B = [512 fp8 | 4 fp32 scales per 128 | 64 bf16 rope].
Mailbox: per token q_heads rows of 576 elements (bf16 or fp8), read as 16-byte chunks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .shapes import RopeScaling

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Every byte of an armed mailbox chunk. 0xFFFF is a NaN bf16 and 0xFF a NaN e4m3,
# and the publishers' conversions (cvt.rn.bf16x2.f32, cvt.rn.satfinite.e4m3x2.f32)
# only ever produce the canonical NaNs 0x7FFF / 0x7F, so no published word can be
# 0xFFFFFFFF: a chunk has landed when none of its four words is the sentinel word.
SENTINEL_BYTE = 0xFF
SENTINEL_WORD = 0xFFFFFFFF
CHUNK = 16


# -- indexer cache -----------------------------------------------------------------


def index_page_bytes(page_size: int, index_dim: int) -> int:
    """Bytes of one indexer cache page: page_size e4m3 keys of index_dim bytes, then page_size fp32
    scales."""
    return page_size * (index_dim + 4)


def index_cache_views(cache: torch.Tensor, page_size: int, index_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys uint8 [pages, page, dim], scales fp32 [pages, page]) views of a uint8 page cache."""
    pages = cache.shape[0]
    keys = cache[:, : page_size * index_dim].view(pages, page_size, index_dim)
    scales = cache[:, page_size * index_dim :].view(torch.float32).view(pages, page_size)
    return keys, scales


INV_FP8_MAX_F32 = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))  # fp32(1 / 448), exact as a float


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax -> the power of two at or above amax x fp32(1 / 448): DeepSeek-V3.2-Exp
    inference/kernel.py act_quant with scale_fmt set (fast_round_scale: 2^ceil(log2)), exact
    on the bits: adding 2^23 - 1 carries into the exponent unless the mantissa is zero."""
    scaled = amax.float() * INV_FP8_MAX_F32  # a Python float: no host tensor copied during graph capture
    return ((scaled.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize_fp8_rows(
    x: torch.Tensor, eps: float = 1e-4, scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization (DeepSeek's act_quant with a 128 block = the row):
    scale = max(amax, eps) / 448 ("fp32") or rounded up to a power of two ("ue8m0"),
    values = x / scale. Returns (uint8 values, fp32 scales)."""
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp_min(eps)
    scale = ue8m0_scale(amax) if scale_format == "ue8m0" else amax / FP8_MAX
    values = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.view(torch.uint8), scale


def fp8_to_float(values: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bytes -> fp32 values (for checks and the torch stages)."""
    return values.view(FP8).float()


# -- MLA cache -----------------------------------------------------------------------


def pack_mla_fp8(rows: torch.Tensor, kv_lora_rank: int, scale_format: str = "fp32") -> torch.Tensor:
    """[..., 576] float rows -> [..., 656] uint8: fp8 latent with a scale per 128 (in
    scale_format, as quantize_fp8_rows), bf16 rope."""
    latent, rope = rows[..., :kv_lora_rank].float(), rows[..., kv_lora_rank:]
    blocks = latent.unflatten(-1, (kv_lora_rank // 128, 128))
    values, scales = quantize_fp8_rows(blocks, scale_format=scale_format)
    return torch.cat(
        [
            values.flatten(-2),
            scales.contiguous().view(torch.uint8),
            rope.to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def unpack_mla_fp8(packed: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """[..., 656] uint8 -> [..., 576] fp32 (dequantized latent, rope)."""
    blocks = kv_lora_rank // 128
    values = fp8_to_float(packed[..., :kv_lora_rank].contiguous()).unflatten(-1, (blocks, 128))
    scales = packed[..., kv_lora_rank : kv_lora_rank + 4 * blocks].contiguous().view(torch.float32)
    rope = packed[..., kv_lora_rank + 4 * blocks :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(values * scales.unsqueeze(-1)).flatten(-2), rope], dim=-1)


def mla_rows(cache: torch.Tensor, cache_format: str, kv_lora_rank: int) -> torch.Tensor:
    """The MLA cache as fp32 rows [pages, page, 576], whatever its format."""
    if cache_format == "bf16":
        return cache.float()
    return unpack_mla_fp8(cache, kv_lora_rank)


# -- query rows / mailbox --------------------------------------------------------------


def q_dtype(q_format: str) -> torch.dtype:
    """The torch dtype of the query rows in `q_format` ("bf16" or "fp8" = e4m3)."""
    return torch.bfloat16 if q_format == "bf16" else FP8


def encode_q_rows(rows: torch.Tensor, q_format: str) -> torch.Tensor:
    """Float query rows -> their storage (bf16, or e4m3 saturated to +-448), as uint8 bytes.
    NaNs become the canonical NaN the GPU conversions produce (bf16 0x7FFF, e4m3 0x7F),
    so, as on the GPU, no encoded word can equal the sentinel word."""
    nan = torch.isnan(rows)  # (masked_fill with a Python scalar stays capturable in a CUDA graph)
    if q_format == "bf16":
        return rows.to(torch.bfloat16).view(torch.int16).masked_fill(nan, 0x7FFF).view(torch.uint8)
    return rows.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8).masked_fill(nan, 0x7F)


def decode_q_rows(data: torch.Tensor, q_format: str) -> torch.Tensor:
    """uint8 storage [..., 576 x q_bytes] -> fp32 rows [..., 576]."""
    return data.view(q_dtype(q_format)).float()


def arm(mailbox: torch.Tensor) -> torch.Tensor:
    """Write the sentinel into every chunk (the re-arm for the next step)."""
    return mailbox.fill_(SENTINEL_BYTE)


def chunk_landed(mailbox: torch.Tensor, batch: int, gathered: int) -> torch.Tensor:
    """bool [batch, gathered, chunks]: the chunks QueryWait would accept as published.

    mailbox is uint8 [tokens, q_heads, row bytes]; only the first `gathered` rows of
    each token are polled (pad rows up to q_heads never are)."""
    words = mailbox[:batch, :gathered].contiguous().view(torch.int32)
    words = words.unflatten(-1, (-1, CHUNK // 4))
    return (words != -1).all(dim=-1)  # -1 == 0xFFFFFFFF as int32


def first_missing(mailbox: torch.Tensor, batch: int, gathered: int) -> tuple[int, int, int] | None:
    """(token, head row, chunk) of the lowest chunk not yet published, or None."""
    missing = (~chunk_landed(mailbox, batch, gathered)).flatten().nonzero()
    if missing.numel() == 0:
        return None
    index = int(missing[0])
    chunks = mailbox.shape[-1] // CHUNK
    return index // (gathered * chunks), index // chunks % gathered, index % chunks


# -- RoPE --------------------------------------------------------------------------------


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, yarn: RopeScaling) -> torch.Tensor:
    """YaRN's blend of the plain frequencies and the frequencies / factor (DeepSeek-V3.2-Exp
    inference/model.py precompute_freqs_cis): pairs below the correction range keep their
    frequency, pairs above it are divided by the factor, a linear ramp in between. The range
    is where a pair turns beta_fast and beta_slow times over the original positions."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as model.py: a one-step ramp instead of a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def rope_table(
    max_positions: int, dim: int, theta: float, yarn: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [max_positions, dim / 2], computed in float64 then rounded once (model.py
    works in fp32 throughout). yarn: the scaling in effect (ModelShape.yarn), None: plain."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if yarn is not None:
        inv_freq = yarn_inv_freq(inv_freq, dim, theta, yarn)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA RoPE: rotate pairs (2i, 2i+1). x [..., dim]; cos/sin broadcast to [..., dim/2]."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer RoPE: rotate halves (i, i + dim/2)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
