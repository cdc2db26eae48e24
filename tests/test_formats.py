import math
import struct
from dataclasses import replace

import pytest
import torch

from conftest import hadamard_matrix, rel_err
from graphstep import formats
from graphstep import reference as ref
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState


def test_no_encoded_query_word_is_the_sentinel():
    x = torch.randn(64, 576) * 1000
    x[0, :5] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e30])
    for fmt in ("bf16", "fp8"):
        words = formats.encode_q_rows(x, fmt).contiguous().view(torch.int32)
        assert not (words == -1).any()


def test_mailbox_landing_and_first_missing(small):
    state = LayerState(small.with_topology(dcp=2, rank=0), max_batch=3, max_context=64)
    caches = state.clone_caches()
    assert not formats.chunk_landed(caches.mailbox, 3, 8).any()
    assert formats.first_missing(caches.mailbox, 3, 8) == (0, 0, 0)
    rows = torch.randn(3, 4, 576)
    ref.publish(state, caches, rows)  # rank 0: head rows 0..3
    assert formats.chunk_landed(caches.mailbox, 3, 8)[:, :4].all()
    assert formats.first_missing(caches.mailbox, 3, 8) == (0, 4, 0)
    ref.publish(state, caches, rows, rank=1)
    assert formats.first_missing(caches.mailbox, 3, 8) is None
    # a torn chunk: one word still the sentinel
    caches.mailbox[2, 6, 17 * 16 + 4 : 17 * 16 + 8] = formats.SENTINEL_BYTE
    assert formats.first_missing(caches.mailbox, 3, 8) == (2, 6, 17)
    # pad rows beyond `gathered` are never polled
    assert state.shape.q_heads == 16 and formats.first_missing(caches.mailbox, 3, 8) == (2, 6, 17)


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_mla_fp8_round_trip(scale_format):
    rows = torch.randn(10, 576) * 3
    packed = formats.pack_mla_fp8(rows, 512, scale_format)
    assert packed.shape == (10, 656) and packed.dtype == torch.uint8
    back = formats.unpack_mla_fp8(packed, 512)
    assert torch.equal(back[:, 512:], rows[:, 512:].bfloat16().float())
    err = (back[:, :512] - rows[:, :512]).norm() / rows[:, :512].norm()
    assert 0 < err < 0.05
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, formats.quantize_fp8_rows(rows[:, :512].view(10, 4, 128), scale_format=scale_format)[1])


def test_index_cache_views_share_storage():
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    keys, scales = formats.index_cache_views(cache, 64, 128)
    scales[1, 3] = 2.5
    keys[1, 3, 0] = 7
    assert cache[1, 3 * 128] == 7 and cache[1, 8192 + 12 : 8192 + 16].view(torch.float32).item() == 2.5


# -- DeepSeek-V3.2-Exp's model.py: YaRN, the softmax scale, the indexer rotation, ue8m0 --------


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def test_yarn_table_against_the_public_formula_in_float64():
    m = preset("deepseek-v3.2")
    cos, sin = formats.rope_table(163840, 64, m.rope_theta, m.yarn)
    # model.py precompute_freqs_cis with config_671B_v3.2.json: dim 64, base 10000, factor 40,
    # original_seq_len 4096, beta_fast 32, beta_slow 1 -> correction range [10, 23]
    low = math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000)))
    high = math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(10000)))
    assert (low, high) == (10, 23)
    for pos in (0, 4095, 4096, 163839):
        for i in range(32):
            freq = 10000.0 ** (-2 * i / 64)
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            angle = pos * (freq / 40 * ramp + freq * (1 - ramp))
            assert abs(float(cos[pos, i]) - math.cos(angle)) <= 1e-6, (pos, i)
            assert abs(float(sin[pos, i]) - math.sin(angle)) <= 1e-6, (pos, i)
    plain_cos, _ = formats.rope_table(163840, 64, m.rope_theta)
    assert torch.equal(cos[:, :10], plain_cos[:, :10])  # below the range: the plain frequencies
    assert not torch.allclose(cos[4096:, 23:], plain_cos[4096:, 23:])  # above it: divided by 40


