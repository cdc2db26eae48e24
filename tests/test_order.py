"""The QueryNorm order model against an independent scalar emulation of the kernels
(numpy float32, thread by thread) and against a plain RMSNorm."""

import numpy as np
import pytest
import torch

from graphstep import order
from graphstep.reference import rms_norm
from graphstep.shapes import tiled_from

EPS = 1e-6


def _rows(batch, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, 1536, generator=g) * scale).bfloat16()
    gamma = (1 + 0.1 * torch.randn(1536, generator=g)).bfloat16()
    return x, gamma


def _f32(v):
    return np.float32(v)


def _butterfly(lanes):
    lanes = [np.float32(v) for v in lanes]
    for offset in (16, 8, 4, 2, 1):
        lanes = [np.float32(lanes[i] + lanes[i ^ offset]) for i in range(32)]
    return lanes


def _rsqrt(total):
    mean = np.float32(total / np.float32(1536))
    return np.float32(np.float32(1) / np.sqrt(np.float32(mean + np.float32(EPS))))


def _scalar_rows(x, gamma):
    """One CTA of 256 threads per row, written as the kernel reads."""
    xs, gs = x.float().numpy(), gamma.float().numpy()
    out = np.empty_like(xs)
    for r in range(xs.shape[0]):
        totals = []
        for t in range(256):
            acc = np.float32(0)
            if t < 192:
                for i in range(8):
                    v = xs[r, 8 * t + i]
                    acc = np.float32(v * v + acc)  # exact product, one rounding
            totals.append(acc)
        partial = [_butterfly(totals[32 * w : 32 * w + 32])[0] for w in range(8)]
        total = np.float32(0)
        for w in range(8):
            total = np.float32(total + partial[w])
        rr = _rsqrt(total)
        out[r] = (xs[r] * rr).astype(np.float32) * gs
    return torch.from_numpy(out).bfloat16()


def _scalar_tiled(x, gamma):
    xs, gs = x.float().numpy(), gamma.float().numpy()
    out = np.empty_like(xs)
    for r in range(xs.shape[0]):
        lane_totals = []
        for lane in range(32):
            cols = [256 * i + 8 * lane + j for i in range(6) for j in range(8)]
            chains = [[np.float32(0), np.float32(0)], [np.float32(0), np.float32(0)]]
            for e in range(0, 48, 2):
                c = chains[e % 4 // 2]
                a, b = xs[r, cols[e]], xs[r, cols[e + 1]]
                c[0], c[1] = np.float32(a * a + c[0]), np.float32(b * b + c[1])
            (c0, c1), (c2, c3) = chains
            lane_totals.append(np.float32(np.float32(c0 + c1) + np.float32(c2 + c3)))
        rr = _rsqrt(_butterfly(lane_totals)[0])
        out[r] = (xs[r] * rr).astype(np.float32) * gs
    return torch.from_numpy(out).bfloat16()


@pytest.mark.parametrize("seed", [0, 1])
def test_row_variant_matches_scalar_emulation(seed):
    x, gamma = _rows(3, seed)
    assert torch.equal(order.query_norm_rows(x, gamma, EPS), _scalar_rows(x, gamma))


@pytest.mark.parametrize("seed", [0, 1])
def test_tiled_variant_matches_scalar_emulation(seed):
    x, gamma = _rows(3, seed, scale=3.0)
    assert torch.equal(order.query_norm_tiled(x, gamma, EPS), _scalar_tiled(x, gamma))


def test_order_model_is_an_rmsnorm_within_bf16_rounding_but_not_the_plain_one():
    x, gamma = _rows(256, 7)
    plain = rms_norm(x, gamma, EPS).bfloat16()
    exact = rms_norm(x, gamma, EPS, acc=torch.float64)
    for variant in (order.query_norm_rows, order.query_norm_tiled):
        got = variant(x, gamma, EPS)
        # within one bf16 rounding of the exact value (relative 2^-8)
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()
        assert not torch.equal(got, plain), "the order model must model something the plain norm does not"
    assert not torch.equal(order.query_norm_rows(x, gamma, EPS), order.query_norm_tiled(x, gamma, EPS))


def test_variant_choice_follows_tiled_from():
    heads = 16
    x, gamma = _rows(tiled_from(heads), 3)
    assert torch.equal(order.query_norm(x, gamma, EPS, heads), order.query_norm_tiled(x, gamma, EPS))
    assert torch.equal(order.query_norm(x[:-1], gamma, EPS, heads), order.query_norm_rows(x[:-1], gamma, EPS))


def test_warp_sum_lanes_agree_and_sum():
    v = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    s = order.warp_sum(v)
    assert torch.equal(s, s[:, :1].expand(-1, 32))
    assert torch.allclose(s[:, 0].double(), v.double().sum(-1), rtol=1e-5, atol=1e-5)


def test_order_model_rejects_bad_rows():
    with pytest.raises(ValueError, match="bf16"):
        order.query_norm_rows(torch.randn(2, 1536), torch.ones(1536).bfloat16(), EPS)
    with pytest.raises(ValueError, match="gamma"):
        order.query_norm_tiled(torch.randn(2, 1536).bfloat16(), torch.ones(512).bfloat16(), EPS)
