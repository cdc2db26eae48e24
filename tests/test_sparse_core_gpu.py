"""SparseCore (sparse MLA decode over the selected slots) on an sm_90 GPU against the
reference: 8 (padded to 16), 16, 32, 64 and 128 query rows, both cache formats and both
query formats, every slots-per-CTA variant, the plan's choice at B = 1, 3 and 64, and
slot lists with holes, repeats, a short selection and none at all. Outputs poisoned first."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from graphstep import formats
from graphstep import reference as ref
from graphstep.launch import ErrorWord, Kernels, MailboxTimeout
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_sparse_core import CROSSOVER_PATHS  # noqa: E402

pytestmark = pytest.mark.gpu
BF16, FP8 = 2e-3, 1e-2  # P is rounded to bf16 for P @ V; e4m3 keys are rounded to bf16
CASES = {  # name: (preset, topology, tolerance); gathered query rows in the name
    "q16-tp8-bf16": ("deepseek-v3.2", Topology(tp=8), BF16),
    "q8-kimi-tp8-bf16": ("kimi-k3.1", Topology(tp=8), BF16),  # 8 rows padded to a 16-row tile
    "q16-kimi-dcp2-fp8": ("kimi-k3.1", Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8"), FP8),
    "q16-tp8-fp8cache": ("deepseek-v3.2", Topology(tp=8, mla_cache="fp8"), FP8),  # bf16 query rows
    "q32-tp8-dcp2-bf16": ("deepseek-v3.2", Topology(tp=8, dcp=2), BF16),
    "q32-tp8-dcp2-fp8": ("deepseek-v3.2", Topology(tp=8, dcp=2, q_format="fp8", mla_cache="fp8"), FP8),
    "q64-kimi-tp1-fp8cache": ("kimi-k3.1", Topology(tp=1, mla_cache="fp8"), FP8),
    "q128-tp1-fp8": ("deepseek-v3.2", Topology(tp=1, q_format="fp8", mla_cache="fp8"), FP8),
    "q128-tp1-fp8cache": ("deepseek-v3.2", Topology(tp=1, mla_cache="fp8"), FP8),  # bf16 query rows (the bench's)
    "q128-tp1-bf16": ("deepseek-v3.2", Topology(tp=1), BF16),
}
_STATES: dict = {}


def _state(case):
    if case not in _STATES:
        model, topology, _ = CASES[case]
        _STATES[case] = LayerState(
            RankShape(preset(model), topology),
            max_batch=64,
            max_context=4096,
            seed=int(torch.randint(0, 2**31, ())),
            device="cuda",
        )
    return _STATES[case]


def _slots(total: int, batch: int, k: int) -> torch.Tensor:
    """Random distinct slots per token, then (where the batch has the rows): row 1 a
    selection shorter than any split, row 2 holes anywhere, row 3 nothing, row 4 every
    slot four times over with a whole 256-slot run empty."""
    slots = torch.stack([torch.randperm(total, device="cuda")[:k] for _ in range(batch)]).int()
    if batch >= 5:
        slots[1, 10:] = -1
        slots[2][torch.rand(k, device="cuda") < 0.3] = -1
        slots[3] = -1
        slots[4] = slots[4, : k // 4].repeat(4)
        slots[4, 256:512] = -1
    return slots


def _mma_paths(monkeypatch, least: int):
    """16-row CTAs on the mma.sync paths: partial_mma_ws from `least` blocks a CTA (1 << 30:
    partial_mma_sync everywhere), the transposed path off."""
    from graphstep.kernels import sparse_core

    monkeypatch.setattr(sparse_core, "MMA_PRODUCER_BLOCKS", {"bf16": least, "fp8": least})
    monkeypatch.setattr(sparse_core, "TRANSPOSED_BLOCKS", {"bf16": 0, "fp8": 0})


def _shifted(caches, shift: int):
    """A copy of the caches whose fp8 MLA rows are 2^shift times theirs (each 128-dim group's
    scale and the bf16 rope, exactly)."""
    rows = caches.mla_cache.clone()
    flat = rows.view(-1, rows.shape[-1])
    flat[:, 512:528].view(torch.float32).mul_(2.0**shift)
    flat[:, 528:].view(torch.bfloat16).mul_(2.0**shift)
    return dataclasses.replace(caches, mla_cache=rows)


def _outlying(caches, direction: torch.Tensor, shift: int):
    """A copy of the caches where every 64th fp8 MLA row has latent -448 x the sign of
    `direction`'s and its scales x 2^shift: for query rows along `direction` its score is
    far below every other row's (P = 0) while its scales are far above theirs."""
    rows = caches.mla_cache.clone()
    flat = rows.view(-1, rows.shape[-1])[::64]
    flat[:, :512] = (-448 * torch.sign(direction[:512])).to(torch.float8_e4m3fn).view(torch.uint8)
    flat[:, 512:528].view(torch.float32).mul_(2.0**shift)
    return dataclasses.replace(caches, mla_cache=rows)


