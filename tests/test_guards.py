"""The range guards on the CPU (issue 14, item 2): the record's format, InputRangeError's
message, the bounds every launcher passes its kernel, and the torch backend's step with
out-of-range ids under check_values=False (nothing written, holes, clamped RoPE rows; the
record raised by check() or the next checked step). The kernels themselves are tested on
the GPU (tests/test_guards_gpu.py); their PTX in tests/test_kernels_compile.py."""

import dataclasses
from dataclasses import replace

import pytest
import torch
from graphstep.kernels import guards

from conftest import SMALL, launch_on_cpu
from graphstep import InputRangeError
from graphstep.launch import DEFAULT_BUDGET_NS, INT32_MAX, ErrorWord, MailboxTimeout
from graphstep.shapes import RankShape, Topology
from graphstep.stages import CuteStages
from graphstep.step import DecodeStep

DCP = Topology(tp=4, dcp=2, rank=1)


def _step(topology=Topology(tp=4), sizes=(1, 4), seed=0):
    return DecodeStep(
        RankShape(SMALL, topology), capture_sizes=sizes, backend="torch", device="cpu", max_context=200, seed=seed
    )


def _with(inputs, **change):
    return dataclasses.replace(inputs, **{k: v.clone() for k, v in change.items()})


def _good(step):
    return step.state.inputs(3, context_lens=[70, 5, 130], seed=1)


# -- the record -------------------------------------------------------------------------------


def test_records_pack_and_order_by_check_then_token():
    for check, token, value in [(1, 0, 10**6), (6, 3, -1), (10, 2**24 - 1, -(2**31)), (2, 5, 2**31 - 1)]:
        record = guards.pack(check, token, value)
        assert 0 <= record < guards.EMPTY and guards.unpack(record) == (check, token, value)
    assert guards.unpack(guards.EMPTY) is None
    # the atomic min keeps the lowest check (the step's order), then the lowest token
    assert guards.pack(1, 7, 5) < guards.pack(2, 0, 0) < guards.pack(2, 1, -1)
    assert sorted(guards.CHECKS) == list(range(1, 11))


def test_error_word_raises_the_record_and_resets():
    error = ErrorWord.new("cpu")
    error.check(16, 72)  # cleared: nothing to raise
    error.record.fill_(guards.pack(guards.DSA_INDEX_PAGE, 2, 123456))
    with pytest.raises(InputRangeError, match=r"DsaIndex: token 2's block_tables value 123456 is out of range") as e:
        error.check(16, 72, bounds={guards.DSA_INDEX_PAGE: (0, 33)})
    assert "must be in [0, 33) (the indexer cache's pages)" in str(e.value) and "treated as a hole" in str(e.value)
    assert (e.value.kernel, e.value.token, e.value.value, e.value.bounds) == ("DsaIndex", 2, 123456, (0, 33))
    assert isinstance(e.value, ValueError)
    error.check(16, 72)  # reset by the raise
    # a length: [1, rows]; lower checks win over a poll's flag
    error.word[0] = 1
    error.record.fill_(guards.pack(guards.INDEX_KEY_LENGTH, 0, -3))
    with pytest.raises(InputRangeError, match=r"IndexKey: token 0's context_lens value -3 .* in \[1, 200\]"):
        error.check(16, 72, bounds={guards.INDEX_KEY_LENGTH: (1, 201)})
    assert error.word.tolist() == ErrorWord.new("cpu").word.tolist()


# -- the launchers pass the bounds -------------------------------------------------------------


class Recorder:
    calls: list = []

    def __init__(self, op):
        self.op = op

    def __call__(self, *args):
        pointers = [(a._pointer, a._assumed_align) for a in args if hasattr(a, "memspace")]
        scalars = [a.value for a in args if hasattr(a, "value")]
        Recorder.calls.append((type(self.op).__name__, pointers, scalars))


