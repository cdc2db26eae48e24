"""bench_indexer.py --dsa-trace's reading of DsaIndex's trace probe (dsa_index.TRACE_SLOTS),
on a synthetic trace: the CPU half of the probe, whose kernel half is compiled and checked
in test_kernels_compile.py."""

import sys
from pathlib import Path

import pytest
import torch
from graphstep.kernels import dsa_index

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_indexer import dsa_timeline  # noqa: E402


def _trace(batch: int, run: int, width: int, lives) -> torch.Tensor:
    """CTA (chunk c, token b) at 2 GHz: starts at 1 s + 100 c + 1000 b ns (a high word of 1),
    waits 1000 cycles, stages its query by 3000, then its pages 2000 cycles apart from 4000;
    exits 1000 cycles after its last page. lives[c]: its pages (0: it writes nothing)."""
    trace = torch.full((batch, width), float("nan"))
    words = trace.view(torch.int32)
    for b in range(batch):
        for c, live in enumerate(lives):
            if not live:
                continue
            o = c * run * 64
            clk_end = 4000 + 2000 * (live - 1) + 1000
            start = (1 << 32) + 1_000_000 + 100 * c + 1000 * b
            end = start + clk_end // 2
            words[b, o : o + 8] = torch.tensor(
                [start & 0xFFFFFFFF, start >> 32, end & 0xFFFFFFFF, end >> 32, clk_end, 1000, 3000, live]
            ).int()
            for i in range(min(live, dsa_index.TRACE_PAGES)):
                words[b, o + 8 + i] = 4000 + 2000 * i
    return trace


@pytest.mark.parametrize("run", [2, 32])
def test_dsa_timeline_reads_each_ctas_phases(run):
    width = 4 * run * 64
    got = dsa_timeline(_trace(2, run, width, [run, run, run, 0]), run)
    assert got["ctas"] == 6 and got["ghz"] == pytest.approx(2.0)
    # starts 0, .1, .2, 1, 1.1, 1.2 us: torch's median is the lower middle one
    assert got["start_p50"] == pytest.approx(0.2) and got["start_max"] == pytest.approx(1.2)
    assert got["wait_min"] == pytest.approx(0.5) and got["wait_max"] == pytest.approx(1.7)
    assert got["query"] == pytest.approx(1.0) and got["first_page"] == pytest.approx(0.5)
    assert got["per_page"] == pytest.approx(1.0) and got["tail"] == pytest.approx(0.5)
    last = (4000 + 2000 * (run - 1) + 1000) / 2000
    assert got["end_max"] == pytest.approx(1.2 + last)


def test_dsa_timeline_takes_the_traced_pages_of_a_run_longer_than_its_slots():
    run = 128  # 128 live pages, TRACE_PAGES of them traced
    got = dsa_timeline(_trace(1, run, run * 64, [run]), run)
    assert dsa_index.TRACE_PAGES < run and got["per_page"] == pytest.approx(1.0)
    assert got["tail"] > 1.0  # measured from the last traced page


def test_launch_gaps_measure_each_boundary_from_the_previous_launch():
    """Three launches (absolute ns: first CTA start t0, first wait return, last exit):
    10000 / 10500 / 13000, 11500 / 15000 / 17500, 16500 / 20000 / 22500."""
    from bench_indexer import launch_gaps

    first = dict(t0_ns=10_000, wait_min=0.5, end_max=3.0)
    second = dict(t0_ns=11_500, wait_min=3.5, end_max=6.0)
    third = dict(t0_ns=16_500, wait_min=3.5, end_max=6.0)
    got = launch_gaps([first, second, third])
    assert got["start_after_trigger"] == pytest.approx(1.25)  # 11500 - 10500, 16500 - 15000
    assert got["wait_after_end"] == pytest.approx(2.25)  # 15000 - 13000, 20000 - 17500
    assert got["period"] == pytest.approx(4.75)  # 15000 - 10500, 20000 - 15000


