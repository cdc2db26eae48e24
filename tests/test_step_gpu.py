"""DecodeStep on an sm_90 GPU: graphs against eager launches, fork against serial,
padding, bad inputs, long replays, the graph's edges, and DCP polling."""

import pytest
import torch

from conftest import rel_err
from graphstep import formats, order
from graphstep import reference as ref
from graphstep.graphs import inspect, short
from graphstep.launch import MailboxTimeout
from graphstep.shapes import RankShape, Topology, preset
from graphstep.step import DecodeStep

pytestmark = pytest.mark.gpu
SIZES = (1, 4, 16)


def _seed():
    return int(torch.randint(0, 2**31, ()))


@pytest.fixture(scope="module")
def tp8():
    step = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8)),
        capture_sizes=SIZES,
        policy="fork",
        max_context=2048,
        seed=_seed(),
    )
    step.capture(modes=("serial", "fork_poll"), keep_graph=True)
    return step


def _outputs(step, rows: int):
    """Clones of the step's outputs for its first `rows` tokens."""
    b = step.buffers
    return [t[:rows].clone() for t in (b.qc, b.slots, b.q_out, b.out, b.lse)]


def _poison(step, rows: int):
    """Fill the outputs of the first `rows` tokens with what no kernel writes (NaN, slot -7,
    0xA5 bytes), so a launch that leaves any of them unwritten cannot equal a run that wrote it."""
    b = step.buffers
    for t in (b.qc, b.out, b.lse):
        t[:rows].fill_(float("nan"))
    b.slots[:rows].fill_(-7)
    b.q_out[:rows].fill_(0xA5)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["fork", "serial", "fork_poll"])
def test_replay_equals_eager_and_the_modes_agree(tp8, size, mode):
    inputs = tp8.state.inputs(size, seed=_seed())
    tp8.load(inputs)
    _poison(tp8, size)
    tp8.run_stages(size, mode)
    torch.cuda.synchronize()
    eager = _outputs(tp8, size)
    assert not any(t.isnan().any() for t in (eager[0], eager[3], eager[4])) and not (eager[1] == -7).any()
    _poison(tp8, size)
    tp8.replay(size, mode)
    torch.cuda.synchronize()
    assert _equal(_outputs(tp8, size), eager), "graph replay must equal eager launches bit for bit"
    for other in ("fork", "serial", "fork_poll"):
        _poison(tp8, size)
        tp8.replay(size, other)
        torch.cuda.synchronize()
        assert _equal(_outputs(tp8, size), eager), f"{mode} and {other} must agree bit for bit"
        tp8.error.check(tp8.shape.gathered, tp8.shape.mailbox_row_chunks)  # no poll gave up
        # the sparse core re-armed every row it read: the whole mailbox holds the sentinel again
        assert bool((tp8.caches.mailbox == formats.SENTINEL_BYTE).all()), "a mailbox chunk left published"


def test_step_matches_the_reference(tp8):
    inputs = tp8.state.inputs(3, seed=_seed())
    expect = ref.reference_step(tp8.state, inputs, tp8.state.clone_caches())
    got = tp8.step(inputs)
    torch.cuda.synchronize()
    q_a = inputs.qkv[:, :1536].contiguous()
    assert torch.equal(
        got.q_c, order.query_norm(torch.nn.functional.pad(q_a, (0, 0, 0, 1)), tp8.state.weights.gamma_q, 1e-6, 16)[:3]
    )
    assert rel_err(got.q_rows, expect.q_rows) < 1e-2
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got.slots, expect.slots))
    assert overlap >= 0.95 * (expect.slots >= 0).sum()  # the same selection up to near-ties
    # and exactly the reference top-k of the step's own scores
    scores = tp8.buffers.scores[:3]
    assert torch.equal(got.slots, ref.to_slots(ref.topk_indices(scores, 2048), inputs.block_tables, 64))
    assert rel_err(got.out, expect.out) < 2e-2


