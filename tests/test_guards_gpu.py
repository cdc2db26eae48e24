"""The kernels' range guards on an sm_90 GPU (issue 14, item 2): every kernel that addresses
memory with an id from the inputs, launched with out-of-range ids (fresh random inputs,
poisoned outputs, guard bands around the tensors it writes): nothing written outside the
valid slots, the bad id read as a hole (or a clamped RoPE row), and the error word naming
(check, token, value); then a captured DecodeStep with check_values=False and a huge slot,
page or length: no crash, check() raises InputRangeError naming it, the next step works."""

import dataclasses

import pytest
import torch
from graphstep.kernels import guards

from conftest import rel_err
from graphstep import InputRangeError, formats
from graphstep import reference as ref
from graphstep.launch import ErrorWord, Kernels
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState
from graphstep.step import DecodeStep

pytestmark = pytest.mark.gpu
POISON = -1  # 0xFFFF bf16 words, 0xFF bytes: NaN, never written by a kernel
DCP2 = Topology(tp=8, dcp=2, rank=1)


def _seed():
    return int(torch.randint(0, 2**31, ()))


def _state(topology=Topology(tp=8), max_batch=8, max_context=4096):
    shape = RankShape(preset("deepseek-v3.2"), topology)
    return LayerState(shape, max_batch=max_batch, max_context=max_context, seed=_seed(), device="cuda")


def _changed(inputs, **change):
    """inputs with cloned tensors (state.inputs' block tables are views of the state's own)."""
    fields = {f.name: getattr(inputs, f.name).clone() for f in dataclasses.fields(inputs)}
    for name, edits in change.items():
        for index, value in edits:
            fields[name][index] = value
    return dataclasses.replace(inputs, **fields)


def _raises(error: ErrorWord, check: int, token: int, value: int):
    """error holds exactly this record: check() raises it, then the word is clear."""
    torch.cuda.synchronize()
    with pytest.raises(InputRangeError) as e:
        error.check(1, 1)
    assert (e.value.check, e.value.token, e.value.value) == (check, token, value), str(e.value)
    assert error.word.tolist() == ErrorWord.new("cuda").word.tolist()


def _clear(error: ErrorWord):
    torch.cuda.synchronize()
    error.check(1, 1)


def _banded(like: torch.Tensor, fill: int) -> torch.Tensor:
    """A poisoned copy of `like`'s shape with one poisoned row before and after it: [rows + 2, ...]."""
    band = torch.empty((like.shape[0] + 2, *like.shape[1:]), dtype=like.dtype, device="cuda")
    band.view(torch.uint8).fill_(fill & 0xFF)
    return band


# -- IndexKey ---------------------------------------------------------------------------------


def test_index_key_writes_only_valid_slots_and_records_the_first_bad_one():
    state = _state()
    kernels = Kernels(state.shape, state.weights)
    band = _banded(state.caches.index_cache, POISON)
    cache = band[1:-1]
    pool = cache.shape[0] * 64
    inputs = _changed(state.inputs(5), slot_mapping=[(1, pool), (2, -5), (3, 10**9), (4, -1)])
    error = ErrorWord.new("cuda")
    kernels.index_key(inputs.qkv, inputs.context_lens, inputs.slot_mapping, cache, 5, error)
    torch.cuda.synchronize()
    assert (band[0] == 0xFF).all() and (band[-1] == 0xFF).all(), "the guard band stays poisoned"
    keys, _ = formats.index_cache_views(cache, 64, 128)
    written = (keys.reshape(-1, 128) != 0xFF).any(-1).nonzero().flatten().tolist()
    assert written == [int(inputs.slot_mapping[0])], "only token 0's slot is written"
    _raises(error, guards.INDEX_KEY_SLOT, 1, pool)  # token 1 is the lowest bad one; -1 is no error


