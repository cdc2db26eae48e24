import pytest

from graphstep.shapes import PRESETS, ModelShape, RankShape, Topology, check_batch, preset, tiled_from


def test_deepseek_preset_sizes():
    m = preset("deepseek-v3.2")
    assert (m.hidden, m.heads, m.q_lora_rank, m.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (m.query_row, m.qk_head_dim, m.index_token_bytes) == (576, 192, 132)
    assert (m.mla_token_bytes("bf16"), m.mla_token_bytes("fp8")) == (1152, 656)
    assert m.packed_width == 1536 + 512 + 64 + 128 + 64
    assert m.packed_columns["idx_w"] == (2240, 2304)
    assert m.assumed == ()


def test_kimi_preset_marks_assumptions():
    m = PRESETS["kimi-k3.1"]
    assert m.heads == 64 and "heads" in m.assumed


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


@pytest.mark.parametrize("batch", [0, -3, 1.5, True])
def test_batch_must_be_positive_int(batch):
    with pytest.raises(ValueError, match="batch must be a positive int"):
        check_batch(batch)


def test_tiled_from():
    assert tiled_from(128) == 8 and tiled_from(16) == 16
    with pytest.raises(ValueError):
        tiled_from(0)
