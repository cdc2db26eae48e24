"""Host validation of a step's inputs and peers (check_values=True: one device-to-host
read), the NaN policy of the torch backend, and top-k never selecting a non-finite score.
Each bad input must fail with a message naming the tensor, the row and the value."""

import dataclasses
import warnings

import pytest
import torch

from conftest import SMALL
from graphstep import reference as ref
from graphstep import torch_stages
from graphstep.shapes import RankShape, Topology
from graphstep.state import PeerInputs, StepInputs
from graphstep.step import DecodeStep, NonFiniteInputs

DCP = Topology(tp=4, dcp=2, rank=1)


def _step(topology=Topology(tp=4), sizes=(1, 4), policy=None, seed=0):
    return DecodeStep(
        RankShape(SMALL, topology),
        capture_sizes=sizes,
        backend="torch",
        device="cpu",
        max_context=200,
        policy=policy,
        seed=seed,
    )


def _with(inputs, **change):
    return dataclasses.replace(
        inputs, **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in change.items()}
    )


def _lens(values):
    return torch.tensor(values, dtype=torch.int32)


def test_slots_must_be_the_new_tokens_own_slot():
    step = _step()
    good = step.state.inputs(3, context_lens=[70, 5, 130], seed=1)
    page = step.shape.model.page_size
    tables = good.block_tables
    other = int(tables[0, 0]) * page + 3  # inside sequence 0's page
    own_wrong_offset = int(tables[1, 0]) * page + 7  # the right page, the wrong position
    for slot, message in [
        (10**6, r"inputs.slot_mapping\[1\] = 1000000: outside the pool \[0, 1024\)"),
        (-2, r"inputs.slot_mapping\[1\] = -2: outside the pool"),
        (
            other,
            rf"inputs.slot_mapping\[1\] = {other}: not the new token's slot: position 4 is at page "
            rf"{int(tables[1, 0])} of block_tables\[1\], slot {int(tables[1, 0]) * page + 4}",
        ),
        (own_wrong_offset, r"inputs.slot_mapping\[1\] = \d+: not the new token's slot"),
    ]:
        slots = good.slot_mapping.clone()
        slots[1] = slot
        with pytest.raises(ValueError, match=message):
            step.step(_with(good, slot_mapping=slots), eager=True)
    slots = good.slot_mapping.clone()
    slots[2] = -1  # -1 (write nothing) is always allowed
    step.step(_with(good, slot_mapping=slots), eager=True)


def test_an_empty_batch_and_a_dcp_step_without_peers_are_refused():
    step = _step()
    empty = step.state.inputs(1)
    empty = _with(
        empty,
        qkv=empty.qkv[:0],
        context_lens=empty.context_lens[:0],
        slot_mapping=empty.slot_mapping[:0],
        block_tables=empty.block_tables[:0],
    )
    with pytest.raises(ValueError, match=r"batch must be at least 1 \(captured sizes: \[1, 4\]\)"):
        step.step(empty, eager=True)
    dcp = _step(DCP, sizes=(2,))
    with pytest.raises(ValueError, match="a DCP step needs peers=PeerInputs"):
        dcp.step(dcp.state.inputs(2), eager=True)


def test_two_tokens_may_not_write_one_slot():
    """Two rows whose block tables share the new token's page at the same position would
    write one cache row (each the new token's own slot by itself): the later row is refused."""
    step = _step()
    good = step.state.inputs(3, context_lens=[70, 5, 70], seed=1)
    tables = good.block_tables.clone()
    tables[2] = tables[0]
    slots = good.slot_mapping.clone()
    slots[2] = slots[0]
    with pytest.raises(ValueError, match=rf"inputs.slot_mapping\[2\] = {int(slots[0])}: also row 0's slot"):
        step.step(_with(good, block_tables=tables, slot_mapping=slots), eager=True)
    slots[2] = -1  # the same tables, one writer: allowed (a shared page read by both)
    step.step(_with(good, block_tables=tables, slot_mapping=slots), eager=True)


def test_a_dcp_rank_whose_table_ends_before_the_new_tokens_page():
    """Rank 1 of DCP 2 at max_context 129 has a one-page table (64 local positions); the new
    token at position 128 lives on rank 0 at local index 64, past that table: its slot is -1
    here, and neither inputs() nor the value checks look past the table."""
    step = DecodeStep(RankShape(SMALL, DCP), capture_sizes=(2,), backend="torch", device="cpu", max_context=129, seed=0)
    assert step.state.pages_per_seq == 1
    inputs = step.state.inputs(2, context_lens=129, seed=3)
    assert inputs.slot_mapping.tolist() == [-1, -1]
    step.step(inputs, step.state.peer_inputs(inputs, seed=3), eager=True)


