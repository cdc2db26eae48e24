"""The DCP transport and the stages interface on the CPU (torch backend): what SimulatedPeers
stages and publishes, where the step calls the transport in its data path, and a transport
that takes no PeerInputs plugged into an unchanged step."""

import pytest
import torch

from conftest import SMALL
from graphstep import formats
from graphstep.shapes import RankShape, Topology
from graphstep.stages import Stages
from graphstep.step import BACKENDS, DecodeStep
from graphstep.transport import PeerCandidates, SimulatedPeers, SingleRank, Transport

DCP = Topology(tp=4, dcp=2, rank=1)  # SMALL: 4 heads per rank, 8 gathered rows, rank 1 owns rows 4..8


def _step(topology=DCP, sizes=(4,), **kw):
    return DecodeStep(
        RankShape(SMALL, topology), capture_sizes=sizes, backend="torch", device="cpu", max_context=200, **kw
    )


def test_simulated_peers_stage_the_peers_and_pad_the_rest():
    step = _step()
    inputs = step.state.inputs(3, seed=1)
    peers = step.state.peer_inputs(inputs, seed=2)
    step.transport.rows.fill_(0x33)  # left over from an earlier step
    assert step.load(inputs, peers) == 4
    staged = step.transport
    assert torch.equal(staged.rows[:3], formats.encode_q_rows(peers.rows, "bf16").view(3, 8, -1))
    assert (staged.rows[3] == 0).all(), "a pad row counts as published"
    assert torch.equal(staged.positions[:3], peers.positions) and torch.equal(staged.scores[:3], peers.scores)
    assert (staged.positions[3] == -1).all() and (staged.scores[3] == float("-inf")).all()


def test_publish_writes_the_other_ranks_rows_of_the_steps_tokens_only():
    step = _step(sizes=(2, 4))
    mailbox, peers = step.caches.mailbox, step.transport
    peers.rows.copy_(torch.randint(0, 255, peers.rows.shape, dtype=torch.uint8))
    mailbox.fill_(0x5A)
    peers.publish_query_rows(2)
    assert torch.equal(mailbox[:2, :4], peers.rows[:2, :4]), "rank 0's rows landed"
    assert (mailbox[:2, 4:8] == 0x5A).all(), "this rank's own rows are its MlaQuery's"
    assert (mailbox[:2, 8:] == 0x5A).all(), "pad head rows up to q_heads are never published"
    assert (mailbox[2:] == 0x5A).all(), "rows past the step's size untouched"
    before = mailbox.clone()
    peers.arm(2)  # the sparse core re-arms the query rows; the simulation has nothing else
    assert torch.equal(mailbox, before)


def test_publish_candidates_hands_dcp_merge_the_staged_buffers_without_copying():
    peers = _step().transport
    own = torch.zeros(4, SMALL.index_topk, dtype=torch.int32)
    got = peers.publish_candidates(own, own.float(), 3)
    assert got.positions.shape == got.scores.shape == (3, 2, SMALL.index_topk)
    assert got.positions.data_ptr() == peers.positions.data_ptr()
    assert got.scores.data_ptr() == peers.scores.data_ptr()
    assert got.offsets is None and got.flags is None  # stacked; nothing to wait for


def test_single_rank_exchanges_nothing():
    step = _step(Topology(tp=4))
    assert isinstance(step.transport, SingleRank)
    step.caches.mailbox.fill_(0x5A)
    step.transport.publish_query_rows(4)
    step.transport.arm(1)
    assert (step.caches.mailbox == 0x5A).all()
    with pytest.raises(RuntimeError, match="no candidates"):
        step.transport.publish_candidates(step.buffers.slots, step.buffers.own_scores, 1)


class Log(list):
    """The stages and transport calls of one run_stages, in issue order."""

    def wrap(self, obj, names):
        for name in names:
            method = getattr(obj, name)
            setattr(obj, name, lambda *a, _m=method, _n=name, **k: (self.append(_n), _m(*a, **k))[1])