def _check(case, batch, slots_per_cta=None, big=None, cache_shift=0, q_shift=0, outliers=None):
    """big: latent dim 0 of every query row set to it. cache_shift / q_shift: the fp8 cache's
    rows / the query rows x 2^shift (exact). outliers: query rows along one direction and
    _outlying's rows, their scales x 2^outliers."""
    state = _state(case)
    s, m = state.shape, state.shape.model
    topology, tolerance = CASES[case][1], CASES[case][2]
    kernels = Kernels(s, state.weights)
    k = m.index_topk
    caches = _shifted(state.caches, cache_shift) if cache_shift else state.caches
    rows = torch.randn(batch, s.gathered, m.query_row, device="cuda") * 0.3 * 2.0**q_shift
    if outliers is not None:
        direction = torch.randn(m.query_row, device="cuda")
        caches = _outlying(caches, direction, outliers)
        rows = 0.3 * direction + 0.5 * rows
    if big is not None:
        rows[:, :, 0] = big
    mailbox = formats.arm(torch.empty(batch, s.q_heads, m.query_row * s.q_bytes, dtype=torch.uint8, device="cuda"))
    mailbox[:, : s.gathered] = formats.encode_q_rows(rows, topology.q_format).view(batch, s.gathered, -1)
    total = caches.mla_cache.view(-1, caches.mla_cache.shape[-1]).shape[0]
    slots = _slots(total, batch, k)
    out = torch.full((batch, s.gathered, m.kv_lora_rank), float("nan"), device="cuda")
    lse = torch.full((batch, s.gathered), float("nan"), device="cuda")
    partial_o, partial_ml = kernels.sparse_core_buffers(batch, "cuda")
    if slots_per_cta is not None:
        n = batch * k // slots_per_cta
        partial_o, partial_ml = (
            torch.full((n, s.q_heads, m.kv_lora_rank), float("nan"), device="cuda"),
            torch.full((n, s.q_heads, 2), float("nan"), device="cuda"),
        )
    kernels.sparse_core(mailbox, slots, caches.mla_cache, partial_o, partial_ml, out, lse, batch, slots_per_cta)
    torch.cuda.synchronize()
    q = formats.decode_q_rows(mailbox[:, : s.gathered], topology.q_format)
    expect_out, expect_lse = ref.sparse_attention(state, caches, q, slots)
    assert torch.isfinite(out).all(), "every output element written"
    live = [b for b in range(batch) if not (batch >= 5 and b == 3)]
    if batch >= 5:
        assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()
    assert torch.isfinite(lse[live]).all()
    err = rel_err(out[live], expect_out[live])
    assert err < tolerance, err
    assert (lse[live] - expect_lse[live]).abs().max() < tolerance * 10
    return out, lse


@pytest.mark.parametrize("batch", [1, 3, 5, 64])
@pytest.mark.parametrize("case", CASES)
def test_sparse_core_plan_matches_the_reference(case, batch):
    _check(case, batch)


@pytest.mark.parametrize("slots_per_cta", [None, 64, 128])
@pytest.mark.parametrize("batch", [5, 64])
@pytest.mark.parametrize("case", ["q128-tp1-fp8", "q128-tp1-bf16"])
def test_the_producer_path_with_half_block_scorers_matches_the_reference(monkeypatch, case, batch, slots_per_cta):
    """The producer warpgroup's consumers scoring half a block each and exchanging row maxima
    at every block count (without the crossover, the default past RESHAPE_BLOCKS;
    bench_sparse_core.py --paths wsh)."""
    from graphstep.kernels import sparse_core

    monkeypatch.setattr(sparse_core, "CROSSOVER", dict.fromkeys(sparse_core.CROSSOVER, False))
    monkeypatch.setattr(sparse_core, "RESHAPE_BLOCKS", 0)
    _check(case, batch, slots_per_cta)


