"""DcpGroup on an sm_90 GPU with the cute kernels: d = 2 and 4 ranks on one GPU, each rank
in its own thread on its own stream, eager (graphs need the in-kernel publishes of issue 12).

The group runs the fork data path: on the side stream MlaQuery (no poll), then the rank's
pushes of its rows into the peers' mailboxes and the wait on the peers' pushes (CUDA
events), then QueryWait, which polls the mailbox and, for a rank that never came, records
the missing chunk in the error word (step() raises MailboxTimeout). Serial and fork_poll
cannot run a group without remote stores: MlaQuery polls for the peers' rows before it
returns, so a copy issued after it would come too late."""

import pytest
import torch

from conftest import rel_err
from graphstep import reference as ref
from graphstep.dcp_group import DcpGroup
from graphstep.launch import MailboxTimeout
from graphstep.shapes import RankShape, Topology, preset

pytestmark = pytest.mark.gpu
SHAPE = RankShape(preset("deepseek-v3.2"), Topology(tp=8))  # 16 heads per rank
CONTEXT = 8192  # past index_topk x dcp: the global top-k takes some of each rank's candidates


@pytest.fixture(scope="module", params=[2, 4])
def group(request):
    return DcpGroup(
        SHAPE,
        request.param,
        devices="cuda",
        capture_sizes=(4, 8),
        backend="cute",
        max_context=CONTEXT,
        seed=11,
        budget_ns=20_000_000,
        wait_s=1.0,
    )


def _global_positions(group, outputs, batch):
    """The global positions each rank attended (its slots through its block tables), -1 padded."""
    positions = []
    for rank, (step, out) in enumerate(zip(group.steps, outputs)):
        page = SHAPE.model.page_size
        tables = step.state.caches.block_tables[:batch].long()
        local = torch.arange(tables.shape[1] * page, device=tables.device)
        slots = tables[:, local // page] * page + local % page  # [batch, local positions]
        inverse = torch.full((step.state.trash_page * page,), -1, dtype=torch.long, device=tables.device)
        inverse[slots.flatten()] = local.repeat(batch)
        chosen = out.slots.long()
        index = torch.where(chosen >= 0, inverse[chosen.clamp_min(0)], -1)
        positions.append(torch.where(index >= 0, index * group.dcp + rank, -1))
    return torch.cat(positions, dim=1)


def test_every_rank_holds_its_share_of_the_merge_and_the_combine_is_the_unsharded_attention(group):
    inputs = group.unsharded.inputs(7, context_lens=[CONTEXT, 6000, 4097, 2049, 300, 64, 1], seed=3)
    outputs = group.step(inputs)
    # the candidates every rank received are the others' TopK outputs; its slots their merge
    candidates = [ref.Candidates(s.buffers.own_positions[:7], s.buffers.own_scores[:7]) for s in group.steps]
    merged = ref.dcp_merge(candidates, SHAPE.model.index_topk)
    for rank, (step, out) in enumerate(zip(group.steps, outputs)):
        for peer in range(group.dcp):
            if peer != rank:
                assert torch.equal(step.transport.positions[:7, peer], candidates[peer].positions), (rank, peer)
        tables = step.state.caches.block_tables[:7]
        assert torch.equal(out.slots, ref.local_slots(merged, tables, 64, group.dcp, rank)), rank
        assert torch.equal(out.q_rows, outputs[0].q_rows), "every rank attended the same gathered rows"
    # the combine against the unsharded layer's attention over the same positions
    out, lse = group.combine(outputs)
    ref.kv_insert(group.unsharded, inputs, group.unsharded.caches)
    positions = _global_positions(group, outputs, 7)  # [7, dcp x topk], -1 padded
    k = SHAPE.model.index_topk
    assert torch.equal(positions.sort(1).values[:, -k:], merged.long().sort(1).values), "the ranks attend the merge"
    slots = ref.to_slots(merged, inputs.block_tables, 64)
    q = outputs[0].q_rows.float()
    expect_out, expect_lse = ref.sparse_attention(group.unsharded, group.unsharded.caches, q, slots)
    assert rel_err(out, expect_out) < 2e-3 and rel_err(lse, expect_lse) < 2e-3
    assert all(t is not None for t in group.times) and group.group_time > 0


def test_a_rank_that_is_not_run_times_the_others_out_and_the_group_recovers(group):
    inputs = group.unsharded.inputs(4, context_lens=4000, seed=4)
    missing = group.dcp - 1
    with pytest.raises(MailboxTimeout) as lost:
        group.step(inputs, absent=[missing])
    assert (lost.value.rank, lost.value.token, lost.value.row, lost.value.chunk) == (missing, 0, 16 * missing, 0)
    outputs = group.step(inputs)
    candidates = [ref.Candidates(s.buffers.own_positions[:4], s.buffers.own_scores[:4]) for s in group.steps]
    merged = ref.dcp_merge(candidates, SHAPE.model.index_topk)
    for rank, (step, out) in enumerate(zip(group.steps, outputs)):
        tables = step.state.caches.block_tables[:4]
        assert torch.equal(out.slots, ref.local_slots(merged, tables, 64, group.dcp, rank)), rank
        assert torch.isfinite(out.out).all()


def test_a_rank_delayed_on_the_gpu_gives_the_same_results(group, monkeypatch):
    inputs = group.unsharded.inputs(4, context_lens=5000, seed=5)
    expect = [(out.slots.clone(), out.out.clone()) for out in group.step(inputs)]
    late = group.steps[-1].stages
    index_key = late.index_key

    def delayed(size):
        torch.cuda._sleep(2_000_000)  # a spin kernel of about 1 ms ahead of the rank's step
        index_key(size)

    monkeypatch.setattr(late, "index_key", delayed)
    for out, (slots, attention) in zip(group.step(inputs), expect):
        assert torch.equal(out.slots, slots) and torch.equal(out.out, attention)