def test_index_key_clamps_a_bad_length_and_records_it():
    state = _state()
    kernels = Kernels(state.shape, state.weights)
    cache = torch.full_like(state.caches.index_cache, 0xFF)
    base = state.inputs(3)
    inputs = _changed(base, context_lens=[(2, 10**6)])  # token 2's slot stays valid
    error = ErrorWord.new("cuda")
    kernels.index_key(inputs.qkv, inputs.context_lens, inputs.slot_mapping, cache, 3, error)
    torch.cuda.synchronize()
    keys, scales = formats.index_cache_views(cache, 64, 128)
    slots = inputs.slot_mapping.long()
    assert torch.isfinite(scales.reshape(-1)[slots]).all(), "every token's key written, token 2's from RoPE row 0"
    assert not (keys.reshape(-1, 128)[slots] == 0xFF).any(), "every byte of each key (0xFF: e4m3 NaN)"
    _raises(error, guards.INDEX_KEY_LENGTH, 2, 10**6)
    # tokens 0 and 1 as with every length good
    good = torch.full_like(state.caches.index_cache, 0xFF)
    kernels.index_key(base.qkv, base.context_lens, base.slot_mapping, good, 3, ErrorWord.new("cuda"))
    torch.cuda.synchronize()
    good_keys, good_scales = formats.index_cache_views(good, 64, 128)
    assert torch.equal(keys.reshape(-1, 128)[slots[:2]], good_keys.reshape(-1, 128)[slots[:2]])
    assert torch.equal(scales.reshape(-1)[slots[:2]], good_scales.reshape(-1)[slots[:2]])


# -- MlaQuery ---------------------------------------------------------------------------------


def _mla_query(state, inputs, cache, error, batch):
    s = state.shape
    kernels = Kernels(s, state.weights)
    q_rows = formats.arm(torch.empty(batch, s.q_heads, 576 * s.q_bytes, dtype=torch.uint8, device="cuda"))
    qc = torch.empty(batch, 1536, dtype=torch.bfloat16, device="cuda")
    workspace = torch.empty(batch, s.heads, 192, device="cuda")
    kernels.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        qc,
        qc.clone(),
        workspace,
        q_rows,
        cache,
        error,
        batch,
        store_qc=True,
        poll=False,
    )
    torch.cuda.synchronize()
    return q_rows


@pytest.mark.parametrize("mla_cache", ["bf16", "fp8"])
def test_mla_query_inserts_only_valid_slots_and_records_the_first_bad_one(mla_cache):
    state = _state(Topology(tp=8, mla_cache=mla_cache))
    band = _banded(state.caches.mla_cache, POISON)
    cache = band[1:-1]
    pool = cache.shape[0] * 64
    inputs = _changed(state.inputs(4), slot_mapping=[(1, -3), (2, pool + 5), (3, pool)])
    error = ErrorWord.new("cuda")
    q_rows = _mla_query(state, inputs, cache, error, 4)
    bytes_ = band.view(torch.uint8).reshape(band.shape[0], -1)
    assert (bytes_[0] == 0xFF).all() and (bytes_[-1] == 0xFF).all(), "the guard band stays poisoned"
    rows = cache.view(torch.uint8).reshape(pool, -1)
    written = (rows != 0xFF).any(-1).nonzero().flatten().tolist()
    assert written == [int(inputs.slot_mapping[0])]
    assert torch.isfinite(formats.decode_q_rows(q_rows, "bf16")[:, : state.shape.heads]).all(), "rows published"
    _raises(error, guards.MLA_QUERY_SLOT, 1, -3)  # the lowest token first