@pytest.mark.parametrize("values_rs", [False, True])
@pytest.mark.parametrize("slots_per_cta", [16, 32, 64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("case", ["q128-tp1-bf16", "q64-kimi-tp1-fp8cache"])
def test_every_split_variant_of_the_producer_path_matches_the_reference(monkeypatch, case, slots_per_cta, values_rs):
    """The producer path with FlashMLA's consumer shape at every block count (the default up
    to RESHAPE_BLOCKS; bench_sparse_core.py --paths wsr), whatever the cache's default: the
    bf16 cache's cp.async producer, bf16 query rows, 64 gathered heads (one block: no
    P_FREE wait; 16 and 32 slots: blocks narrower than 64); with the values warpgroup's P
    from shared memory or, sparse_core.VALUES_RS, from registers."""
    from graphstep.kernels import sparse_core

    monkeypatch.setattr(sparse_core, "RESHAPE_BLOCKS", 1 << 30)
    monkeypatch.setattr(sparse_core, "VALUES_RS", values_rs)
    _check(case, 5, slots_per_cta)


@pytest.mark.parametrize("slots_per_cta", [16, 32, 64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("case", ["q16-tp8-bf16", "q16-kimi-dcp2-fp8", "q128-tp1-fp8"])
def test_every_split_variant_matches_the_reference(case, slots_per_cta):
    _check(case, 5, slots_per_cta)


def _crossover(monkeypatch, knobs):
    """sparse_core.CROSSOVER on (the producer path's head-group pairs sharing each block's
    loads, bench_sparse_core.py --paths wsx) with the module's other constants but `knobs`
    (a CONSUMERS entry: the constants its path sets)."""
    from graphstep.kernels import sparse_core

    monkeypatch.setattr(sparse_core, "CROSSOVER", dict.fromkeys(sparse_core.CROSSOVER, True))
    for name, value in knobs.items():
        monkeypatch.setattr(sparse_core, name, value)


# The crossover's variants run here, by bench_sparse_core.py path (its CROSSOVER_PATHS: the
# constants each sets): wsx the module's; wsxv P from registers, wsxq no prefetch, wsxa every
# rescale (wsxp / wsxs are the defaults today, so wsx runs them).
CONSUMERS = {p: CROSSOVER_PATHS[p] for p in ("wsx", "wsxv", "wsxq", "wsxa")}


@pytest.mark.parametrize("path", CONSUMERS)
@pytest.mark.parametrize("batch", [1, 3, 5, 64])
@pytest.mark.parametrize("case", ["q128-tp1-fp8", "q128-tp1-fp8cache", "q128-tp1-bf16", "q64-kimi-tp1-fp8cache"])
def test_the_crossover_matches_the_reference(monkeypatch, case, batch, path):
    """At the plan's split (B = 1 / 3: one or two blocks a CTA, 5 and 64 with holes, repeated
    slots, a short selection and a token with none): each CTA of a head-group pair loads half
    of every block into both (bf16 rows: raw chunks through registers); 64 heads (no
    partner) run today's kernel."""
    from graphstep.kernels import catalog, sparse_core

    _crossover(monkeypatch, CONSUMERS[path])
    shape = _state(case).shape
    op = catalog.build(
        shape,
        "sparse_core",
        slots=sparse_core.plan(batch, shape.q_heads, shape.model.index_topk, shape.topology.mla_cache),
    ).op
    assert op.crossover == (shape.q_heads == 128) and op.values_rs == (path == "wsxv" and op.reshape)
    assert op.prefetch == (path != "wsxq" and op.crossover and op.mla_fp8)
    assert op.skip_unmoved == (path != "wsxa" and op.reshape)
    _check(case, batch)


@pytest.mark.parametrize("path", CONSUMERS)
@pytest.mark.parametrize("slots_per_cta", [64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("case", ["q128-tp1-fp8", "q128-tp1-bf16"])
def test_every_split_variant_of_the_crossover_matches_the_reference(monkeypatch, case, slots_per_cta, path):
    """1, 2, 4 .. 32 blocks a CTA: the remote releases (from 3 blocks on), both stages' reuse
    across the pair, one split normalizing itself; fp8 and raw bf16 rows."""
    _crossover(monkeypatch, CONSUMERS[path])
    _check(case, 5, slots_per_cta)


@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("case", ["q128-tp1-fp8", "q128-tp1-bf16"])
def test_skipping_unmoved_rescales_changes_no_bit(monkeypatch, case, batch):
    """sparse_core.SKIP_UNMOVED (the default; path wsxa without it) leaves out only
    multiplications by factors of exactly 1: on the same inputs out and lse equal every
    rescale's bit for bit."""
    from graphstep.kernels import sparse_core

    _crossover(monkeypatch, CONSUMERS["wsx"])
    results = []
    for skip in (False, True):
        monkeypatch.setattr(sparse_core, "SKIP_UNMOVED", skip)
        torch.manual_seed(11)
        results.append(_check(case, batch))
    (out, lse), (skipped_out, skipped_lse) = results
    assert torch.equal(out, skipped_out) and torch.equal(lse, skipped_lse)


@pytest.mark.parametrize("batch", [5, 64])
def test_the_crossover_over_far_scaled_rows_matches_the_reference(monkeypatch, batch):
    """The fp8 rows x 2^24 / 2^-24 and the bf16 query rows x 2^-24 / 2^24 (exact; the scores
    unchanged, the output x 2^shift): the peer's half dequantized with its rows' scales."""
    _crossover(monkeypatch, CONSUMERS["wsx"])
    for shift in (24, -24):
        _check("q128-tp1-fp8cache", batch, cache_shift=shift, q_shift=-shift)


@pytest.mark.parametrize(
    "case, slots_per_cta",
    [
        ("q128-tp1-fp8", None),  # the crossover
        ("q128-tp1-fp8cache", 2048),
        ("q64-kimi-tp1-fp8cache", None),  # partial_wgmma_ws, two shares a producer thread
        ("q16-tp8-fp8cache", None),  # the transposed path
        ("q16-tp8-fp8cache", 2048),
        ("q16-kimi-dcp2-fp8", 64),
    ],
)
@pytest.mark.parametrize("batch", [5, 64])
def test_wide_fp8_row_loads_change_no_bit(monkeypatch, case, slots_per_cta, batch):
    """sparse_core.FP8_ROW_LOADS "16B" (the wgmma paths' fp8 rows two chunks a load) dequantize the
    same e4m3 and scales into the same bf16 tiles as "8B": out and lse equal its bit for bit on the
    same inputs (and the reference, within _check's tolerance)."""
    from graphstep.kernels import catalog, sparse_core

    _crossover(monkeypatch, CONSUMERS["wsx"])
    _transposed(monkeypatch)
    results = []
    for loads in ("8B", "16B"):
        monkeypatch.setattr(sparse_core, "FP8_ROW_LOADS", dict.fromkeys(sparse_core.FP8_ROW_LOADS, loads))
        shape = _state(case).shape
        topk, cache = shape.model.index_topk, shape.topology.mla_cache
        op = catalog.build(
            shape, "sparse_core", slots=slots_per_cta or sparse_core.plan(batch, shape.q_heads, topk, cache)
        ).op
        assert op.wide_fp8 == (loads != "8B")  # (every case here is a wgmma path at 64-slot blocks)
        torch.manual_seed(13)
        results.append(_check(case, batch, slots_per_cta))
    (out, lse), (wide_out, wide_lse) = results
    assert torch.equal(out, wide_out) and torch.equal(lse, wide_lse)


@pytest.mark.parametrize("case", ["q128-tp1-fp8", "q128-tp1-bf16"])
def test_poll_and_the_crossover(monkeypatch, case):
    """The poll (fork_poll) on the crossover: each CTA of a pair polls its own rows."""
    _crossover(monkeypatch, CONSUMERS["wsx"])
    test_poll_waits_for_the_rows_and_names_a_chunk_never_published(case, 2, None)


BULK = [None, 0, 3, 16]  # partial_mma_ws's bulk-copied sixteenths: the module's, none, a few, all


def _bulk_rows(monkeypatch, bulk):
    """partial_mma_ws at every block count, with `bulk` / 16 of each block's rows bulk-copied
    (None: sparse_core.MMA_BULK_SIXTEENTHS)."""
    from graphstep.kernels import sparse_core

    _mma_paths(monkeypatch, 1)
    if bulk is not None:
        monkeypatch.setattr(sparse_core, "MMA_BULK_SIXTEENTHS", {"bf16": bulk, "fp8": bulk})


@pytest.mark.parametrize("bulk", BULK, ids=lambda n: "default" if n is None else f"bulk{n}")
@pytest.mark.parametrize("slots_per_cta", [16, 32, 64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("case", ["q16-tp8-bf16", "q16-tp8-fp8cache", "q16-kimi-dcp2-fp8"])
def test_every_split_variant_of_the_mma_producer_path_matches_the_reference(monkeypatch, case, slots_per_cta, bulk):
    """partial_mma_ws (16 rows; its producer warpgroup: bulk copies for the first bulk / 16
    of each block's rows, 16-byte cp.async for the rest, on one full mbarrier) at every
    block count, whatever MMA_PRODUCER_BLOCKS says (bench_sparse_core.py --paths mws,
    mwsN): its ring of 2 .. 4 stages, one block or many, blocks narrower than 64 (lanes
    without a row; 3/16 of 16 rows: 3 bulk rows, 13 by cp.async over 3 warps), holes (a
    live row bulk-copied, zeros by cp.async), blocks without a live slot skipped, both
    caches (the fp8 rows widened into the MMA operands), bf16 and fp8 query rows."""
    _bulk_rows(monkeypatch, bulk)
    _check(case, 5, slots_per_cta)


@pytest.mark.parametrize("slots_per_cta", [256, 512, 1024])
@pytest.mark.parametrize("case", ["q16-tp8-bf16", "q16-tp8-fp8cache", "q16-kimi-dcp2-fp8"])
def test_the_combine_in_a_cluster_of_2_4_or_8_splits_matches_the_reference(monkeypatch, case, slots_per_cta):
    """partial_mma_ws with CLUSTER_SPLITS 8: a token's 8 / 4 / 2 split CTAs launch as one
    cluster and combine their rows over DSMEM (cluster_combine: each CTA 64 / 128 / 256 of the
    512 dims), no combine kernel; B = 5: holes, slots repeated and token 3 with no slot
    (out 0, lse -inf from a cluster none of whose CTAs has a live slot)."""
    from graphstep.kernels import catalog, sparse_core

    _mma_paths(monkeypatch, 1)
    monkeypatch.setattr(sparse_core, "CLUSTER_SPLITS", 8)
    state = _state(case)
    assert catalog.build(state.shape, "sparse_core", slots=slots_per_cta, publish=False).op.clustered
    _check(case, 5, slots_per_cta)


@pytest.mark.parametrize("bulk", [0, 5, 8, 12, 16], ids=lambda n: f"bulk{n}")
@pytest.mark.parametrize("batch", [1, 3, 64])
@pytest.mark.parametrize("case", ["q16-tp8-bf16", "q16-tp8-fp8cache"])
def test_the_mma_producer_path_at_each_row_split_matches_the_reference(monkeypatch, case, batch, bulk):
    """partial_mma_ws at the plan's split of B = 1 / 3 (one block of 32 slots) and 64 (16
    blocks of 64, the ring reused) with each row split the bench sweeps (mws0 .. mws16), so
    the stages written by both kinds of copies are refilled after each release."""
    _bulk_rows(monkeypatch, bulk)
    _check(case, batch)


@pytest.mark.parametrize("batch", [1, 3, 5, 64])
@pytest.mark.parametrize("case", ["q16-tp8-fp8cache", "q16-kimi-dcp2-fp8"])
def test_the_mma_producer_path_over_fp8_matches_the_reference(monkeypatch, case, batch):
    """partial_mma_ws's f16 consumers over the fp8 cache at the plan's split of every batch
    (B = 1 and 3: one block of 32 slots; 5: holes, a token with no slot, slots repeated; 64:
    16 blocks a CTA), bf16 query rows (their f16 powers of two) and e4m3 ones."""

    _mma_paths(monkeypatch, 1)
    _check(case, batch)


@pytest.mark.parametrize("big", [6e4, 65504.0, 7e4, -7e4])
@pytest.mark.parametrize("slots_per_cta", [None, 2048])
def test_the_mma_producer_path_takes_query_elements_past_f16s_range(monkeypatch, slots_per_cta, big):
    """partial_mma_ws over the fp8 cache with bf16 query rows whose latent dim 0 is near or
    past f16's 65504 (6e4; 65504, which bf16 rounds to 65536; +-7e4): each row enters its
    f16 operands x 2^(15 - its largest exponent), so the scores stay finite and exact
    (unguarded f16 operands turned them into inf)."""

    _mma_paths(monkeypatch, 1)
    _check("q16-tp8-fp8cache", 5, slots_per_cta, big=big)


@pytest.mark.parametrize("batch", [5, 64])
@pytest.mark.parametrize("shift", [24, -24])
def test_the_mma_producer_path_takes_queries_and_scales_past_f16s_range(monkeypatch, shift, batch):
    """partial_mma_ws over the fp8 cache with the cache's rows x 2^shift and the bf16 query
    rows x 2^-shift (the scores unchanged, the output x 2^shift): shift 24 takes the query
    elements (~2^-26) below f16's subnormals and P x scale (scales ~2^18) past 65504, -24
    the query elements (~2^22) past 65504 and P x scale (~2^-30) below f16's subnormals --
    each a zero or an inf with unguarded f16 operands; the guards' powers of two keep them
    exact."""

    _mma_paths(monkeypatch, 1)
    _check("q16-tp8-fp8cache", batch, cache_shift=shift, q_shift=-shift)


@pytest.mark.parametrize("batch", [5, 64])
@pytest.mark.parametrize("case", ["q16-tp8-fp8cache", "q16-kimi-dcp2-fp8"])
def test_the_mma_producer_path_takes_slots_of_far_larger_scales_and_no_weight(monkeypatch, case, batch):
    """partial_mma_ws over the fp8 cache where every 64th cache row has scales 2^40 times the
    others' and a score far below theirs (P = 0): P x scale's f16 power of two follows each
    row's largest P x scale, so those rows do not push the others' P x scale under f16's
    subnormals (a power of two from the largest scale alone did: about 0.98 relative error
    in a CPU model of the CTA)."""

    _mma_paths(monkeypatch, 1)
    _check(case, batch, outliers=40)


def test_the_mma_producer_path_takes_e4m3_queries_with_scales_below_f16s_range(monkeypatch):
    """As above with e4m3 query rows (exact in f16 as they are) over the cache's rows x 2^-24:
    P x scale (~2^-30) below f16's subnormals, the scores ~0 (nearly uniform attention).
    (Scales past 65504 need query rows x 2^-17 to keep the scores finite, below e4m3's
    range: the bf16 rows' test above has them.)"""

    _mma_paths(monkeypatch, 1)
    _check("q16-kimi-dcp2-fp8", 5, cache_shift=-24)


@pytest.mark.parametrize("slots_per_cta", [None, 1024, 2048])
@pytest.mark.parametrize("case", ["q16-tp8-bf16", "q16-kimi-dcp2-fp8"])
def test_the_mma_path_without_the_producer_matches_the_reference(monkeypatch, case, slots_per_cta):
    """partial_mma_sync forced (bench_sparse_core.py --paths msync) whatever
    MMA_PRODUCER_BLOCKS says."""

    _mma_paths(monkeypatch, 1 << 30)
    _check(case, 5, slots_per_cta)


def _transposed(monkeypatch):
    """16-row CTAs on partial_transposed_ws (bench_sparse_core.py --paths t) at every count of
    64-slot blocks a CTA, either cache."""
    from graphstep.kernels import sparse_core

    monkeypatch.setattr(sparse_core, "TRANSPOSED_BLOCKS", {"bf16": 1 << 30, "fp8": 1 << 30})


TRANSPOSED_CASES = ["q16-tp8-bf16", "q16-tp8-fp8cache", "q16-kimi-dcp2-fp8", "q8-kimi-tp8-bf16"]


@pytest.mark.parametrize("slots_per_cta", [64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_every_split_variant_of_the_transposed_path_matches_the_reference(monkeypatch, case, slots_per_cta):
    """1 .. 32 blocks a CTA (both buffers' reuse, one split normalizing itself), B = 5 with
    holes, repeated slots, a short selection and a token with none: bf16 and fp8 rows (the fp8
    producer's loads a block ahead), bf16 and e4m3 query rows, 8 gathered rows in the tile."""
    from graphstep.kernels import catalog

    _transposed(monkeypatch)
    assert catalog.build(_state(case).shape, "sparse_core", slots=slots_per_cta).op.transposed
    _check(case, 5, slots_per_cta)


@pytest.mark.parametrize("batch", [2, 3, 64])
@pytest.mark.parametrize("case", TRANSPOSED_CASES)
def test_the_transposed_path_at_the_plans_split_matches_the_reference(monkeypatch, case, batch):
    """The plan's split (64 slots and up: B >= 2), B = 64 with 128 CTAs."""
    _transposed(monkeypatch)
    _check(case, batch)


@pytest.mark.parametrize("batch", [5, 64])
def test_the_transposed_path_over_far_scaled_rows_matches_the_reference(monkeypatch, batch):
    """fp8 rows whose scales are 2^40 times the others' and whose scores are far below theirs:
    dequantized to bf16 (fp32's range) by the producers, nothing leaves range."""
    _transposed(monkeypatch)
    _check("q16-tp8-fp8cache", batch, outliers=40)


@pytest.mark.parametrize("path", ["default", "mws", "mws_cluster8", "wsx", "transposed"])
@pytest.mark.parametrize("slots_per_cta", [None, 512, 2048])  # the plan (32 splits at B = 6), 4, one split
@pytest.mark.parametrize("case", ["q16-tp8-bf16", "q16-kimi-dcp2-fp8", "q128-tp1-fp8", "q128-tp1-bf16"])
def test_publish_copies_the_rows_read_and_rearms_them(monkeypatch, case, slots_per_cta, path):
    """The step's launch (q_out given): the same out and lse bit for bit as a launch without
    it, q_out = the gathered rows as they were, those rows re-armed in the mailbox, and
    nothing else of the mailbox touched (pad rows, rows past the batch). mws: 16-row CTAs
    on partial_mma_ws; mws_cluster8: with CLUSTER_SPLITS 8 (at 512 slots a cluster of 4 CTAs
    whose split 0 publishes after the first cluster barrier); wsx: 64-row CTAs with the
    crossover; transposed: 16-row CTAs on partial_transposed_ws (at B = 6 the plan's 64 or 128 slots a
    CTA)."""
    from graphstep.kernels import sparse_core

    mws = path.startswith("mws")
    if path == "mws_cluster8":
        if slots_per_cta != 512:
            pytest.skip("the cluster of 4 splits is the case; the others are mws's")
        monkeypatch.setattr(sparse_core, "CLUSTER_SPLITS", 8)
    if mws and case.startswith("q128"):
        pytest.skip("64-row CTAs have no partial_mma_ws")
    if path == "wsx" and not case.startswith("q128"):
        pytest.skip("the crossover pairs 64-row CTAs")
    if path == "transposed" and case.startswith("q128"):
        pytest.skip("the transposed path is for 16-row CTAs")
    if path == "transposed":
        _transposed(monkeypatch)
    if path == "wsx":
        _crossover(monkeypatch, CONSUMERS["wsx"])
    if mws:
        _mma_paths(monkeypatch, 1)
    state, batch = _state(case), 6
    s, m = state.shape, state.shape.model
    kernels = Kernels(s, state.weights)
    rows = torch.randn(batch + 2, s.gathered, m.query_row, device="cuda") * 0.3
    mailbox = torch.randint(0, 255, (batch + 2, s.q_heads, m.query_row * s.q_bytes), dtype=torch.uint8, device="cuda")
    mailbox[:, : s.gathered] = formats.encode_q_rows(rows, CASES[case][1].q_format).view(batch + 2, s.gathered, -1)
    before = mailbox.clone()
    total = state.caches.mla_cache.view(-1, state.caches.mla_cache.shape[-1]).shape[0]
    slots = _slots(total, batch, m.index_topk)
    spc = slots_per_cta or kernels.sparse_core_plan(batch)
    n = batch * m.index_topk // spc
    results = []
    for q_out in (None, torch.full((batch + 1, s.gathered, mailbox.shape[-1]), 0x5A, dtype=torch.uint8, device="cuda")):
        out = torch.full((batch, s.gathered, m.kv_lora_rank), float("nan"), device="cuda")
        lse = torch.full((batch, s.gathered), float("nan"), device="cuda")
        partial_o = torch.full((max(n, 1), s.q_heads, m.kv_lora_rank), float("nan"), device="cuda")
        partial_ml = torch.full((max(n, 1), s.q_heads, 2), float("nan"), device="cuda")
        box = before.clone()
        kernels.sparse_core(box, slots, state.caches.mla_cache, partial_o, partial_ml, out, lse, batch, spc, q_out)
        torch.cuda.synchronize()
        results.append((out, lse, box, q_out))
    (out0, lse0, box0, _), (out1, lse1, box1, q_out) = results
    assert torch.equal(box0, before), "without q_out the rows are left as they were"
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    assert torch.equal(q_out[:batch], before[:batch, : s.gathered]), "q_out: the rows read"
    assert (q_out[batch:] == 0x5A).all(), "q_out past the batch untouched"
    assert (box1[:batch, : s.gathered] == formats.SENTINEL_BYTE).all(), "the rows read are re-armed"
    assert torch.equal(box1[:batch, s.gathered :], before[:batch, s.gathered :]), "pad rows untouched"
    assert torch.equal(box1[batch:], before[batch:]), "rows past the batch untouched"


@pytest.mark.parametrize(
    "case, batch, slots_per_cta",
    [
        ("q16-tp8-bf16", 4, None),  # the plan: a combine
        ("q16-tp8-bf16", 3, 2048),  # one split: the partial normalizes itself
        ("q16-tp8-bf16", 64, None),  # 2 splits: the clustered combine (128 CTAs)
        ("q16-tp8-fp8cache", 4, None),
        ("q8-kimi-tp8-bf16", 4, None),  # 8 gathered rows in a 16-row CTA: only they are polled
        ("q128-tp1-fp8", 2, None),  # 64-row CTAs, two row groups a token
    ],
)
def test_poll_waits_for_the_rows_and_names_a_chunk_never_published(case, batch, slots_per_cta):
    """poll_budget_ns (the step's fork_poll on one rank): with every row published, out and
    lse equal the launch without the poll bit for bit and nothing is recorded; with the last
    chunk of the last gathered row (the last row group's) published late from another stream,
    the CTAs wait for it and the result is the same; with it never published, the CTAs give up
    after the budget and MailboxTimeout names that chunk."""
    state = _state(case)
    s, m = state.shape, state.shape.model
    kernels = Kernels(s, state.weights)
    assert kernels.sparse_core_polls(batch, slots_per_cta)
    rows = torch.randn(batch, s.gathered, m.query_row, device="cuda") * 0.3
    mailbox = formats.arm(torch.empty(batch, s.q_heads, m.query_row * s.q_bytes, dtype=torch.uint8, device="cuda"))
    mailbox[:, : s.gathered] = formats.encode_q_rows(rows, CASES[case][1].q_format).view(batch, s.gathered, -1)
    total = state.caches.mla_cache.view(-1, state.caches.mla_cache.shape[-1]).shape[0]
    slots = _slots(total, batch, m.index_topk)
    spc = slots_per_cta or kernels.sparse_core_plan(batch)
    n = max(batch * m.index_topk // spc, 1)

    def launch(box, budget_ns, publish_late=None):
        error = ErrorWord.new(torch.device("cuda"))
        out = torch.full((batch, s.gathered, m.kv_lora_rank), float("nan"), device="cuda")
        lse = torch.full((batch, s.gathered), float("nan"), device="cuda")
        partial_o = torch.full((n, s.q_heads, m.kv_lora_rank), float("nan"), device="cuda")
        partial_ml = torch.full((n, s.q_heads, 2), float("nan"), device="cuda")
        if publish_late is not None:
            publisher = torch.cuda.Stream()
            publisher.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(publisher):
                torch.cuda._sleep(4_000_000)  # ~2 ms: the CTAs are spinning by then
                publish_late()
        kernels.sparse_core(
            box, slots, state.caches.mla_cache, partial_o, partial_ml, out, lse, batch, spc, error=error,
            poll_budget_ns=budget_ns,
        )  # fmt: skip
        torch.cuda.synchronize()
        return out, lse, error

    out0, lse0, _ = launch(mailbox.clone(), None)
    out1, lse1, published = launch(mailbox.clone(), 1_000_000_000)
    published.check(s.gathered, s.mailbox_row_chunks)  # nothing recorded
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    token, row, chunk = batch - 1, s.gathered - 1, s.mailbox_row_chunks - 1
    whole = mailbox.view(torch.complex128)  # 16-byte elements: a chunk lands in one store
    late = whole.clone()
    late.view(torch.uint8)[token, row, 16 * chunk : 16 * (chunk + 1)] = formats.SENTINEL_BYTE

    def publish():
        late[token, row, chunk] = whole[token, row, chunk]

    out2, lse2, waited = launch(late.view(torch.uint8), 1_000_000_000, publish)
    waited.check(s.gathered, s.mailbox_row_chunks)
    assert torch.equal(out0, out2) and torch.equal(lse0, lse2), "the poll did not wait for the late chunk"
    lost = mailbox.clone()
    lost[token, row, 16 * chunk : 16 * (chunk + 1)] = formats.SENTINEL_BYTE
    _, _, gave_up = launch(lost, 2_000_000)
    with pytest.raises(MailboxTimeout, match=f"mailbox: token {token}, head row {row}, chunk {chunk} "):
        gave_up.check(s.gathered, s.mailbox_row_chunks)