def test_a_dcp_slot_must_be_minus_one_for_a_position_another_rank_holds():
    step = _step(DCP, sizes=(2,))
    good = step.state.inputs(2, context_lens=[9, 10], seed=2)  # positions 8 (rank 0), 9 (rank 1)
    assert good.slot_mapping[0] == -1 and good.slot_mapping[1] >= 0
    peers = step.state.peer_inputs(good, seed=3)
    slots = good.slot_mapping.clone()
    slots[0] = good.slot_mapping[1]
    with pytest.raises(ValueError, match=r"inputs.slot_mapping\[0\] = \d+: position 8 lives on DCP rank 0, not rank 1"):
        step.step(_with(good, slot_mapping=slots), peers, eager=True)


def test_used_pages_must_be_in_the_pool():
    step = _step()
    good = step.state.inputs(2, context_lens=[130, 5], seed=4)  # row 0 uses 3 pages, row 1 one
    spare = step.state.trash_page
    for column, page in [(2, -1), (1, spare), (0, 10**6)]:
        tables = good.block_tables.clone()
        tables[0, column] = page
        with pytest.raises(
            ValueError,
            match=rf"inputs.block_tables\[0, {column}\] = {page}: a page of the used part "
            rf"\(the first 3 of row 0, context 130\) must be in \[0, {spare}\)",
        ):
            step.step(_with(good, block_tables=tables), eager=True)
    tables = good.block_tables.clone()
    tables[1, 1:] = -1  # past the used part: never read, not checked
    step.step(_with(good, block_tables=tables), eager=True)


def test_lengths_are_checked_first_and_name_the_row():
    step = _step()
    good = step.state.inputs(2, context_lens=[10, 20], seed=5)
    with pytest.raises(ValueError, match=r"inputs.context_lens\[1\] = 201: must be in \[1, 200\]"):
        step.step(_with(good, context_lens=_lens([10, 201])), eager=True)
    with pytest.raises(ValueError, match=r"inputs.context_lens\[0\] = -5"):
        step.step(
            _with(good, context_lens=_lens([-5, 20]), slot_mapping=torch.tensor([7, 10**6], dtype=torch.int32)),
            eager=True,
        )


def test_value_checks_read_the_device_once_and_not_at_all_without_check_values(monkeypatch):
    step = _step(DCP, sizes=(4,))
    inputs = step.state.inputs(3, seed=6)
    peers = step.state.peer_inputs(inputs, seed=7)
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1]
        )
    step.load(inputs, peers, check_values=True)
    assert reads == ["cpu", "numpy"]  # the one copy to the host, then the checks in numpy on it
    reads.clear()
    step.load(inputs, peers, check_values=False)
    assert reads == []


def test_peers_are_validated_like_inputs():
    step = _step(DCP, sizes=(2,))
    inputs = step.state.inputs(2, context_lens=[50, 60], seed=8)
    good = step.state.peer_inputs(inputs, seed=9)

    def peers(**change):
        return dataclasses.replace(good, **{name: value.clone() for name, value in change.items()})

    one_token = peers(positions=good.positions[:1], scores=good.scores[:1])  # would broadcast over the batch
    wrong_rank = good.positions.clone()
    wrong_rank[1, 0, 3] = 7  # rank 0 offers an odd position
    too_far = good.positions.clone()
    too_far[0, 0, 0] = 50  # position 50 of a 50-token context
    below = good.positions.clone()
    below[0, 0, 1] = -3
    cases = [
        (one_token, r"peers.positions must have shape \[2, 2, 64\], got \[1, 2, 64\]"),
        (peers(rows=good.rows.double()), "peers.rows must be torch.float32"),
        (peers(positions=good.positions.long()), "peers.positions must be torch.int32"),
        (peers(scores=good.scores[..., :-1]), r"peers.scores must have shape \[2, 2, 64\]"),
        (
            peers(positions=wrong_rank),
            r"peers.positions\[1, 0, 3\] = 7: rank 0's candidates must be -1 or positions "
            r"p < 60 \(the context length\) with p % 2 == 0",
        ),
        (peers(positions=too_far), r"peers.positions\[0, 0, 0\] = 50: .* p < 50"),
        (peers(positions=below), r"peers.positions\[0, 0, 1\] = -3"),
        ("rows", "peers must be PeerInputs"),
    ]
    for bad, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            step.step(inputs, bad, eager=True)
    own = good.positions.clone()
    own[:, 1] = 12345  # this rank's own candidates are ignored (it computes its own)
    step.step(inputs, peers(positions=own), eager=True)


