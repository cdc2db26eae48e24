"""DcpGroup on the CPU (torch backend): the shards of one unsharded layer, the exchanges of
GroupTransport, the combine across ranks against the unsharded layer, and a missing rank."""

import time

import pytest
import torch

from conftest import SMALL, rel_err
from graphstep import formats
from graphstep import reference as ref
from graphstep.dcp_group import CandidatesTimeout, DcpGroup, GroupTransport, PeerTransport
from graphstep.launch import INT32_MAX, ErrorWord, MailboxTimeout
from graphstep.shapes import RankShape, Topology
from graphstep.step import DecodeStep
from graphstep.transport import Exchange, SimulatedPeers

CONTEXT, SIZES = 300, (2, 4)  # SMALL: 4 heads per rank at tp 4; 300 tokens span 5 pages unsharded


def _group(dcp, **kw):
    return DcpGroup(RankShape(SMALL, Topology(tp=4)), dcp, capture_sizes=SIZES, max_context=CONTEXT, seed=3, **kw)


@pytest.fixture(scope="module", params=[2, 4])
def group(request):
    return _group(request.param)


def test_each_rank_holds_its_heads_and_positions_of_the_unsharded_layer(group):
    full, d, page = group.unsharded, group.dcp, SMALL.page_size
    full_mla = full.caches.mla_cache.view(-1, SMALL.query_row)
    full_keys, _ = formats.index_cache_views(full.caches.index_cache, page, SMALL.index_dim)
    for rank, step in enumerate(group.steps):
        state = step.state
        assert isinstance(step.transport, GroupTransport) and state.shape.topology.rank == rank
        heads = state.shape.heads
        assert torch.equal(state.weights.w_uk, full.weights.w_uk[rank * heads : (rank + 1) * heads])
        rows = SMALL.qk_head_dim * heads
        assert torch.equal(state.weights.w_qb, full.weights.w_qb[rank * rows : (rank + 1) * rows])
        assert torch.equal(state.weights.wq_b_index, full.weights.wq_b_index)
        mla = state.caches.mla_cache.view(-1, SMALL.query_row)
        keys, _ = formats.index_cache_views(state.caches.index_cache, page, SMALL.index_dim)
        for seq in (0, 3):
            for position in range(rank, CONTEXT, d * 7):  # every 7th of the rank's positions
                local = position // d
                slot = int(state.caches.block_tables[seq, local // page]) * page + local % page
                full_slot = int(full.caches.block_tables[seq, position // page]) * page + position % page
                assert torch.equal(mla[slot], full_mla[full_slot]), (rank, seq, position)
                assert torch.equal(keys[slot // page, slot % page], full_keys[full_slot // page, full_slot % page])


def test_combine_ranks_is_the_attention_over_every_ranks_slots():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 12, generator=g, dtype=torch.float64)
    values = torch.randn(3, 12, 7, generator=g, dtype=torch.float64)
    logits[1, :, :] = float("-inf")  # a token with no slot anywhere
    parts = [slice(0, 5), slice(5, 5), slice(5, 12)]  # the middle rank has no slot
    outs, lses = [], []
    for part in parts:
        lse = torch.logsumexp(logits[..., part], -1) if part.stop > part.start else torch.full((3, 5), -torch.inf)
        probs = torch.exp(logits[..., part] - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        outs.append(torch.einsum("bgk,bkc->bgc", probs, values[:, part]))
        lses.append(lse.to(torch.float64))
    out, lse = ref.combine_ranks(outs, lses)
    expect = torch.einsum("bgk,bkc->bgc", torch.softmax(logits[[0, 2]], -1), values[[0, 2]])
    assert torch.allclose(out[[0, 2]], expect, atol=1e-12)
    assert torch.allclose(lse[[0, 2]], torch.logsumexp(logits[[0, 2]], -1), atol=1e-12)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()


def _global_selection(group, batch):
    """The global top-k of the unsharded scores, assembled from the ranks' scores
    (local index i of rank r is position i x dcp + r), as global positions."""
    d = group.dcp
    width = max(step.buffers.scores.shape[1] for step in group.steps) * d
    scores = torch.full((batch, width), float("-inf"))
    for rank, step in enumerate(group.steps):
        local = step.buffers.scores[:batch]
        scores[:, rank::d][:, : local.shape[1]] = local
    return ref.topk_indices(scores, SMALL.index_topk)


def test_the_group_step_is_the_unsharded_layers(group):
    inputs = group.unsharded.inputs(3, seed=5)  # pads to 4
    unsharded = DecodeStep(
        group.unsharded.shape, capture_sizes=SIZES, backend="torch", device="cpu", max_context=CONTEXT, seed=3
    )
    assert torch.equal(unsharded.caches.mla_cache, group.unsharded.caches.mla_cache), "the same seeded layer"
    outputs = group.step(inputs)
    expect = unsharded.step(inputs, eager=True)
    # every rank's slots: its share of the global top-k (the reference DCP merge)
    chosen = _global_selection(group, 3)
    for rank, (step, got) in enumerate(zip(group.steps, outputs)):
        tables = step.state.caches.block_tables[:3]
        assert torch.equal(got.slots, ref.local_slots(chosen, tables, SMALL.page_size, group.dcp, rank)), rank
        # every rank attended every rank's heads: the unsharded layer's query rows
        assert torch.equal(got.q_rows, expect.q_rows), rank
        assert (step.caches.mailbox == formats.SENTINEL_BYTE).all(), "the sparse core re-armed the mailbox"
    assert torch.equal(chosen, ref.topk_indices(unsharded.buffers.scores[:3], SMALL.index_topk))
    out, lse = group.combine(outputs)
    assert out.shape == (3, group.dcp * 4, SMALL.kv_lora_rank)
    assert rel_err(out, expect.out) < 2e-3 and rel_err(lse, expect.lse) < 2e-3
    # and against the reference attention of the unsharded layer over the same selection
    ref.kv_insert(group.unsharded, inputs, group.unsharded.caches)
    slots = ref.to_slots(chosen, inputs.block_tables, SMALL.page_size)
    full_out, full_lse = ref.sparse_attention(group.unsharded, group.unsharded.caches, expect.q_rows.float(), slots)
    assert rel_err(out, full_out) < 2e-3 and rel_err(lse, full_lse) < 2e-3
    assert all(t is not None and t > 0 for t in group.times) and group.group_time > 0


def test_a_rank_that_never_publishes_times_the_others_out_and_the_next_step_works():
    group = _group(4, wait_s=0.3)
    inputs = group.unsharded.inputs(2, seed=8)
    with pytest.raises(MailboxTimeout, match=r"head row 8 \(rank 2's\), chunk 0") as lost:
        group.step(inputs, absent=[2])
    assert (lost.value.rank, lost.value.token, lost.value.row, lost.value.chunk) == (2, 0, 8, 0)
    assert all((step.caches.mailbox == formats.SENTINEL_BYTE).all() for step in group.steps), "re-armed"
    outputs = group.step(inputs)
    chosen = _global_selection(group, 2)
    for rank, (step, got) in enumerate(zip(group.steps, outputs)):
        expect = ref.local_slots(chosen, step.state.caches.block_tables[:2], SMALL.page_size, 4, rank)
        assert torch.equal(got.slots, expect), rank
    assert torch.equal(outputs[0].q_rows, outputs[2].q_rows)


def test_delays_are_refused_on_the_torch_backend(group):
    """A GPU spin before a rank's step exists on the cute backend only: the torch group says so
    rather than running undelayed."""
    for eager in (False, True):
        with pytest.raises(ValueError, match="delays: cute backend only"):
            group.step(group.unsharded.inputs(2, seed=1), eager=eager, delays={0: 0.001})


def test_a_group_rank_takes_no_peer_inputs():
    group = _group(2)
    step = group.steps[1]
    inputs = group.rank_inputs(group.unsharded.inputs(2, seed=1))[1]
    with pytest.raises(ValueError, match="takes no peers"):
        step.step(inputs, step.state.peer_inputs(inputs), eager=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dcp=1), r"2 <= dcp <= 32, got 1"),
        (dict(dcp=64), r"2 <= dcp <= 32, got 64"),
        (dict(dcp=3), "multiple of dcp"),
        (dict(dcp=2, devices=["cpu"] * 3), "one per rank"),
        (dict(dcp=2, backend="triton"), "backend 'triton'"),
        (dict(dcp=2, capture_sizes=[]), "at least one batch size"),
        (dict(dcp=2, capture_sizes=[2, 0]), "capture size must be a positive int, got 0"),
        (dict(dcp=2, wait_s=None), "wait_s must be a finite number of seconds > 0, got None"),  # no bound: a hang
        (dict(dcp=2, wait_s=float("nan")), "wait_s must be a finite number"),
        (dict(dcp=2, wait_s=0), "wait_s must be a finite number"),
    ],
)
def test_construction_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DcpGroup(RankShape(SMALL, Topology(tp=4)), max_context=100, **kwargs)


def test_capture_sizes_must_be_a_list():
    with pytest.raises(TypeError, match=r"capture_sizes must be a list of batch sizes, e.g. \[1, 4\], got 4"):
        DcpGroup(RankShape(SMALL, Topology(tp=4)), 2, capture_sizes=4, max_context=100)


def test_a_step_on_a_given_state_checks_it_is_the_steps():
    group = _group(2)
    state = group.steps[1].state
    with pytest.raises(
        ValueError, match=r"rank=0.* on cpu for 4 x 300 tokens, got small .*rank=1.* on cpu for 4 x 300"
    ):
        DecodeStep(
            state.shape.with_topology(rank=0),
            capture_sizes=SIZES,
            backend="torch",
            device="cpu",
            max_context=CONTEXT,
            state=state,
        )  # the shapes differ in the rank
    with pytest.raises(ValueError, match="for 8 x 300 tokens"):
        DecodeStep(state.shape, capture_sizes=(8,), backend="torch", device="cpu", max_context=CONTEXT, state=state)


def test_a_ranks_own_error_is_raised_rather_than_the_timeouts_it_caused(monkeypatch):
    group = _group(2, wait_s=0.2)
    inputs = group.unsharded.inputs(2, seed=9)

    def broken(size):
        raise RuntimeError("rank 1's IndexKey failed")

    monkeypatch.setattr(group.steps[1].stages, "index_key", broken)
    with pytest.raises(RuntimeError, match="rank 1's IndexKey failed"):
        group.step(inputs)
    monkeypatch.undo()
    assert all(out is not None for out in group.step(inputs))


def _slow(stage, seconds):
    def run(*args, **kwargs):
        time.sleep(seconds)
        return stage(*args, **kwargs)

    return run


def test_a_delayed_rank_gives_the_same_results_and_one_past_wait_s_loses_its_candidates(monkeypatch):
    group = _group(2, wait_s=0.5)
    inputs = group.unsharded.inputs(2, seed=10)
    expect = [out.slots.clone() for out in group.step(inputs)]
    monkeypatch.setattr(group.steps[1].stages, "index_scores", _slow(group.steps[1].stages.index_scores, 0.1))
    assert all(torch.equal(out.slots, slots) for out, slots in zip(group.step(inputs), expect)), "within wait_s"
    # past wait_s between the two exchanges: rank 0 merged without rank 1's candidates
    monkeypatch.setattr(group.steps[1].stages, "index_scores", _slow(group.steps[1].stages.index_scores, 1.0))
    with pytest.raises(CandidatesTimeout, match=r"rank 0 never received the candidates of ranks \[1\]"):
        group.step(inputs)
    monkeypatch.undo()
    assert all(torch.equal(out.slots, slots) for out, slots in zip(group.step(inputs), expect)), "recovered"


def test_a_rank_pushes_its_own_rows_of_the_steps_tokens_into_every_peer_and_nothing_else():
    group = _group(4, wait_s=0.01)
    for step in group.steps:
        formats.arm(step.caches.mailbox)
    pusher = group.transports[1]
    rows = torch.randint(0, 255, pusher.mailbox[:2, 4:8].shape, dtype=torch.uint8)
    pusher.mailbox[:2, 4:8] = rows
    with pytest.raises(MailboxTimeout, match=r"token 0, head row 0 \(rank 0's\)"):  # alone: nobody else pushed
        pusher.share_query_rows(2)
    for rank, step in enumerate(group.steps):
        mailbox = step.caches.mailbox
        assert torch.equal(mailbox[:2, 4:8], rows), rank
        armed = formats.SENTINEL_BYTE
        assert (mailbox[:2, :4] == armed).all() and (mailbox[:2, 8:] == armed).all() and (mailbox[2:] == armed).all()


# -- the GPU group's protocol (PeerTransport) on the CPU: layout, parity, flags ----------------


def _peer_transports(dcp, rows=4):
    """dcp PeerTransports of SMALL ranks over CPU memory (the offsets are addresses alike)."""
    peers = [None] * dcp
    for rank in range(dcp):
        shape = RankShape(SMALL, Topology(tp=4, dcp=dcp, rank=rank))
        mailbox = torch.empty(rows, shape.q_heads, SMALL.query_row * shape.q_bytes, dtype=torch.uint8)
        PeerTransport(shape, mailbox, peers)
    for transport in peers:
        transport.connect()
    return peers


@pytest.mark.parametrize("dcp", [2, 4])
def test_one_offset_per_rank_addresses_every_buffer_of_that_rank(dcp):
    peers = _peer_transports(dcp)
    for me in peers:
        offsets = me.mailbox_offsets.tolist()
        assert offsets[me.rank] == 0
        for rank, peer in enumerate(peers):
            for parity in (0, 1):
                for mine, theirs in [
                    (me.mailboxes[parity], peer.mailboxes[parity]),
                    (me.positions[parity], peer.positions[parity]),
                    (me.scores[parity], peer.scores[parity]),
                    (me.flags[parity], peer.flags[parity]),
                ]:
                    assert mine.data_ptr() + offsets[rank] == theirs.data_ptr(), (me.rank, rank, parity)
                    assert mine.data_ptr() % 16 == 0


def test_the_exchange_starts_armed_and_rearm_arms_both_parities():
    me = _peer_transports(2)[0]
    assert (me.mailboxes == formats.SENTINEL_BYTE).all() and (me.flags == 0).all()
    assert (me.positions == -1).all() and (me.scores == float("-inf")).all()
    me.mailboxes[1, 0, 0, :16] = 7  # a row a peer published, then a step failed
    me.flags[0, 1] = 1
    me.rearm()
    assert (me.mailboxes == formats.SENTINEL_BYTE).all() and (me.flags == 0).all()


def test_the_candidates_dcp_merge_reads_are_the_issued_paritys():
    me = _peer_transports(2)[1]
    for parity in (1, 0):
        exchange = me.exchange(parity)
        assert exchange.mailbox.data_ptr() == me.mailboxes[parity].data_ptr()
        got = me.publish_candidates(exchange.positions, exchange.scores, 3)
        assert got.positions.data_ptr() == me.positions[parity].data_ptr()
        assert got.flags.data_ptr() == me.flags[parity].data_ptr()
        assert got.offsets is me.mailbox_offsets and got.token_stride == SMALL.index_topk
    with pytest.raises(ValueError, match="takes no peers"):
        me.check(object(), 1)


def test_connect_needs_every_rank():
    peers = [None, None]
    PeerTransport(RankShape(SMALL, Topology(tp=4, dcp=2, rank=0)), torch.empty(2, 8, SMALL.query_row * 2), peers)
    with pytest.raises(RuntimeError, match="not every rank"):
        peers[0].connect()


class ParityPeers(SimulatedPeers):
    """SimulatedPeers whose mailbox and own candidates are doubled by parity, as
    PeerTransport's: what DecodeStep does with a two-parity transport, on the CPU."""

    parities = 2

    def __init__(self, shape, mailbox):
        super().__init__(shape, mailbox)
        k = shape.model.index_topk
        self.mailboxes = formats.arm(torch.empty((2, *mailbox.shape), dtype=torch.uint8))
        self.positions_2 = torch.full((2, mailbox.shape[0], k), -1, dtype=torch.int32)
        self.scores_2 = torch.full((2, mailbox.shape[0], k), float("-inf"))

    def exchange(self, parity):
        return Exchange(self.mailboxes[parity], self.positions_2[parity], self.scores_2[parity])


def test_a_two_parity_transport_gets_a_graph_plan_per_parity_and_its_buffers_per_step():
    shape = RankShape(SMALL, Topology(tp=4, dcp=2, rank=1))
    step = DecodeStep(
        shape,
        capture_sizes=SIZES,
        policy="serial",
        backend="torch",
        device="cpu",
        max_context=CONTEXT,
        transport=ParityPeers,
    )
    t = step.transport
    assert step.plan() == [(4, "serial", 0), (4, "serial", 1), (2, "serial", 0), (2, "serial", 1)]
    assert step.caches.mailbox.data_ptr() == t.mailboxes[0].data_ptr(), "parity 0's buffers between steps"
    inputs = step.state.inputs(2, seed=3)
    step.load(inputs, step.state.peer_inputs(inputs, seed=4))
    step.run_stages(2, "serial", parity=1)
    assert (t.positions_2[1, :2] >= -1).all() and (t.positions_2[1, :2] != -1).any(), "TopK wrote parity 1's"
    assert (t.positions_2[0] == -1).all(), "parity 0's untouched"
    assert step.caches.mailbox.data_ptr() == t.mailboxes[0].data_ptr(), "parity 0's again after the step"
    assert step.buffers.own_positions.data_ptr() == t.positions_2[0].data_ptr()
    with pytest.raises(ValueError, match="parity 2: this step's transport has 2"):
        step.run_stages(2, "serial", parity=2)


def test_the_error_words_candidate_pair_raises_candidates_timeout_naming_the_rank():
    error = ErrorWord.new("cpu")
    assert error.word.numel() == 6
    error.word[4], error.word[5] = 1, 3  # CandidateSync of rank 0 gave up on rank 3
    with pytest.raises(CandidatesTimeout, match=r"rank 0 never received the candidates of ranks \[3\]") as lost:
        error.check(16, 72, heads=16, rank=0)
    assert lost.value.missing == [3] and error.word.tolist() == ErrorWord.new("cpu").word.tolist()
    error.word[0], error.word[1], error.word[4], error.word[5] = 1, 72, 1, 1  # both: the rows are named first
    with pytest.raises(MailboxTimeout, match=r"token 0, head row 1"):
        error.check(16, 72, heads=16, rank=0)
    four = ErrorWord(torch.tensor([0, INT32_MAX, -1, INT32_MAX], dtype=torch.int32))  # graphstep.ops' word
    four.check(16, 72)  # nothing recorded: no error
    four.word[0], four.word[1] = 1, 73  # a chunk a poll gave up on: raised, then the 4 words cleared
    with pytest.raises(MailboxTimeout, match=r"token 0, head row 1, chunk 1"):
        four.check(16, 72)
    assert four.word.tolist() == [0, INT32_MAX, -1, INT32_MAX]


def test_an_eager_group_step_issues_each_phase_for_every_rank_before_the_next(group, monkeypatch):
    """On one GPU the ranks' streams may share a hardware queue: no rank's wait on its peers
    (exchange) may be issued before a peer's produce, nor a consume before every exchange."""
    issued = []
    for rank, step in enumerate(group.steps):
        phases = lambda size, mode, parity, rank=rank: [  # noqa: E731
            lambda phase=phase: issued.append((phase, rank, size, mode, parity))
            for phase in ("produce", "exchange", "consume")
        ]
        monkeypatch.setattr(step, "phases", phases)
    ranks = range(group.dcp)
    group._issue({rank: (4, "fork") for rank in ranks}, parity=1)
    assert issued == [(phase, rank, 4, "fork", 1) for phase in ("produce", "exchange", "consume") for rank in ranks]


def test_the_unsharded_layer_needs_dcp_to_divide_tp():
    """RankShape.unsharded() (the layer a group shards: tp / dcp ranks' heads) refuses a dcp
    that does not divide tp instead of rounding the heads down."""
    assert RankShape(SMALL, Topology(tp=4, dcp=2, rank=1)).unsharded().topology == Topology(tp=2)
    with pytest.raises(ValueError, match="tp 4 must be a multiple of dcp 3"):
        RankShape(SMALL, Topology(tp=4, dcp=3)).unsharded()
