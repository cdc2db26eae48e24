import pytest

from graphstep.floor import MMA_RATE, stage_costs, step_floor
from graphstep.shapes import RankShape, Topology, preset


def test_design_indexer_floor_by_hand():
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    step = step_floor(shape, 1, 32768)
    wq_b = 64 * 128 * 1536 * 2
    cache = 32768 * 132
    assert step.indexer_bytes == wq_b + cache == 29_491_200
    assert step.indexer_us == pytest.approx(6.858, abs=1e-3)
    # the indexer floors at B = 4, 16, 64 of the project's first H200 measurements
    assert [round(step_floor(shape, b, 32768).indexer_us, 1) for b in (4, 16, 64)] == [9.9, 21.9, 70.2]


def test_mla_query_and_sparse_core_by_hand_under_dcp():
    shape = RankShape(preset("kimi-k3.1"), Topology(tp=8, dcp=2))
    by = {c.name: c for c in stage_costs(shape, 4, 1000)}
    assert by["mla_query"].weight_bytes == 8 * 192 * 1536 * 2 + 8 * 128 * 512 * 2 + (1536 + 512) * 2
    assert by["mla_query"].io_bytes == 4 * (1536 + 512 + 64) * 2 + 4 * 8 * 1152 * 2 + 4 * 1152
    # top-k 1000 of 1000 tokens, half of them on this rank; 16 gathered heads
    assert by["sparse_core"].bytes == 4 * 500 * (1152 + 4) + 4 * 16 * (1152 + 1024 + 4)
    assert by["sparse_core"].flops == 2 * 4 * 16 * 500 * (576 + 512)  # QK^T over 576 dims, P @ V over 512
    assert by["query_wait"].bytes == 4 * 16 * 1152
    assert by["index_score"].cache_bytes == 4 * 500 * 132
    # under DCP TopK writes k candidates (position and fp32 score) a token; DcpMerge reads every rank's, writes slots
    assert by["top_k"].io_bytes == 4 * 500 * 4 + 4 * 2048 * 8
    assert by["dcp_merge"].bytes == 4 * 2 * 2048 * 8 + 4 * 2048 * 4 and by["dcp_merge"].stream == "main"
    assert "dcp_merge" not in {c.name for c in stage_costs(RankShape(preset("kimi-k3.1"), Topology(tp=8)), 4, 1000)}


def test_step_floor_leaves_intermediates_out():
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    step = step_floor(shape, 16, 32768)
    scores = 16 * 32768 * 4
    assert step.bytes == sum(c.bytes for c in step.costs) - 2 * scores


def test_floor_rejects_bad_sizes():
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    with pytest.raises(ValueError, match="batch"):
        stage_costs(shape, 0, 10)
    with pytest.raises(ValueError, match="context"):
        stage_costs(shape, 1, -1)


def test_sparse_core_at_128_heads_is_compute_bound():
    for cache in ("fp8", "bf16"):
        by = {
            c.name: c
            for c in stage_costs(RankShape(preset("deepseek-v3.2"), Topology(tp=1, mla_cache=cache)), 1, 32768)
        }
        assert by["sparse_core"].mma_us() == pytest.approx(2 * 128 * 2048 * 1088 / MMA_RATE * 1e6)
        assert by["sparse_core"].mma_us() > by["sparse_core"].floor_us()
    tp8 = {c.name: c for c in stage_costs(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), 64, 32768)}
    assert tp8["sparse_core"].mma_us() < tp8["sparse_core"].floor_us() / 5


@pytest.mark.parametrize("preset_name", ["deepseek-v3.2", "kimi-k3.1"])
@pytest.mark.parametrize(
    "topology", [Topology(tp=1, mla_cache="fp8"), Topology(tp=1), Topology(tp=8), Topology(tp=8, dcp=2)]
)
def test_bytes_floor_bounds_the_main_chain_with_flops_counted(preset_name, topology):
    """The step's bytes floor is a floor even where a stage is compute-bound: the main stream's
    stages in sequence, each at max(bytes time, MMA time), take no longer than it."""
    shape = RankShape(preset(preset_name), topology)
    for context in (2048, 32768, 131072):
        for batch in (1, 4, 16, 64):
            step = step_floor(shape, batch, context)
            chain = sum(
                max((c.bytes - c.intermediate_bytes) / step.bandwidth * 1e6, c.mma_us())
                for c in step.costs
                if c.stream == "main"
            )
            assert chain <= step.us, (context, batch)