def test_a_bad_length_is_named_before_the_peers_positions():
    """Under DCP the length checks come first: a row of length 0 beside a bad peer position is
    refused for its length (the peers' checks see the lengths clamped, never 0 or past max_context)."""
    step = _step(DCP, sizes=(2,))
    inputs = step.state.inputs(2, context_lens=[50, 60], seed=8)
    peers = step.state.peer_inputs(inputs, seed=9)
    positions = peers.positions.clone()
    positions[1, 0, 0] = 7  # rank 0 offers an odd position
    bad = dataclasses.replace(peers, positions=positions)
    for length in (0, step.state.max_context + 1):
        lens = inputs.context_lens.clone()
        lens[0] = length
        with pytest.raises(ValueError, match=rf"inputs.context_lens\[0\] = {length}: must be in"):
            step.step(_with(inputs, context_lens=lens), bad, eager=True)
    with pytest.raises(ValueError, match=r"peers.positions\[1, 0, 0\] = 7"):
        step.step(inputs, bad, eager=True)


def test_peers_on_a_step_without_dcp_are_an_error():
    step = _step()
    inputs = step.state.inputs(2, seed=10)
    fake = PeerInputs(torch.zeros(2, 4, 576), torch.full((2, 1, 64), -1, dtype=torch.int32), torch.zeros(2, 1, 64))
    with pytest.raises(ValueError, match="peers are only for a DCP step"):
        step.step(inputs, fake, eager=True)


def test_a_cuda_step_on_a_machine_without_cuda_says_what_to_do():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="torch sees no CUDA device.*backend='torch', device='cpu'"):
        DecodeStep(RankShape(SMALL, Topology(tp=4)), capture_sizes=(1,))


# -- NaN policy ------------------------------------------------------------------------------


def _nan_row(inputs: StepInputs, row: int) -> StepInputs:
    qkv = inputs.qkv.clone()
    qkv[row, 3] = float("nan")  # in q_a
    qkv[row, 1536 + 7] = float("inf")  # in kv_a
    qkv[row, -1] = float("nan")  # in the indexer's head weights
    return _with(inputs, qkv=qkv)


@pytest.mark.parametrize("topology, mode", [(Topology(tp=4), "serial"), (Topology(tp=4), "fork"), (DCP, "fork")])
def test_one_tokens_nan_never_changes_another_tokens_outputs(topology, mode):
    clean, dirty = _step(topology, policy=mode, seed=3), _step(topology, policy=mode, seed=3)
    inputs = clean.state.inputs(3, context_lens=[150, 90, 120], seed=11)
    peers = clean.state.peer_inputs(inputs, seed=12) if topology.dcp > 1 else None
    expect = clean.step(inputs, peers, eager=True)
    with pytest.warns(NonFiniteInputs, match=r"rows \[1\]"):
        got = dirty.step(_nan_row(inputs, 1), peers, eager=True)
    assert dirty.nonfinite_rows == [1]
    for row in (0, 2):
        for field in ("q_c", "slots", "q_rows", "out", "lse"):
            assert torch.equal(getattr(got, field)[row], getattr(expect, field)[row]), (row, field)
    assert torch.isfinite(got.out[[0, 2]]).all()
    # the other sequences' cache pages (and every page no sequence holds) are untouched
    theirs = torch.ones(clean.state.trash_page + 1, dtype=torch.bool)
    theirs[inputs.block_tables[1].long()] = False
    for name in ("index_cache", "mla_cache"):
        assert torch.equal(getattr(dirty.caches, name)[theirs], getattr(clean.caches, name)[theirs]), name
    assert theirs.any() and not theirs.all()  # the check covered other pages, not the NaN token's own
    # the next clean step of the same tokens: only the NaN token's own sequence can differ
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteInputs)
        again, expect_again = dirty.step(inputs, peers, eager=True), clean.step(inputs, peers, eager=True)
    assert dirty.nonfinite_rows == []
    for row in (0, 2):
        assert torch.equal(again.out[row], expect_again.out[row]) and torch.equal(
            again.slots[row], expect_again.slots[row]
        )


def test_each_kind_of_non_finite_value_is_reported_and_large_finite_values_are_not():
    step = _step(sizes=(8,))
    inputs = step.state.inputs(6, seed=14)
    qkv = inputs.qkv.clone()
    big = torch.finfo(torch.bfloat16).max
    qkv[0] = big  # finite, though a plain row sum would overflow to inf
    qkv[1, 5] = float("inf")
    qkv[2, -2] = float("-inf")
    qkv[3, 100] = float("nan")
    qkv[4, :] = -big
    qkv[5, 0] = float("nan")  # the first column
    with pytest.warns(NonFiniteInputs, match=r"rows \[1, 2, 3, 5\]"):
        step.load(_with(inputs, qkv=qkv))
    assert step.nonfinite_rows == [1, 2, 3, 5]


