"""DcpGroup on an sm_90 GPU with the cute kernels: d = 2 and 4 real ranks on one GPU whose
kernels exchange through each other's memory (PeerTransport): MlaQuery stores every rank's
rows into every mailbox, CandidateSync sets and waits on ready flags, DcpMerge reads the
peers' candidates in place. Each rank's step is one CUDA graph per size and step parity,
launched on its own stream; nothing on the host meets or copies between the ranks."""

from dataclasses import fields

import pytest
import torch

from conftest import rel_err
from graphstep import reference as ref
from graphstep.dcp_group import DcpGroup, PeerTransport
from graphstep.launch import CandidatesTimeout, MailboxTimeout
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import StepInputs

pytestmark = pytest.mark.gpu
CONTEXT = 8192  # past index_topk x dcp: the global top-k takes some of each rank's candidates
BUDGET_NS = 20_000_000  # a lost rank fails a step within 20 ms


def _group(dcp, split=False, devices="cuda", seed=None):
    """A captured group; seed None: fresh weights and caches each run."""
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8, dcp=dcp, split=split))  # 16 heads per rank
    group = DcpGroup(
        shape,
        dcp,
        devices=devices,
        capture_sizes=(4, 8),
        backend="cute",
        max_context=CONTEXT,
        seed=int(torch.randint(0, 2**31, ())) if seed is None else seed,
        budget_ns=BUDGET_NS,
    )
    group.capture()
    return group


@pytest.fixture(scope="module", params=[(2, False), (4, False), (2, True)], ids=["dcp2", "dcp4", "dcp2-split"])
def group(request):
    return _group(*request.param)


def _poison(group, rows: int):
    """Fill every rank's outputs of the first `rows` tokens with what no kernel writes (NaN,
    slot -7, 0xA5 bytes): a step that leaves any of them unwritten cannot equal one that wrote it."""
    for step in group.steps:
        b = step.buffers
        for t in (b.qc, b.out, b.lse):
            t[:rows].fill_(float("nan"))
        b.slots[:rows].fill_(-7)
        b.q_out[:rows].fill_(0xA5)


def _candidates(group, batch):
    """Every rank's TopK candidates of the last step (in its own exchange memory)."""
    parity = (group.steps_run - 1) % 2
    return [ref.Candidates(t.positions[parity, :batch], t.scores[parity, :batch]) for t in group.transports]


