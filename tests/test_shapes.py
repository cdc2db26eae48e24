from dataclasses import replace

import pytest

from graphstep.shapes import PRESETS, ModelShape, RankShape, RopeScaling, Topology, check_batch, preset, tiled_from


def test_deepseek_preset_sizes():
    m = preset("deepseek-v3.2")
    assert (m.hidden, m.heads, m.q_lora_rank, m.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (m.query_row, m.qk_head_dim, m.index_token_bytes) == (576, 192, 132)
    assert (m.mla_token_bytes("bf16"), m.mla_token_bytes("fp8")) == (1152, 656)
    assert m.packed_width == 1536 + 512 + 64 + 128 + 64
    assert m.packed_columns["idx_w"] == (2240, 2304)
    assert m.assumed == ()


def test_deepseek_preset_is_the_public_models_rope_rotation_and_scale_format():
    m = preset("deepseek-v3.2")
    assert (m.rope_theta, m.max_seq_len) == (10000.0, 163840)
    assert m.rope_scaling == RopeScaling("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert m.index_rotation and m.fp8_scale_format == "ue8m0"
    plain = replace(m, rope_scaling=None, index_rotation=False, fp8_scale_format="fp32")
    assert plain.yarn is None and plain.softmax_scale == 192**-0.5


def test_kimi_preset_marks_assumptions():
    m = PRESETS["kimi-k3.1"]
    assert m.heads == 64 and "heads" in m.assumed
    assert {"index_rotation", "fp8_scale_format"} <= set(m.assumed)
    # Kimi K2's public RoPE: theta 50000, YaRN factor 64 over 4096 positions, betas 1 and 1
    assert (m.rope_theta, m.max_seq_len) == (50000.0, 262144)
    assert m.yarn == RopeScaling(factor=64.0, beta_fast=1.0, beta_slow=1.0)


def test_rank_sizes_under_tp_and_dcp():
    m = preset("deepseek-v3.2")
    tp8 = RankShape(m, Topology(tp=8))
    assert (tp8.heads, tp8.gathered, tp8.q_heads, tp8.q_bytes, tp8.mailbox_row_chunks) == (16, 16, 16, 2, 72)
    dcp = RankShape(preset("kimi-k3.1"), Topology(tp=16, dcp=2, rank=1, q_format="fp8"))
    assert (dcp.heads, dcp.gathered, dcp.q_heads, dcp.q_bytes, dcp.mailbox_row_chunks) == (4, 8, 16, 1, 36)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tp=0), "Topology.tp"),
        (dict(dcp=-1), "Topology.dcp"),
        (dict(tp=2, wide=True), "Topology.wide"),
        (dict(split=True), "Topology.split"),
        (dict(dcp=2, rank=2), "Topology.rank"),
        (dict(dcp=2, q_format=None), "Topology.q_format"),
        (dict(q_format="fp16"), "Topology.q_format"),
        (dict(mla_cache="int8"), "Topology.mla_cache"),
    ],
)
def test_invalid_topologies_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Topology(**kwargs)


def test_tp_must_divide_heads_and_lists_allowed():
    with pytest.raises(ValueError, match=r"Topology.tp=3 .* \(allowed tp: \[1, 2, 4, 8, 16, 32, 64, 128\]"):
        RankShape(preset("deepseek-v3.2"), Topology(tp=3))


def test_invalid_shapes():
    with pytest.raises(ValueError, match="ModelShape.heads"):
        ModelShape(name="x", heads=0)
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelShape(name="x", q_lora_rank=1024)
    with pytest.raises(ValueError, match="unknown preset 'v4'"):
        preset("v4")
    with pytest.raises(ValueError, match="fp8_scale_format"):
        ModelShape(name="x", fp8_scale_format="e8m0")
    with pytest.raises(ValueError, match="power-of-two index_dim"):
        ModelShape(name="x", index_dim=96, index_rope_dim=64)
    ModelShape(name="x", index_dim=96, index_rope_dim=64, index_rotation=False)
    with pytest.raises(ValueError, match="RopeScaling.type"):
        RopeScaling(type="linear")
    with pytest.raises(ValueError, match="factor"):
        RopeScaling(factor=1.0)
    with pytest.raises(ValueError, match="beta_fast >= beta_slow"):
        RopeScaling(beta_fast=1.0, beta_slow=32.0)
    with pytest.raises(ValueError, match="factor must be finite"):
        RopeScaling(factor=float("inf"))
    with pytest.raises(ValueError, match="finite beta_fast"):
        RopeScaling(beta_fast=float("inf"))
    with pytest.raises(ValueError, match="mscale_all_dim"):
        RopeScaling(mscale=0.707)
    with pytest.raises(ValueError, match="ModelShape.max_seq_len"):
        ModelShape(name="x", max_seq_len=0)
    for name, value in (("rms_eps", -1.0), ("index_norm_eps", 0.0), ("rope_theta", float("nan")), ("rope_theta", 0)):
        with pytest.raises(ValueError, match=rf"ModelShape.{name} must be a finite number > 0, got {value!r}"):
            ModelShape(name="x", **{name: value})
    ModelShape(name="x", rope_theta=50000)  # an int base is a number


@pytest.mark.parametrize("batch", [0, -3, 1.5, True, "4", None])
def test_batch_must_be_positive_int(batch):
    with pytest.raises(ValueError, match="batch must be a positive int"):
        check_batch(batch)


def test_batch_takes_numpy_and_torch_integers_as_ints():
    import numpy as np
    import torch

    for batch in (np.int64(3), torch.tensor(3)):
        assert check_batch(batch) == 3 and type(check_batch(batch)) is int
    for batch in (np.bool_(True), torch.tensor(True)):
        with pytest.raises(ValueError, match="batch must be a positive int"):
            check_batch(batch)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dcp=2, rank=1.0), r"Topology.rank must be an int in \[0, 2\), got 1.0"),
        (dict(dcp=2, rank=True), "Topology.rank must be an int"),
        (dict(dcp=2, rank="0"), "Topology.rank must be an int"),
        (dict(tp=1, wide="no"), "Topology.wide must be a bool, got 'no'"),
        (dict(dcp=2, split=1), "Topology.split must be a bool, got 1"),
    ],
)
def test_topology_fields_of_the_wrong_type_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology(**kwargs)


def test_rank_shape_names_its_argument_types():
    expected = r"takes a ModelShape \(e.g. preset\('deepseek-v3.2'\)\) and a Topology, got str"
    with pytest.raises(TypeError, match=expected):
        RankShape("deepseek-v3.2", Topology(tp=8))
    with pytest.raises(TypeError, match="got ModelShape and NoneType"):
        RankShape(preset("deepseek-v3.2"), None)


def test_tiled_from():
    assert tiled_from(128) == 8 and tiled_from(16) == 16
    with pytest.raises(ValueError):
        tiled_from(0)