def test_mla_query_clamps_a_bad_length_and_records_it():
    state = _state()
    cache = state.clone_caches().mla_cache
    # token 1 writes no row, so only the query's RoPE reads its length
    inputs = _changed(state.inputs(3), context_lens=[(1, -(2**31))], slot_mapping=[(1, -1)])
    error = ErrorWord.new("cuda")
    q_rows = _mla_query(state, inputs, cache, error, 3)
    got = formats.decode_q_rows(q_rows, "bf16")[:, : state.shape.heads]
    assert torch.isfinite(got).all(), "token 1's rows from RoPE row 0, in bounds"
    good = [0, 2]
    sub = dataclasses.replace(inputs, **{f.name: getattr(inputs, f.name)[good] for f in dataclasses.fields(inputs)})
    expect = ref.mla_query(state, sub, ref.query_norm(state, sub))
    assert rel_err(got[good], expect) < 1e-2, "the other tokens' rows as the reference's"
    _raises(error, guards.MLA_QUERY_LENGTH, 1, -(2**31))


# -- IndexQuery -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, bad", [(3, 1), (80, 70)])  # 80: the second launch starts at token 64
def test_index_query_clamps_a_bad_length_and_records_the_global_token(batch, bad):
    state = _state(max_batch=batch)
    kernels = Kernels(state.shape, state.weights)
    base = state.inputs(batch)
    inputs = _changed(base, context_lens=[(bad, 10**6)])
    q_c = ref.query_norm(state, inputs)
    outputs = []
    for lens in (inputs.context_lens, base.context_lens):  # the bad length, then every length good
        q_out = torch.full((batch + 1, 64, 128), 0xFF, dtype=torch.uint8, device="cuda")  # 0xFF: e4m3 NaN
        w_out = torch.full((batch + 1, 64), float("nan"), device="cuda")
        error = ErrorWord.new("cuda")
        kernels.index_query(q_c, inputs.qkv, lens, q_out, w_out, batch, error)
        torch.cuda.synchronize()
        assert (q_out[batch] == 0xFF).all() and torch.isnan(w_out[batch]).all()
        assert not (q_out[:batch] == 0xFF).any() and torch.isfinite(w_out[:batch]).all(), "every token written"
        outputs.append((q_out, w_out))
        if lens is inputs.context_lens:
            _raises(error, guards.INDEX_QUERY_LENGTH, bad, 10**6)
    # the other tokens are as with every length good (a token's RoPE row is its own length's)
    others = [t for t in range(batch) if t != bad]
    (q_bad, w_bad), (q_good, w_good) = outputs
    assert torch.equal(q_bad[others], q_good[others]) and torch.equal(w_bad[others], w_good[others])


# -- DsaIndex ---------------------------------------------------------------------------------


def _scoring(batch=3, max_context=4096):
    state = _state(max_batch=batch, max_context=max_context)
    inputs = state.inputs(batch, context_lens=max_context)
    q, w = ref.index_query(state, inputs, ref.query_norm(state, inputs))
    return state, Kernels(state.shape, state.weights), inputs, q, w


def _scores(kernels, state, q, w, inputs, batch, error, run=None):
    width = inputs.block_tables.shape[1] * 64
    scores = torch.full((batch + 1, width), float("nan"), device="cuda")
    kernels.dsa_index(
        q, w, state.caches.index_cache, inputs.block_tables, inputs.context_lens, scores, batch, run, error
    )
    torch.cuda.synchronize()
    assert torch.isnan(scores[batch]).all(), "the row past the batch stays poisoned"
    return scores[:batch]


@pytest.mark.parametrize("run", [None, 64])  # 64: one CTA streams the whole table (the consumers reload entries)
@pytest.mark.parametrize("page", [10**6, -9, "pool"])
def test_dsa_index_scores_a_bad_page_minus_inf_and_records_it(run, page):
    state, kernels, good, q, w = _scoring()
    page = state.caches.index_cache.shape[0] if page == "pool" else page
    column = 40 if run == 64 else 1
    bad = _changed(good, block_tables=[((0, column), page)])
    error = ErrorWord.new("cuda")
    expect = _scores(kernels, state, q, w, good, 3, error, run)
    _clear(error)
    got = _scores(kernels, state, q, w, bad, 3, error, run)
    hole = slice(column * 64, (column + 1) * 64)
    assert torch.isneginf(got[0, hole]).all(), "the bad page's keys score -inf"
    rest = torch.ones_like(got, dtype=torch.bool)
    rest[0, hole] = False
    assert torch.equal(got[rest], expect[rest]), "every other score as with the good table"
    _raises(error, guards.DSA_INDEX_PAGE, 0, page)