@pytest.mark.parametrize("topology", [Topology(tp=4), DCP, Topology(tp=4, dcp=2, rank=0)])
def test_the_host_checks_want_the_slot_new_token_slots_gives(topology):
    """The host checks compute the new token's slot and the used pages in numpy (the formulas of
    LayerState.new_token_slots and state.local_lens): every length's slot from new_token_slots
    passes, and one off it is refused naming new_token_slots' slot."""
    step = _step(topology, sizes=(16,))
    page = step.shape.model.page_size
    gen = torch.Generator().manual_seed(15)
    for trial in range(8):
        lens = torch.randint(1, step.state.max_context + 1, (16,), generator=gen, dtype=torch.int32)
        lens[:3] = torch.tensor([1, page, page + 1])  # the first token, a page's last and the next page's first
        good = step.state.inputs(16, context_lens=lens.tolist(), seed=trial)
        peers = step.state.peer_inputs(good, seed=trial) if topology.dcp > 1 else None
        step.load(good, peers)  # every row passes
        want = step.state.new_token_slots(good.context_lens, good.block_tables)
        row = int((want >= 0).int().argmax())
        slots = good.slot_mapping.clone()
        slots[row] = want[row] + 1 if (want[row] + 1) % page else want[row] - 1
        with pytest.raises(
            ValueError, match=rf"slot_mapping\[{row}\] = \d+: not the new token's slot: .* slot {int(want[row])} "
        ):
            step.load(_with(good, slot_mapping=slots), peers)


def test_non_finite_inputs_can_be_made_an_error():
    step = _step()
    inputs = _nan_row(step.state.inputs(2, seed=13), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteInputs)
        with pytest.raises(NonFiniteInputs, match=r"rows \[0\]"):
            step.step(inputs, eager=True)
    step.step(inputs, eager=True, check_values=False)  # unchecked: no report, the step runs
    assert step.nonfinite_rows == []


def test_top_k_never_selects_a_non_finite_score():
    scores = torch.arange(10, dtype=torch.float32)[None].repeat(2, 1)
    scores[0, 9] = float("nan")
    scores[0, 8] = float("inf")
    scores[1, 0] = float("nan")
    expect = torch.tensor([[4, 5, 6, 7], [6, 7, 8, 9]], dtype=torch.int32)
    assert torch.equal(ref.topk_indices(scores, 4), expect)
    got = torch_stages.topk_indices(scores, 4)
    assert [sorted(row) for row in got.tolist()] == expect.tolist()
    # fewer finite scores than k: -1 padded, never a NaN position
    few = torch.tensor([[float("nan"), 1.0, float("-inf"), float("nan"), 2.0]])
    assert ref.topk_indices(few, 4).tolist() == [[1, 4, -1, -1]]
    assert sorted(torch_stages.topk_indices(few, 4)[0].tolist()) == [-1, -1, 1, 4]


# -- poll budgets ----------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [-1, 1.5, True, "1", None, 15_000_000_001])
def test_a_poll_budget_must_be_an_int_below_a_quarter_of_the_wait_limit(budget):
    """A kernel's mbarrier waits may sit behind a cluster peer's poll and trap after
    guards.MBAR_WAIT_LIMIT_NS, so a poll's budget is an int in [0, guards.MAX_BUDGET_NS]."""
    from graphstep.kernels import guards

    from graphstep.dcp_group import DcpGroup
    from graphstep.launch import check_budget

    assert guards.MAX_BUDGET_NS == 15_000_000_000
    with pytest.raises(ValueError, match=r"budget_ns must be an int in \[0, 15000000000\]"):
        check_budget(budget)
    with pytest.raises(ValueError, match="budget_ns must be an int"):
        DecodeStep(
            RankShape(SMALL, Topology(tp=4)), capture_sizes=(1,), backend="torch", device="cpu", budget_ns=budget
        )
    with pytest.raises(ValueError, match="budget_ns must be an int"):
        DcpGroup(RankShape(SMALL, Topology(tp=4, dcp=2)), 2, budget_ns=budget)


@pytest.mark.parametrize("budget", [0, 1, 10_000_000_000, 15_000_000_000])
def test_poll_budgets_up_to_the_bound_are_taken(budget):
    from graphstep.launch import check_budget

    assert check_budget(budget) == budget
    step = DecodeStep(
        RankShape(SMALL, Topology(tp=4)),
        capture_sizes=(1,),
        backend="torch",
        device="cpu",
        max_context=200,
        budget_ns=budget,
    )
    assert step.budget_ns == budget