def test_padding_leaves_caches_untouched_outside_real_slots(tp8):
    inputs = tp8.state.inputs(3, seed=_seed())  # pads to 4
    before_mla = tp8.caches.mla_cache.clone()
    before_index = tp8.caches.index_cache.clone()
    tp8.step(inputs)
    torch.cuda.synchronize()
    trash = tp8.state.trash_page
    real = set(inputs.slot_mapping.tolist())
    rows = (tp8.caches.mla_cache != before_mla).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
    assert set(r for r in rows if r // 64 != trash) == real
    pages = (tp8.caches.index_cache != before_index).any(-1).nonzero().flatten().tolist()
    assert set(pages) - {trash} == {s // 64 for s in real}


def test_bad_inputs_raise(tp8):
    inputs = tp8.state.inputs(2, seed=_seed())
    with pytest.raises(ValueError, match="must be on cuda"):
        tp8.step(type(inputs)(inputs.qkv.cpu(), inputs.context_lens, inputs.slot_mapping, inputs.block_tables))
    big = tp8.state.inputs(16, seed=1)
    too_big = type(big)(
        *(torch.cat([t, t[:1]]) for t in (big.qkv, big.context_lens, big.slot_mapping, big.block_tables))
    )
    with pytest.raises(ValueError, match="batch 17 exceeds the largest captured size 16"):
        tp8.step(too_big)
    with pytest.raises(RuntimeError, match="no graph captured for batch 8 in mode 'fork_poll'"):
        tp8.replay(8, "fork_poll")
    saved = tp8.buffers.qc
    tp8.buffers.qc = saved.clone()
    try:
        with pytest.raises(RuntimeError, match="replaced after capture"):
            tp8.step(inputs)
    finally:
        tp8.buffers.qc = saved


def test_ten_thousand_replays_are_identical_and_allocate_nothing(tp8):
    inputs = tp8.state.inputs(4, seed=_seed())
    tp8.load(inputs)
    tp8.replay(4)
    torch.cuda.synchronize()
    first = _outputs(tp8, 4)
    _poison(tp8, 4)
    allocated = torch.cuda.memory_allocated()
    for _ in range(10_000):
        tp8.replay(4)
    torch.cuda.synchronize()
    assert _equal(_outputs(tp8, 4), first)
    assert torch.cuda.memory_allocated() == allocated


def _stages(info) -> list[str]:
    """The stage names of a graph's CuTe DSL kernels, as the graph table shows them."""
    return [short(n.name).removeprefix("cute:") for n in info.kernels() if short(n.name).startswith("cute:")]


def _kernel(info, stage: str) -> int:
    """The index of the one kernel node of this stage."""
    found = [n.index for n in info.kernels() if short(n.name) == f"cute:{stage}"]
    assert len(found) == 1, (stage, _stages(info))
    return found[0]


def test_graph_lists_every_kernel_by_its_stage(tp8):
    """`graphstep graph --batch 4 --mode fork` at TP 8: every kernel named after its stage
    (TopK: a cluster split at 2K context; SparseCore: 64 slots per CTA, so a combine)."""
    indexer = ["index_query", "dsa_index", "top_k_cluster"]
    mla = ["query_norm_rows", "mla_query_project", "mla_query_absorb"]
    sparse = ["sparse_core_partial", "sparse_core_combine"]
    fork = inspect(tp8.graph(4, "fork"))  # IndexKey and the indexer's QueryNorm in one launch
    assert sorted(_stages(fork)) == sorted(["key_and_query_norm"] + indexer + mla + sparse)
    serial = inspect(tp8.graph(4, "serial"))  # MlaQuery's norm writes the indexer's q_c
    assert sorted(_stages(serial)) == sorted(["index_key"] + indexer + mla + sparse)


def test_graph_edges_show_pdl_fork_and_join(tp8):
    fork = inspect(tp8.graph(4, "fork"))
    serial = inspect(tp8.graph(4, "serial"))
    for info, opening in ((fork, "key_and_query_norm"), (serial, "index_key")):
        edges = {(e.src, e.dst): e for e in info.edges}
        project, absorb = _kernel(info, "mla_query_project"), _kernel(info, "mla_query_absorb")
        assert edges[(project, absorb)].type == 1, "project -> absorb is a programmatic edge"
        assert any(e.dst == project and e.type == 1 for e in info.edges), "norm -> project is programmatic"
        # the indexer: (QueryNorm or MlaQuery) -> IndexQuery (one kernel) -> DsaIndex -> TopK, all PDL
        chain = [_kernel(info, "index_query"), _kernel(info, "dsa_index"), _kernel(info, "top_k_cluster")]
        assert any(e.dst == chain[0] and e.type == 1 for e in info.edges), "q_c's writer -> IndexQuery is PDL"
        assert any(e.src == _kernel(info, opening) and e.type == 1 for e in info.edges), "IndexKey opens the chain"
        for a, b in zip(chain, chain[1:]):
            assert edges[(a, b)].type == 1, (a, b)
    assert len(fork.programmatic) >= 6 and len(serial.programmatic) >= 7
    assert (len(fork.roots) >= 2 or fork.forks) and fork.joins
    assert not serial.forks and not serial.joins and len(serial.roots) == 1


def test_fork_poll_keeps_the_sparse_core_off_the_join(tp8):
    """fork_poll on one rank: the sparse core's partial kernel has TopK as its one (PDL)
    predecessor; no node joins the streams (the side stream ends in its own sink), where
    fork's partial kernel is the join of TopK and MlaQuery's absorb."""
    fork, poll = inspect(tp8.graph(4, "fork")), inspect(tp8.graph(4, "fork_poll"))
    top_k, absorb = _kernel(fork, "top_k_cluster"), _kernel(fork, "mla_query_absorb")
    assert sorted(fork.predecessors(_kernel(fork, "sparse_core_partial"))) == sorted([top_k, absorb])
    partial = _kernel(poll, "sparse_core_partial")
    assert poll.predecessors(partial) == [_kernel(poll, "top_k_cluster")]
    assert all(e.type == 1 for e in poll.edges if e.dst == partial)
    assert not poll.joins and not poll.successors(_kernel(poll, "mla_query_absorb"))
    assert sorted(_stages(poll)) == sorted(_stages(fork))


@pytest.fixture(scope="module")
def dcp2():
    step = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8, dcp=2, rank=1)),
        capture_sizes=(2, 8),
        policy="fork",
        max_context=2048,
        seed=_seed(),
        budget_ns=20_000_000,
    )
    step.capture(modes=("serial", "fork_poll"))
    return step