def test_dsa_index_reads_no_page_past_the_length():
    """A bad page in the unused part of a table is never read, so it is no error."""
    state, kernels, good, q, w = _scoring()
    bad = _changed(good, context_lens=[(1, 100)], block_tables=[((1, 5), -1), ((1, 6), 10**9)])
    error = ErrorWord.new("cuda")
    got = _scores(kernels, state, q, w, bad, 3, error)
    assert torch.isneginf(got[1, 100:]).all() and torch.isfinite(got[1, :100]).all()
    _clear(error)


# -- TopK -------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [None, "auto"], ids=["one-cta", "cluster"])
def test_top_k_turns_a_bad_page_into_a_hole_and_records_it(split):
    state = _state(max_batch=2, max_context=8192)
    kernels = Kernels(state.shape, state.weights)
    inputs = state.inputs(2, context_lens=8192)
    width = inputs.block_tables.shape[1] * 64
    scores = torch.randn(2, width, device="cuda")
    scores[0, 3 * 64 : 4 * 64] += 1000  # page 3's positions are kept
    pages = state.caches.index_cache.shape[0]
    bad = _changed(inputs, block_tables=[((0, 3), 10**6)])
    out = torch.full((3, 2048), -7, dtype=torch.int32, device="cuda")
    expect = out.clone()
    error = ErrorWord.new("cuda")
    for tables, into in ((inputs.block_tables, expect), (bad.block_tables, out)):
        kernels.top_k(scores, tables, inputs.context_lens, into, scores, 2, split, error, pages)
    torch.cuda.synchronize()
    assert (out[2] == -7).all(), "the row past the batch stays poisoned"
    on_page = (expect[0] // 64) == int(inputs.block_tables[0, 3])
    assert on_page.sum() == 64 and (out[0][on_page] == -1).all(), "the bad page's 64 positions: slot -1"
    assert torch.equal(out[0][~on_page], expect[0][~on_page]) and torch.equal(out[1], expect[1])
    _raises(error, guards.TOP_K_PAGE, 0, 10**6)


# -- DcpMerge ---------------------------------------------------------------------------------


def _merge(state, kernels, positions, tables, error):
    """DcpMerge of own candidates at `positions` (all kept: the peers offer none)."""
    k, dcp = 2048, 2
    batch = positions.shape[0]
    scores = torch.rand(batch, k, device="cuda") + 1
    peer_positions = torch.full((batch, dcp, k), -1, dtype=torch.int32, device="cuda")
    peer_scores = torch.full((batch, dcp, k), float("-inf"), device="cuda")
    out = torch.full((batch + 1, k), -7, dtype=torch.int32, device="cuda")
    pages = state.caches.index_cache.shape[0]
    kernels.dcp_merge(positions, scores, peer_positions, peer_scores, tables, out, batch, error, pages)
    torch.cuda.synchronize()
    assert (out[batch] == -7).all()
    return out[:batch]


@pytest.mark.parametrize("where", ["page", "position"])
def test_dcp_merge_turns_a_bad_page_or_position_into_a_hole_and_records_it(where):
    state = _state(DCP2, max_batch=2, max_context=4096)  # local 2048 positions: 32 pages
    kernels = Kernels(state.shape, state.weights)
    tables = state.caches.block_tables[:2].clone()
    local = torch.arange(2048, device="cuda")
    positions = (local * 2 + 1).int().repeat(2, 1)  # rank 1's: global = local x 2 + 1
    expect = (tables.long()[:, local // 64] * 64 + local % 64).int()
    error = ErrorWord.new("cuda")
    if where == "page":
        tables[1, 2] = -4
        out = _merge(state, kernels, positions, tables, error)
        hole = (local // 64 == 2)[None].expand(2, -1).clone()
        hole[0] = False
        _raises(error, guards.DCP_MERGE_PAGE, 1, -4)
    else:
        positions[0, 2047] = 10**6  # past the table (local 500000)
        out = _merge(state, kernels, positions, tables, error)
        hole = torch.zeros(2, 2048, dtype=torch.bool, device="cuda")
        hole[0, 2047] = True
        _raises(error, guards.DCP_MERGE_POSITION, 0, 10**6)
    assert (out[hole] == -1).all() and torch.equal(out[~hole], expect[~hole])


# -- SparseCore -------------------------------------------------------------------------------


@pytest.mark.parametrize("crossover", [False, True], ids=["", "crossover"])
@pytest.mark.parametrize("slots_per_cta", [None, 2048])  # the plan's split and one CTA per token
@pytest.mark.parametrize(
    ("topology", "mma_sync"),
    [
        (Topology(tp=8), False),
        (Topology(tp=8), True),
        (Topology(tp=1, mla_cache="fp8"), False),
        (Topology(tp=1), False),
    ],
    ids=["tp8-mma-ws", "tp8-mma-sync", "tp1-fp8-wgmma", "tp1-bf16-wgmma"],
)
def test_sparse_core_reads_a_bad_slot_as_a_hole_and_records_it(
    monkeypatch, slots_per_cta, topology, mma_sync, crossover
):
    """16-row CTAs on their default producer path (partial_mma_ws, TP 8's bf16 cache at every
    split) and on partial_mma_sync (mma_sync: MMA_PRODUCER_BLOCKS out of reach); crossover:
    the 64-row CTAs' head-group pairs sharing each block's loads (sparse_core.CROSSOVER, with
    the producer it needs): each CTA still records its whole block's slots."""
    from graphstep.kernels import sparse_core

    if mma_sync:
        monkeypatch.setattr(sparse_core, "MMA_PRODUCER_BLOCKS", dict.fromkeys(sparse_core.MMA_PRODUCER_BLOCKS, 1 << 30))
        monkeypatch.setattr(sparse_core, "TRANSPOSED_BLOCKS", dict.fromkeys(sparse_core.TRANSPOSED_BLOCKS, 0))
    if crossover:
        if topology.tp != 1:
            pytest.skip("the crossover pairs 64-row CTAs (TP 1)")
        monkeypatch.setattr(sparse_core, "CROSSOVER", dict.fromkeys(sparse_core.CROSSOVER, True))
    state = _state(topology, max_batch=2)
    s, m = state.shape, state.shape.model
    if crossover:  # the launches below run the pairs' kernel (the flags select it per cache)
        from graphstep.kernels import catalog

        split = slots_per_cta or sparse_core.plan(2, s.q_heads, m.index_topk, s.topology.mla_cache)
        assert catalog.build(s, "sparse_core", slots=split).op.crossover
    kernels = Kernels(s, state.weights)
    rows = torch.randn(2, s.gathered, m.query_row, device="cuda") * 0.3
    mailbox = formats.arm(torch.empty(2, s.q_heads, m.query_row * s.q_bytes, dtype=torch.uint8, device="cuda"))
    mailbox[:, : s.gathered] = formats.encode_q_rows(rows, "bf16").view(2, s.gathered, -1)
    pool = state.caches.mla_cache.shape[0] * 64
    slots = torch.stack([torch.randperm(pool, device="cuda")[:2048] for _ in range(2)]).int()
    holes = slots.clone()
    for token, index, value in [(0, 5, pool), (0, 7, 10**9), (1, 3, -7), (1, 9, pool + 64)]:
        slots[token, index], holes[token, index] = value, -1
    results = []
    error = ErrorWord.new("cuda")
    for ids in (holes, slots):
        out = torch.full((2, s.gathered, m.kv_lora_rank), float("nan"), device="cuda")
        lse = torch.full((2, s.gathered), float("nan"), device="cuda")
        partial_o, partial_ml = kernels.sparse_core_buffers(2, "cuda")
        kernels.sparse_core(
            mailbox, ids, state.caches.mla_cache, partial_o, partial_ml, out, lse, 2, slots_per_cta, error=error
        )
        torch.cuda.synchronize()
        results.append((out, lse))
    (hole_out, hole_lse), (out, lse) = results
    assert torch.isfinite(out).all() and torch.equal(out, hole_out) and torch.equal(lse, hole_lse)
    _raises(error, guards.SPARSE_CORE_SLOT, 0, pool)  # token 0's lowest value (as uint32)


# -- the step -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step():
    step = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8)), capture_sizes=(1, 4), max_context=2048, seed=_seed()
    )
    step.capture()
    return step


def _caches(step):
    c = step.caches
    return c.index_cache.clone(), c.mla_cache.clone()


def _slot_rows(caches) -> list:
    """Per cache slot: the indexer key and scale, the MLA row (as bytes, [slots, n] each)."""
    index_cache, mla_cache = caches
    keys, scales = formats.index_cache_views(index_cache, 64, 128)
    slots = keys.shape[0] * 64
    return [
        keys.reshape(slots, -1),
        scales.reshape(slots, 1).view(torch.uint8),
        mla_cache.view(torch.uint8).reshape(slots, -1),
    ]


@pytest.mark.parametrize(
    "field, index, value, check",
    [
        ("slot_mapping", (1,), 10**9, guards.INDEX_KEY_SLOT),
        ("slot_mapping", (2,), -(2**31), guards.INDEX_KEY_SLOT),
        ("block_tables", (0, 0), 10**9, guards.DSA_INDEX_PAGE),
        ("block_tables", (3, 1), -(2**31), guards.DSA_INDEX_PAGE),
        ("context_lens", (1,), 10**9, guards.INDEX_KEY_LENGTH),
        ("context_lens", (2,), 0, guards.INDEX_KEY_LENGTH),
    ],
)
def test_a_step_with_a_huge_id_runs_raises_on_check_and_the_next_step_works(step, field, index, value, check):
    good = step.state.inputs(4, context_lens=[2048, 100, 1500, 700], seed=_seed())
    bad = _changed(good, **{field: [(index, value)]})
    before = _caches(step)
    out = step.step(bad, check_values=False)
    torch.cuda.synchronize()  # no fault
    others = [t for t in range(4) if t != index[0]]
    assert torch.isfinite(out.out[others]).all() and torch.isfinite(out.lse[others]).all()
    if field == "slot_mapping":  # the caches changed at the other tokens' slots only
        slots = set(good.slot_mapping[others].tolist())
        for old, new in zip(_slot_rows(before), _slot_rows(_caches(step))):
            changed = (old != new).any(1).nonzero().flatten().tolist()
            assert set(changed) <= slots, sorted(set(changed) - slots)
    with pytest.raises(InputRangeError) as e:
        step.check()
    assert (e.value.check, e.value.token, e.value.value) == (check, index[0], value), str(e.value)
    assert str(value) in str(e.value) and e.value.kernel in str(e.value)
    out = step.step(good)  # checked: the word is clear, the step runs
    assert torch.isfinite(out.out).all() and torch.isfinite(out.lse).all()
    step.check()


def test_the_next_checked_step_raises_an_unchecked_steps_error_before_it_runs(step):
    good = step.state.inputs(4, context_lens=[2048, 100, 1500, 700], seed=_seed())
    step.step(_changed(good, slot_mapping=[((3,), 10**9)]), check_values=False)
    before = _caches(step)
    with pytest.raises(InputRangeError, match=r"IndexKey: token 3's slot_mapping value 1000000000"):
        step.step(good)
    for old, new in zip(before, _caches(step)):
        assert torch.equal(old, new), "raised before the step ran"
    step.step(good)
    step.check()