STAGES = ["index_key", "key_and_query_norm", "index_query", "index_scores", "top_k", "dcp_merge", "mla_query"]
STAGES += ["query_wait", "sparse_core"]
EXCHANGES = ["publish_query_rows", "share_query_rows", "publish_candidates", "arm"]
SHARE = ["mla_query", "share_query_rows"]  # a transport's copies of the rows follow MlaQuery
INDEXER = ["index_query", "index_scores", "top_k"]
MERGE = ["publish_candidates", "dcp_merge"]  # the indexer's end under DCP
FORK = ["publish_query_rows", "key_and_query_norm", *INDEXER, *SHARE]  # phases: produce, exchange, consume


@pytest.mark.parametrize(
    "topology, mode, expect",
    [
        (DCP, "fork", [*FORK, "publish_candidates", "query_wait", "dcp_merge"]),
        (DCP, "fork_poll", [*FORK, *MERGE]),
        (DCP, "serial", ["publish_query_rows", "index_key", *SHARE, *INDEXER, *MERGE]),
        (Topology(tp=4), "fork", FORK),
        (Topology(tp=4), "serial", ["publish_query_rows", "index_key", *SHARE, *INDEXER]),
    ],
)
def test_the_step_calls_the_stages_and_the_transport_in_data_path_order(topology, mode, expect):
    step = _step(topology, policy=mode)
    inputs = step.state.inputs(3, seed=4)
    step.load(inputs, step.state.peer_inputs(inputs, seed=5) if topology.dcp > 1 else None)
    log = Log()
    log.wrap(step.stages, STAGES)
    log.wrap(step.transport, EXCHANGES)
    step.run_stages(4, mode)
    assert log == [*expect, "sparse_core", "arm"]


def test_every_backend_implements_every_stage():
    for backend in BACKENDS.values():
        assert issubclass(backend, Stages) and not backend.__abstractmethods__, backend


class Loopback(Transport):
    """A transport that takes nothing from step()'s caller: the other ranks' query rows and
    candidates are fixed at construction, as a real transport would receive them."""

    def __init__(self, shape, mailbox, given):
        self.shape, self.mailbox, self.given = shape, mailbox, given
        self.encoded = formats.encode_q_rows(given.rows, shape.topology.q_format).view(*given.rows.shape[:2], -1)

    def check(self, peers, batch):
        if peers is not None:
            raise ValueError("Loopback takes no peers")

    def value_checks(self, peers, context_lens):
        return []

    def load(self, peers, batch, size):
        pass

    def publish_query_rows(self, size):
        theirs = slice(0, self.shape.heads)  # rank 0's rows; this is rank 1
        self.mailbox[:size, theirs] = self.encoded[:size, theirs]

    def share_query_rows(self, size):
        pass

    def publish_candidates(self, positions, scores, size):
        return PeerCandidates(self.given.positions[:size], self.given.scores[:size])

    def arm(self, size):
        formats.arm(self.mailbox[:size])


def test_a_transport_without_peer_inputs_plugs_into_the_step_unchanged():
    simulated = _step(policy="fork", seed=9)
    inputs = simulated.state.inputs(4, seed=6)
    peers = simulated.state.peer_inputs(inputs, seed=7)
    loopback = _step(policy="fork", seed=9, transport=lambda shape, mailbox: Loopback(shape, mailbox, peers))
    assert isinstance(simulated.transport, SimulatedPeers) and isinstance(loopback.transport, Loopback)
    expect = simulated.step(inputs, peers, eager=True)
    got = loopback.step(inputs, eager=True)
    for name in ("q_c", "slots", "q_rows", "out", "lse"):
        assert torch.equal(getattr(got, name), getattr(expect, name)), name
    assert torch.equal(got.q_rows[:, :4], peers.rows[:, :4].bfloat16()), "the transport's rows were attended"
    with pytest.raises(ValueError, match="Loopback takes no peers"):
        loopback.step(inputs, peers, eager=True)