def test_top_k_timeline_reads_each_ctas_phases():
    """top_k.TRACE_SLOTS per CTA at the start of each row, at 2 GHz (exit 6000 cycles after
    entry over 3000 ns): wait 1000 cycles, loaded at 2000, round 0's bin at 3000, round 1's at
    4000 in half the CTAs (round 2 in none), compacted at 5000; the list written at 3200;
    round 0's histogram complete at 2600 and its group sums landed at 2800, round 1's at
    3600 and 3800; the medians in us."""
    from bench_indexer import top_k_timeline
    from graphstep.kernels import top_k

    batch, ctas, k = 2, 8, 2048
    out = torch.full((batch, k), -1, dtype=torch.int32)
    slots = len(top_k.TRACE_SLOTS)
    for b in range(batch):
        for c in range(ctas):
            start = (1 << 32) + 1_000_000 + 100 * c
            end = start + 3000
            round1 = 4000 if c % 2 else 0
            marks = {"start": start & 0xFFFFFFFF, "start_hi": start >> 32, "end": end & 0xFFFFFFFF, "end_hi": end >> 32}
            marks |= {"clk_end": 6000, "clk_wait": 1000, "clk_loaded": 2000, "clk_round0": 3000}
            marks |= {"clk_round1": round1, "clk_round2": 0, "clk_compacted": 5000, "clk_listed": 3200}
            marks |= {"clk_hist0": 2600, "clk_groups0": 2800, "clk_hist1": 3600 if round1 else 0, "clk_hist2": 0}
            marks |= {"clk_groups1": 3800 if round1 else 0, "clk_groups2": 0}
            out[b, slots * c : slots * (c + 1)] = torch.tensor([marks[name] for name in top_k.TRACE_SLOTS]).int()
    got = top_k_timeline(out, ctas)
    assert got["ctas"] == batch * ctas and got["ghz"] == pytest.approx(2.0)
    for name, us in (("wait", 0.5), ("load", 0.5), ("round0", 0.5), ("round1", 0.5), ("tail", 0.5), ("total", 2.5)):
        assert got[name] == pytest.approx(us), name
    assert got["rounds_12"] == "0.50 / 0.00" and got["round2"] != got["round2"]  # NaN: no CTA ran it
    # compact: from the last round each CTA ran (4000 or 3000) to 5000: 0.5 or 1.0 us, median of the two
    assert got["compact"] in (pytest.approx(0.5), pytest.approx(1.0))
    assert got["list"] == pytest.approx(0.1)
    assert got["parts0"] == "0.30 / 0.10 / 0.10" and got["parts1"] == "0.20 / 0.10 / 0.10"
    assert got["parts2"] == "nan / nan / nan"


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_dsa_sources_read_disjoint_pages_past_twice_l2(batch):
    """bench_indexer's DsaIndex graphs cycle over (cache, block tables) pairs whose pages do not
    overlap, other sequences' tables before cache copies, as many as reading 2x L2 asks
    (capped at 8 copies): a small launch is not timed from L2."""
    from bench_indexer import L2_BYTES, dsa_sources

    from graphstep.shapes import RankShape, Topology, preset
    from graphstep.state import LayerState

    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=16, max_context=4096, seed=1)
    context, m = 4096, state.shape.model
    sources = dsa_sources(state, batch, context)
    per_launch = batch * context * m.index_token_bytes
    caches = {id(cache) for cache, _ in sources}
    assert len(caches) == min(-(-len(sources) // (16 // batch)), 8)
    assert len(sources) * per_launch > 2 * L2_BYTES or len(caches) == 8
    seen = {}
    for cache, tables in sources:
        assert tables.shape == (batch, state.pages_per_seq)
        pages = set(tables[:, : context // m.page_size].flatten().tolist())
        assert pages.isdisjoint(seen.setdefault(id(cache), set())), "two launches read one page of one cache"
        seen[id(cache)] |= pages