def test_yarn_tables_follow_the_shape_and_its_flag():
    m = preset("deepseek-v3.2")
    yarn = LayerState(RankShape(m, Topology(tp=8)), max_batch=1, max_context=4200, seed=0).weights
    plain = LayerState(RankShape(replace(m, rope_scaling=None), Topology(tp=8)), 1, 4200, seed=0).weights
    expect = formats.rope_table(4200, 64, 10000.0, m.yarn)
    for table in (yarn.rope_cos, yarn.index_rope_cos):
        assert torch.equal(table, expect[0])
    assert torch.equal(plain.rope_cos, formats.rope_table(4200, 64, 10000.0)[0])
    # model.py applies YaRN only if max_seq_len > original_seq_len
    assert replace(m, max_seq_len=4096).yarn is None and m.yarn is m.rope_scaling


def test_softmax_scale_includes_yarn_m_squared():
    m = preset("deepseek-v3.2")
    mscale = 0.1 * 1.0 * math.log(40) + 1  # model.py MLA.__init__
    assert math.isclose(m.softmax_scale, 192**-0.5 * mscale * mscale, rel_tol=1e-15)
    assert math.isclose(m.softmax_scale / 192**-0.5, 1.8739, rel_tol=1e-4)
    assert replace(m, rope_scaling=None).softmax_scale == 192**-0.5
    assert replace(m, max_seq_len=4096).softmax_scale == 192**-0.5
    kimi = preset("kimi-k3.1")
    assert math.isclose(kimi.softmax_scale, 192**-0.5 * (0.1 * math.log(64) + 1) ** 2, rel_tol=1e-15)


def test_hadamard_is_orthogonal_and_equals_the_matrix_form():
    matrix = hadamard_matrix(128)
    assert torch.allclose(matrix @ matrix.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, 5, 128, dtype=torch.float64)
    assert torch.allclose(ref.hadamard(x), x @ matrix.T, atol=1e-12)
    assert torch.allclose(ref.hadamard(ref.hadamard(x)), x, atol=1e-12)  # symmetric and orthogonal: its own inverse
    assert rel_err(ref.hadamard(x.float()), x @ matrix.T) < 1e-6  # the fp32 transform
    # column j: the butterflies put (-1)^popcount(i & j) / sqrt(128) at row i
    columns = ref.hadamard(torch.eye(128, dtype=torch.float64))
    assert torch.equal(columns.sign(), matrix.sign()) and (columns.abs() == 128**-0.5).all()


def test_ue8m0_scales_are_the_power_of_two_at_or_above_amax_over_448():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 128, generator=g) * torch.logspace(-6, 6, 200)[:, None]
    x[0] = 0  # amax clamped to 1e-4
    x[1, 7] = 448.0  # amax x fp32(1/448) lands next to 1: model.py multiplies by the inverse
    x[2, 0] = -448.0 * 2**-20
    values, scales = formats.quantize_fp8_rows(x, scale_format="ue8m0")
    for row, scale in zip(x, scales.tolist()):
        scaled = _f32(_f32(max(float(row.abs().max()), 1e-4)) * _f32(1 / 448))
        assert scale == 2.0 ** math.ceil(math.log2(scaled)), (scale, scaled)
        assert math.frexp(scale)[0] == 0.5  # an exact power of two
    # a power-of-two scale divides exactly: value x scale is x's e4m3 rounding
    back = formats.fp8_to_float(values) * scales[:, None]
    assert torch.equal(back, (x / scales[:, None]).to(formats.FP8).float() * scales[:, None])
    assert ((back - x).abs() <= x.abs() / 16 + scales[:, None] * 2**-9).all()
    fp32_values, fp32_scales = formats.quantize_fp8_rows(x)
    assert torch.equal(fp32_scales, x.abs().amax(-1).clamp_min(1e-4) / 448)
    assert (scales >= fp32_scales).all() and (scales < 2 * fp32_scales * (1 + 2**-20)).all()
