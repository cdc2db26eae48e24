"""The order model of QueryNorm: torch code doing the kernels' FP32 operations in the
kernels' exact order, so a GPU result can be checked with `torch.equal`.

Why plain fp32 adds model the kernels' FMAs: every input is bf16 (8 significant
bits), so x * x is exact in fp32 and fma(x, x, t) = round(x * x + t) equals the fp32
add t + x * x. (This holds while x * x does not underflow, |x| >= 2^-63; random data
never gets near.) The rsqrt is 1 / sqrt(total / 1536 + eps) with IEEE division and
square root on both sides (div.rn / sqrt.rn / rcp.rn in the PTX, checked by the tests).
"""

from __future__ import annotations

import torch

from .shapes import tiled_from

COLUMNS = 1536
BUTTERFLY = (16, 8, 4, 2, 1)  # kernels/primitives.py warp_sum's shuffle-xor offsets
_LANES = torch.arange(32)


def warp_sum(values: torch.Tensor) -> torch.Tensor:
    """[..., 32] lane values -> [..., 32] after the butterfly: v += shfl_xor(v, offset)."""
    for offset in BUTTERFLY:
        values = values + values[..., _LANES.to(values.device) ^ offset]
    return values


def query_norm_rsqrt(total: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(total / 1536 + eps) in fp32, each op correctly rounded.

    Every operand is a full tensor: on CUDA, torch turns a division by a Python scalar
    into a multiplication by its reciprocal, which rounds differently (seen on the H200)."""
    columns = torch.full_like(total, COLUMNS)
    eps32 = torch.full_like(total, eps)
    return torch.ones_like(total) / torch.sqrt(total / columns + eps32)


def _check(x: torch.Tensor, gamma: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != COLUMNS or x.dtype != torch.bfloat16:
        raise ValueError(f"q_a rows must be bf16 [B, {COLUMNS}], got {x.dtype} {tuple(x.shape)}")
    if gamma.shape != (COLUMNS,):
        raise ValueError(f"gamma must be [{COLUMNS}], got {tuple(gamma.shape)}")


def query_norm_rows(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """Row variant: 256 threads per row, thread t < 192 takes columns 8t..8t+7 in a
    sequential FMA chain; warp butterfly; the 8 warp partials summed in warp order."""
    _check(x, gamma)
    batch = x.shape[0]
    values = x.float().view(batch, 192, 8)
    chains = torch.zeros(batch, 256, device=x.device)
    for i in range(8):
        chains[:, :192] = chains[:, :192] + values[:, :, i] * values[:, :, i]
    partials = warp_sum(chains.view(batch, 8, 32))[..., 0]
    total = torch.zeros(batch, device=x.device)
    for warp in range(8):
        total = total + partials[:, warp]
    rr = query_norm_rsqrt(total, eps)
    out = values * rr[:, None, None] * gamma.float().view(192, 8)
    return out.to(torch.bfloat16).view(batch, COLUMNS)


def query_norm_tiled(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """Tiled variant: a warp per row, lane l holds columns 256 i + 8 l + j (i < 6, j < 8)
    as elements e = 8 i + j; element e feeds accumulator e % 4 (chain (e % 4) // 2 of
    the packed pairs), lane total (c0 + c1) + (c2 + c3), warp butterfly."""
    _check(x, gamma)
    batch = x.shape[0]
    lanes = x.float().view(batch, 6, 32, 8).permute(0, 2, 1, 3).reshape(batch, 32, 48)
    acc = torch.zeros(batch, 32, 4, device=x.device)
    for e in range(48):
        acc[..., e % 4] = acc[..., e % 4] + lanes[..., e] * lanes[..., e]
    lane_total = (acc[..., 0] + acc[..., 1]) + (acc[..., 2] + acc[..., 3])
    rr = query_norm_rsqrt(warp_sum(lane_total)[:, 0], eps)
    g = gamma.float().view(6, 32, 8).permute(1, 0, 2).reshape(32, 48)
    out = lanes * rr[:, None, None] * g
    return out.view(batch, 32, 6, 8).permute(0, 2, 1, 3).to(torch.bfloat16).reshape(batch, COLUMNS)


def query_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """The variant QueryNorm and MlaQuery use for this batch: tiled from tiled_from(heads)."""
    tiled = x.shape[0] >= tiled_from(heads)
    return (query_norm_tiled if tiled else query_norm_rows)(x, gamma, eps)