def test_dcp_modes_agree_and_a_lost_publisher_raises(dcp2):
    inputs = dcp2.state.inputs(7, seed=_seed())
    peers = dcp2.state.peer_inputs(inputs, seed=_seed())
    results = {}
    for mode in ("fork", "serial", "fork_poll"):
        dcp2.load(inputs, peers)
        _poison(dcp2, 7)
        dcp2.replay(8, mode)
        torch.cuda.synchronize()
        dcp2.error.check(dcp2.shape.gathered, dcp2.shape.mailbox_row_chunks)
        results[mode] = _outputs(dcp2, 7)
        # both ranks' rows were read and re-armed: every chunk holds the sentinel again
        assert bool((dcp2.caches.mailbox == formats.SENTINEL_BYTE).all()), mode
    assert not any(t.isnan().any() for t in (results["fork"][0], results["fork"][3], results["fork"][4]))
    assert _equal(results["fork"], results["serial"]) and _equal(results["fork"], results["fork_poll"])
    expect = formats.encode_q_rows(peers.rows[:, :16], "bf16").view(7, 16, -1)
    assert torch.equal(dcp2.buffers.q_out[:7, :16], expect)
    # a peer row that never lands: the step raises, names it, and the next step works
    dcp2.load(inputs, peers)
    dcp2.transport.rows[2, 5, 16 * 9 : 16 * 10] = formats.SENTINEL_BYTE
    dcp2.replay(8, "fork")
    with pytest.raises(MailboxTimeout) as lost:
        torch.cuda.synchronize()
        dcp2.error.check(dcp2.shape.gathered, dcp2.shape.mailbox_row_chunks)
    assert (lost.value.token, lost.value.row, lost.value.chunk) == (2, 5, 9)
    out = dcp2.step(inputs, peers)
    assert torch.isfinite(out.out).all()