@pytest.mark.parametrize("mode", ["serial", "fork", "fork_poll"])
@pytest.mark.parametrize("topology", [Topology(tp=4), DCP], ids=["tp4", "dcp2"])
def test_every_guarded_launch_gets_the_steps_error_word_and_the_pool_bounds(monkeypatch, topology, mode):
    launch_on_cpu(monkeypatch, lambda op, args: Recorder(op))
    Recorder.calls = []
    shape = RankShape(replace(SMALL, index_heads=64), topology)  # the kernels' indexer geometry
    step = DecodeStep(shape, capture_sizes=(4,), backend="torch", device="cpu", max_context=200)
    step.stages = CuteStages(step.state, step.buffers, step.error, DEFAULT_BUDGET_NS)
    step.run_stages(4, mode)
    st, c = step.state, step.caches
    index_pages, mla_slots, pps = c.index_cache.shape[0], c.mla_cache.shape[0] * 64, st.pages_per_seq
    assert index_pages == mla_slots // 64 == st.trash_page + 1
    expect = {
        "IndexKey": [4, index_pages * 64, 200],
        "KeyAndNorm": [4, shape.model.rms_eps, index_pages * 64, 200],  # fork: IndexKey and QueryNorm in one
        "MlaQuery": [4, shape.model.rms_eps, DEFAULT_BUDGET_NS, mla_slots, 200],
        "IndexQuery": [4, 200, 0],  # rows, RoPE rows, the launch's first token
        "DsaIndex": lambda s: s[:2] == [4, pps] and s[3:] == [index_pages],
        "ClusterTopK": [4, pps, index_pages],
        "DcpMerge": [4, pps, index_pages, topology.dcp * shape.model.index_topk],  # stacked: dcp x k per token
        # its poll's budget: fork_poll on one rank only (under DCP MlaQuery or QueryWait polls)
        "SparseCore": [4, mla_slots, DEFAULT_BUDGET_NS if mode == "fork_poll" and topology.dcp == 1 else 0],
    }
    seen = set()
    for name, pointers, scalars in Recorder.calls:
        if name not in expect:
            assert name in ("QueryNorm", "QueryWait"), name
            continue
        seen.add(name)
        want = expect[name]
        assert want(scalars) if callable(want) else scalars == pytest.approx(want), (name, scalars)
        assert (step.error.word.data_ptr(), 8) in pointers, name
    unused = {"KeyAndNorm" if mode == "serial" else "IndexKey"} | ({"DcpMerge"} if topology.dcp == 1 else set())
    assert seen == set(expect) - unused
    # bounds the step's messages quote are the ones passed
    assert step.bounds[guards.DSA_INDEX_PAGE] == (0, index_pages)
    assert step.bounds[guards.SPARSE_CORE_SLOT] == (0, mla_slots)
    assert step.bounds[guards.INDEX_QUERY_LENGTH] == (1, 201)


def test_launches_without_an_error_word_record_in_the_launchers_own(monkeypatch):
    launch_on_cpu(monkeypatch, lambda op, args: Recorder(op))
    Recorder.calls = []
    shape = RankShape(replace(SMALL, index_heads=64), Topology(tp=4))
    step = DecodeStep(shape, capture_sizes=(2,), backend="torch", device="cpu", max_context=200)
    kernels = CuteStages(step.state, step.buffers, step.error, DEFAULT_BUDGET_NS).kernels
    b = step.buffers
    kernels.index_key(b.qkv, b.context_lens, b.slot_mapping, step.caches.index_cache, 2)
    kernels.index_key(b.qkv, b.context_lens, b.slot_mapping, step.caches.index_cache, 2)
    sink = kernels._sinks[torch.device("cpu")]
    assert all((sink.word.data_ptr(), 8) in pointers for _, pointers, _ in Recorder.calls)
    assert len(Recorder.calls) == 2 and sink.word.tolist() == ErrorWord.new("cpu").word.tolist()
    # top_k / dcp_merge without a pool bound: any page >= 0
    kernels.top_k(b.scores, b.block_tables, b.context_lens, b.slots, b.own_scores, 2)
    assert Recorder.calls[-1][2][-1] == INT32_MAX


# -- the torch backend's step with out-of-range ids ----------------------------------------------


def _caches(step):
    c = step.caches
    return c.index_cache.clone(), c.mla_cache.clone()


def test_a_bad_slot_writes_nothing_and_check_raises_it():
    step, twin = _step(), _step()
    good = _good(step)
    bad = _with(good, slot_mapping=good.slot_mapping)
    bad.slot_mapping[1] = 10**6
    hole = _with(good, slot_mapping=good.slot_mapping)
    hole.slot_mapping[1] = -1
    out = step.step(bad, eager=True, check_values=False)  # no error here: nothing is read back
    ref = twin.step(hole, eager=True, check_values=False)
    # exactly what slot -1 does: the same caches, the same outputs
    for mine, theirs in zip(_caches(step), _caches(twin)):
        assert torch.equal(mine, theirs)
    assert torch.equal(out.out, ref.out) and torch.equal(out.slots, ref.slots)
    with pytest.raises(InputRangeError, match=r"IndexKey: token 1's slot_mapping value 1000000 .* \[0, \d+\)") as e:
        step.check()
    assert "nothing was written for it" in str(e.value)
    step.check()  # reset
    twin.check()  # slot -1 is no error