def _global_positions(group, outputs, batch):
    """The global positions each rank attended (its slots through its block tables), -1 padded."""
    positions, page = [], group.steps[0].shape.model.page_size
    for rank, (step, out) in enumerate(zip(group.steps, outputs)):
        tables = step.state.caches.block_tables[:batch].long()
        local = torch.arange(tables.shape[1] * page, device=tables.device)
        slots = tables[:, local // page] * page + local % page  # [batch, local positions]
        inverse = torch.full((step.state.trash_page * page,), -1, dtype=torch.long, device=tables.device)
        inverse[slots.flatten()] = local.repeat(batch)
        chosen = out.slots.long()
        index = torch.where(chosen >= 0, inverse[chosen.clamp_min(0)], -1)
        positions.append(torch.where(index >= 0, index * group.dcp + rank, -1))
    return torch.cat(positions, dim=1)


def _check_merge(group, outputs, batch):
    k = group.steps[0].shape.model.index_topk
    merged = ref.dcp_merge(_candidates(group, batch), k)
    for rank, (step, out) in enumerate(zip(group.steps, outputs)):
        tables = step.state.caches.block_tables[:batch]
        assert torch.equal(out.slots, ref.local_slots(merged, tables, 64, group.dcp, rank)), rank
        assert torch.equal(out.q_rows, outputs[0].q_rows), "every rank attended the same gathered rows"
    return merged


def test_the_ranks_exchange_through_peer_memory():
    group = _group(2)
    assert all(isinstance(t, PeerTransport) for t in group.transports)
    first, second = (t.memory.data_ptr() for t in group.transports)
    assert group.transports[0].mailbox_offsets.tolist() == [0, second - first]
    assert set(group.steps[0].graphs) == {(8, "fork"), (8, "fork", 1), (4, "fork"), (4, "fork", 1)}


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_every_rank_holds_its_share_of_the_merge_and_the_combine_is_the_unsharded_attention(group, eager):
    inputs = group.unsharded.inputs(7, context_lens=[CONTEXT, 6000, 4097, 2049, 300, 64, 1], seed=3)
    outputs = group.step(inputs, eager=eager)
    merged = _check_merge(group, outputs, 7)
    # the combine against the unsharded layer's attention over the same positions
    out, lse = group.combine(outputs)
    ref.kv_insert(group.unsharded, inputs, group.unsharded.caches)
    positions = _global_positions(group, outputs, 7)  # [7, dcp x topk], -1 padded
    k = group.steps[0].shape.model.index_topk
    assert torch.equal(positions.sort(1).values[:, -k:], merged.long().sort(1).values), "the ranks attend the merge"
    slots = ref.to_slots(merged, inputs.block_tables, 64)
    q = outputs[0].q_rows.float()
    expect_out, expect_lse = ref.sparse_attention(group.unsharded, group.unsharded.caches, q, slots)
    assert rel_err(out, expect_out) < 2e-3 and rel_err(lse, expect_lse) < 2e-3
    # the gathered rows are every rank's own MlaQuery rows (the reference's per rank)
    heads = group.steps[0].shape.heads
    for rank, step in enumerate(group.steps):
        rank_inputs = group.rank_inputs(inputs)[rank]
        own = ref.mla_query(step.state, rank_inputs, ref.query_norm(step.state, rank_inputs))  # [B, heads, 576]
        got = outputs[0].q_rows[:, rank * heads : (rank + 1) * heads].float()
        assert rel_err(got, own) < 1e-2, rank
    assert all(t is not None and t > 0 for t in group.times) and group.group_time > 0


def test_a_rank_that_is_not_run_times_the_others_out_and_the_group_recovers(group):
    inputs = group.unsharded.inputs(4, context_lens=4000, seed=4)
    missing = group.dcp - 1
    heads = group.steps[0].shape.heads
    with pytest.raises(MailboxTimeout) as lost:
        group.step(inputs, absent=[missing])
    assert (lost.value.rank, lost.value.token, lost.value.row, lost.value.chunk) == (missing, 0, heads * missing, 0)
    for step in group.steps:  # every error word was read and reset, every exchange re-armed
        assert step.error.word.tolist() == type(step.error).new("cuda").word.tolist()
    for _ in range(3):  # both parities work again
        outputs = group.step(inputs)
        _check_merge(group, outputs, 4)
        assert all(torch.isfinite(out.out).all() for out in outputs)


def test_a_rank_that_publishes_its_rows_but_not_its_candidates_times_the_others_out(group):
    """The candidate exchange alone: the last rank issues only its produce phase (its rows
    reach every mailbox, its TopK runs) and never its CandidateSync, so every other rank's
    QueryWait passes and its CandidateSync gives up naming that rank."""
    inputs = group.unsharded.inputs(4, context_lens=4000, seed=6)
    silent = group.dcp - 1
    sizes = {}
    for rank, rank_inputs in enumerate(group.rank_inputs(inputs)):
        with group._on(rank):
            sizes[rank] = group.steps[rank].load(rank_inputs)
    parity = group.steps_run % 2
    phases = {
        rank: group.steps[rank].phases(size, group.steps[rank].modes[size], parity) for rank, size in sizes.items()
    }
    for rank in phases:
        with group._on(rank):
            phases[rank][0]()
    for phase in (1, 2):
        for rank in range(silent):
            with group._on(rank):
                phases[rank][phase]()
    errors = group._finish(range(group.dcp), rearm=True)
    assert len(errors) == silent and all(isinstance(error, CandidatesTimeout) for error in errors)
    assert sorted(error.rank for error in errors) == list(range(silent))
    assert all(error.missing == [silent] for error in errors)
    outputs = group.step(inputs)  # re-armed: the next step runs normally
    _check_merge(group, outputs, 4)


def test_a_rank_delayed_on_the_gpu_gives_the_same_results(group):
    inputs = group.unsharded.inputs(4, context_lens=5000, seed=int(torch.randint(0, 2**31, ())))
    _poison(group, 4)
    expect = [(out.slots.clone(), out.out.clone()) for out in group.step(inputs)]
    assert all(not (slots == -7).any() and not attention.isnan().any() for slots, attention in expect)
    for delayed in range(group.dcp):
        _poison(group, 4)
        outputs = group.step(inputs, delays={delayed: 0.001})  # a spin of about 1 ms before its step
        for out, (slots, attention) in zip(outputs, expect):
            assert torch.equal(out.slots, slots) and torch.equal(out.out, attention), delayed


def test_a_thousand_group_steps_of_varying_batch_are_bit_identical_to_eager():
    group = _group(2)
    gen = torch.Generator().manual_seed(8)
    batches = [1, 2, 3, 4, 5, 6, 7, 8]
    # the first b tokens of one batch of 8: every step inserts a token's own KV row at its own
    # position, whatever the order, so every step's outputs are those of its batch alone
    lens = torch.randint(1, CONTEXT + 1, (8,), generator=gen).tolist()
    full = group.unsharded.inputs(8, context_lens=lens, seed=8)
    inputs = {b: StepInputs(*(getattr(full, f.name)[:b] for f in fields(StepInputs))) for b in batches}
    expect = {}
    for b in batches:  # eager, each batch once (the cache inserts repeat the same rows)
        _poison(group, b)
        outputs = group.step(inputs[b], eager=True)
        expect[b] = [(o.slots.clone(), o.out.clone(), o.lse.clone(), o.q_rows.clone()) for o in outputs]
        assert all(not (e[0] == -7).any() and not e[1].isnan().any() and not e[2].isnan().any() for e in expect[b])
    order = torch.randint(0, len(batches), (1000,), generator=gen).tolist()
    for i, pick in enumerate(order):
        b = batches[pick]
        _poison(group, b)  # so a replay that writes nothing cannot pass on the last step's outputs
        outputs = group.step(inputs[b])
        for rank, (out, want) in enumerate(zip(outputs, expect[b])):
            got = (out.slots, out.out, out.lse, out.q_rows)
            assert all(torch.equal(x, y) for x, y in zip(got, want)), (i, b, rank)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_group_over_two_gpus_over_p2p_gives_the_one_gpu_groups_results():
    """The same code with one GPU per rank: the kernels store rows, set flags and read
    candidates over P2P; every output equals the one-GPU group's bit for bit (same seed,
    same inputs), eager and graphs, at both parities."""
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 have no peer access")
    seed = int(torch.randint(0, 2**31, ()))
    one, two = _group(2, seed=seed), _group(2, devices=["cuda:0", "cuda:1"], seed=seed)
    assert [t.memory.device.index for t in two.transports] == [0, 1]
    for eager in (True, False, False, False):
        steps = []
        for group in (one, two):
            inputs = group.unsharded.inputs(5, context_lens=[CONTEXT, 6000, 2049, 300, 1], seed=13)
            steps.append(
                [{f.name: getattr(out, f.name).cpu() for f in fields(out)} for out in group.step(inputs, eager=eager)]
            )
        for rank, (a, b) in enumerate(zip(*steps)):
            for name in a:
                assert torch.equal(a[name], b[name]), (eager, rank, name)