def test_fork_poll_joins_where_the_sparse_core_may_not_poll():
    """At 24 tokens the partial grid (192 CTAs, one an SM) could hold every SM while it spins
    (sparse_core.POLL_MAX_CTAS): there fork_poll's graph joins the side stream before the
    sparse core, as fork's does, and gives fork's outputs bit for bit."""
    step = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8)),
        capture_sizes=(24,),
        policy="fork_poll",
        max_context=2048,
        seed=_seed(),
    )
    step.capture(modes=("fork",), keep_graph=True)
    assert not step.stages.polls_query_rows(24)
    for mode in ("fork", "fork_poll"):
        info = inspect(step.graph(24, mode))
        top_k = [n.index for n in info.kernels() if short(n.name).startswith("cute:top_k")]
        expect = sorted(top_k + [_kernel(info, "mla_query_absorb")])
        assert sorted(info.predecessors(_kernel(info, "sparse_core_partial"))) == expect, mode
    inputs = step.state.inputs(24, seed=_seed())
    results = {}
    for mode in ("fork", "fork_poll"):
        step.load(inputs)
        _poison(step, 24)
        step.replay(24, mode)
        torch.cuda.synchronize()
        results[mode] = _outputs(step, 24)
    assert not any(t.isnan().any() for t in (results["fork"][0], results["fork"][3], results["fork"][4]))
    assert _equal(results["fork"], results["fork_poll"])
    step.check()


def test_tp1_step_with_the_streamed_project_matches_the_reference(monkeypatch):
    """TP 1 (fp8 MLA cache, as `graphstep bench --tp 1 --mla-cache fp8`) with MlaQuery's streamed
    project on (kernels/mla_query.py STREAM_FROM_HEADS): every captured size's graph against the
    reference on fresh inputs, its replay equal to its eager launches, the mailbox re-armed."""
    from graphstep.kernels import mla_query

    monkeypatch.setattr(mla_query, "STREAM_FROM_HEADS", 128)
    sizes = (1, 16, 64)
    step = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=1, mla_cache="fp8")),
        capture_sizes=sizes,
        policy="fork",
        max_context=2048,
        seed=_seed(),
    )
    assert [step.stages.kernels.mla_query_tokens(b) for b in sizes] == [16, 16, 64]  # streamed at every size
    step.capture(modes=("serial", "fork_poll"))
    for size in sizes:
        inputs = step.state.inputs(size, seed=_seed())
        expect = ref.reference_step(step.state, inputs, step.state.clone_caches())
        _poison(step, size)
        got = step.step(inputs)
        torch.cuda.synchronize()
        assert rel_err(got.q_rows, expect.q_rows) < 1e-2, size
        scores = step.buffers.scores[:size]
        assert torch.equal(got.slots, ref.to_slots(ref.topk_indices(scores, 2048), inputs.block_tables, 64))
        assert rel_err(got.out, expect.out) < 2e-2, size
        replayed = _outputs(step, size)
        step.load(inputs)
        _poison(step, size)
        step.run_stages(size, step.modes[size])
        torch.cuda.synchronize()
        assert _equal(_outputs(step, size), replayed), f"B = {size}: replay and eager launches differ"
        step.error.check(step.shape.gathered, step.shape.mailbox_row_chunks)
        assert bool((step.caches.mailbox == formats.SENTINEL_BYTE).all()), "a mailbox chunk left published"