@pytest.mark.parametrize(
    "length, kernel",
    [(10**6, "IndexKey"), (0, "IndexKey"), (-(2**31), "IndexKey"), (201, "IndexKey")],
)
def test_a_length_past_the_rope_table_is_clamped_and_recorded(length, kernel):
    step = _step()
    good = _good(step)
    bad = _with(good, context_lens=good.context_lens)
    bad.context_lens[2] = length
    out = step.step(bad, eager=True, check_values=False)
    assert torch.isfinite(out.out[:2]).all()
    with pytest.raises(InputRangeError, match=rf"{kernel}: token 2's context_lens value {length} .* in \[1, 200\]"):
        step.check()


def test_a_bad_length_of_a_token_that_writes_nothing_is_mla_querys():
    step = _step()
    good = _good(step)
    bad = _with(good, context_lens=good.context_lens, slot_mapping=good.slot_mapping)
    bad.context_lens[0], bad.slot_mapping[0] = -5, -1
    step.step(bad, eager=True, check_values=False)
    with pytest.raises(InputRangeError, match=r"MlaQuery: token 0's context_lens value -5"):
        step.check()


def test_a_bad_page_is_a_hole_and_the_other_tokens_are_unaffected():
    step, twin = _step(), _step()
    good = _good(step)
    bad = _with(good, block_tables=good.block_tables)
    bad.block_tables[0, 1] = 10**6  # in the used part of row 0 (context 70: pages 0 and 1)
    bad.block_tables[2, 3] = -7  # row 2 (context 130) uses pages 0 .. 2: page 3 is never read
    out = step.step(bad, eager=True, check_values=False)
    ref = twin.step(good, eager=True, check_values=False)
    page = step.shape.model.page_size
    assert torch.isinf(step.buffers.scores[0, page : 2 * page]).all()  # the hole scores -inf
    assert not (out.slots[0] // page == 10**6).any()
    assert torch.equal(out.out[1:], ref.out[1:]) and torch.equal(out.slots[1:], ref.slots[1:])
    with pytest.raises(InputRangeError, match=r"DsaIndex: token 0's block_tables value 1000000 .* \[0, \d+\)"):
        step.check()
    twin.check()


def test_the_lowest_check_wins_and_the_next_checked_step_raises_it_before_running():
    step = _step()
    good = _good(step)
    bad = _with(good, block_tables=good.block_tables, slot_mapping=good.slot_mapping)
    bad.block_tables[0, 0] = 10**6  # DsaIndex, token 0
    bad.slot_mapping[2] = -2  # IndexKey, token 2: earlier in the step, so it is the record
    step.step(bad, eager=True, check_values=False)
    cache = _caches(step)
    with pytest.raises(InputRangeError, match=r"IndexKey: token 2's slot_mapping value -2"):
        step.step(good, eager=True)  # check_values=True reads the word in its one sync
    for before, after in zip(cache, _caches(step)):
        assert torch.equal(before, after)  # raised before the step ran
    out = step.step(good, eager=True)  # the next step works
    assert torch.isfinite(out.out).all()
    step.check()


def test_an_unchecked_good_step_leaves_no_record():
    step = _step()
    for seed in range(3):
        step.step(step.state.inputs(4, seed=seed), eager=True, check_values=False)
    step.check()


def test_dcp_raises_in_the_step_itself():
    step = _step(DCP)
    good = _good(step)
    peers = step.state.peer_inputs(good, seed=2)
    bad = _with(good, block_tables=good.block_tables)
    bad.block_tables[1, 0] = step.caches.index_cache.shape[0]  # one past the pool
    with pytest.raises(InputRangeError, match=r"DsaIndex: token 1's block_tables value \d+"):
        step.step(bad, peers, eager=True, check_values=False)
    step.step(good, peers, eager=True, check_values=False)


def test_a_poll_that_gave_up_raises_once_and_leaves_the_mailbox_armed():
    """A mailbox poll that gave up (fork_poll's sparse core on one rank; QueryWait under DCP)
    left its chunk in the error word, and its late publisher rows the readers had already
    re-armed: check() names the chunk and arms the mailbox again, so the next step's poll
    cannot take the stale rows for its own; the word is reset."""
    step = _step()
    gathered, chunks = step.shape.gathered, step.shape.mailbox_row_chunks
    step.caches.mailbox[2, 1, :16] = 0x11  # the late publisher's chunk 0 of token 2, row 1
    step.error.word[0] = 1
    step.error.word[1] = (2 * gathered + 1) * chunks + 3
    with pytest.raises(MailboxTimeout, match=r"^mailbox: token 2, head row 1, chunk 3 was never published"):
        step.check()
    assert bool((step.caches.mailbox == 0xFF).all())
    step.check()  # reset: nothing left to raise
