"""DcpGroup: the ranks of one decode-context-parallel (DCP) group in one process.

Rank r is a DecodeStep of `shape.with_topology(dcp=d, rank=r)` holding the shard of ONE
unsharded layer (`DcpGroup.unsharded`, LayerState.load_shard): Q_B and W_UK of its heads,
the cached tokens at positions p % d == r. Each rank has its own mailbox and candidate
buffers; they exchange through `GroupTransport`, and `combine_ranks` (graphstep.reference)
turns the ranks' (out, lse) into the attention of the unsharded layer.

A group step runs every rank's step eagerly, each in its own host thread, and the ranks
meet at the two exchanges of a step (docs/design.md section 4, "The group protocol"):

1. after its MlaQuery, each rank pushes its own query rows into every other rank's
   mailbox (`share_query_rows`) and waits for the others' pushes;
2. after its TopK, each rank pushes its candidates into every other rank's candidate
   buffers (`publish_candidates`) and waits for the others'; then DcpMerge and the sparse
   core run on this rank's own buffers only.

Pushing, not pulling: a rank's buffers are written by the others and read, then re-armed,
by their owner alone, so one meeting per exchange suffices (a pull would need a second,
"every peer has copied my rows", before the owner may re-arm its own mailbox).

The torch backend runs the serial data path (MlaQuery, then the indexer): with no
streams and no poll, the rows exchange comes first and the transport itself checks the
mailbox as QueryWait would. The cute backend runs fork: QueryWait polls after the pushes
(CUDA events order each rank's stream after its peers' pushes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import replace

import torch

from . import formats
from . import reference as ref
from .launch import DEFAULT_BUDGET_NS, MailboxTimeout
from .shapes import RankShape
from .state import LayerState, PeerInputs, StepInputs, StepOutputs
from .step import DecodeStep
from .transport import Transport, ValueCheck

GROUP_POLICY = {"torch": "serial", "cute": "fork"}  # why: the module docstring


class CandidatesTimeout(RuntimeError):
    """Some ranks' top-k candidates never arrived (their step stopped between the two exchanges)."""

    def __init__(self, rank: int, missing: list[int]):
        super().__init__(f"DCP candidates: rank {rank} never received the candidates of ranks {missing}")
        self.rank, self.missing = rank, missing


class Rendezvous:
    """Where the ranks' host threads meet at an exchange of a step: a rank arrives once its
    pushes are issued and waits, up to wait_s, for the others."""

    def __init__(self, dcp: int, wait_s: float):
        self.dcp, self.wait_s = dcp, wait_s
        self._cond = threading.Condition()
        self._arrived: dict[str, set[int]] = {}

    def reset(self) -> None:
        """Forget the last step's arrivals (before every group step)."""
        with self._cond:
            self._arrived.clear()

    def meet(self, exchange: str, rank: int) -> list[int]:
        """Arrive at `exchange`; return the ranks that had not arrived when the wait ended."""
        with self._cond:
            arrived = self._arrived.setdefault(exchange, set())
            arrived.add(rank)
            self._cond.notify_all()
            self._cond.wait_for(lambda: len(arrived) == self.dcp, timeout=self.wait_s)
            return sorted(set(range(self.dcp)) - arrived)


class GroupTransport(Transport):
    """One rank's end of the group's exchanges: pushes into the other ranks' buffers, then
    meets them (Rendezvous). peers: every rank's GroupTransport, by rank (filled as the
    ranks are built). check_rows: check the mailbox after the rows exchange and raise
    MailboxTimeout (backends without a poll: torch).

    positions int32 / scores fp32 [max_batch, dcp, topk]: every rank's candidates as
    DcpMerge reads them, row r written by rank r (this rank's row unused)."""

    def __init__(self, shape: RankShape, mailbox: torch.Tensor, peers: list, rendezvous: Rendezvous, check_rows: bool):
        self.shape, self.mailbox, self.peers, self.rendezvous = shape, mailbox, peers, rendezvous
        self.rank, self.check_rows = shape.topology.rank, check_rows
        rows, dev, k = mailbox.shape[0], mailbox.device, shape.model.index_topk
        self.positions = torch.full((rows, shape.topology.dcp, k), -1, dtype=torch.int32, device=dev)
        self.scores = torch.full((rows, shape.topology.dcp, k), float("-inf"), device=dev)
        self.pushed: dict[str, torch.cuda.Event] = {}  # CUDA: the event after this step's pushes
        self.lost_candidates: list[int] = []
        peers[self.rank] = self

    @property
    def own(self) -> slice:
        """This rank's head rows of a token in the mailbox: [rank x H, (rank + 1) x H)."""
        heads = self.shape.heads
        return slice(self.rank * heads, (self.rank + 1) * heads)

    def others(self) -> list[GroupTransport]:
        """The other ranks' transports, in rank order (whom this rank pushes to)."""
        return [peer for rank, peer in enumerate(self.peers) if rank != self.rank]

    def check(self, peers: PeerInputs | None, batch: int) -> None:
        if peers is not None:
            raise ValueError("a DcpGroup rank takes no peers: the other ranks are real (DcpGroup.step)")

    def value_checks(self, peers: PeerInputs | None, context_lens: torch.Tensor) -> list[ValueCheck]:
        return []

    def load(self, peers: PeerInputs | None, batch: int, size: int) -> None:
        pass  # nothing staged: the peers push during the step

    def publish_query_rows(self, size: int) -> None:
        pass  # the peers push theirs after their MlaQuery (share_query_rows)

    def share_query_rows(self, size: int) -> None:
        """Push this rank's rows into every peer's mailbox, meet, then (check_rows) raise
        MailboxTimeout for the first chunk of this mailbox that never landed."""
        own = self.own
        for peer in self.others():
            peer.mailbox[:size, own].copy_(self.mailbox[:size, own], non_blocking=True)
        self._meet("rows")
        if self.check_rows:
            lost = formats.first_missing(self.mailbox, size, self.shape.gathered)
            if lost is not None:
                raise MailboxTimeout(*lost, heads=self.shape.heads)

    def publish_candidates(
        self, positions: torch.Tensor, scores: torch.Tensor, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Push this rank's candidates into row `rank` of every peer's buffers, meet, and
        return this rank's buffers; a rank that never came offers nothing (-1 / -inf) and
        is kept in lost_candidates (the group raises CandidatesTimeout)."""
        for peer in self.others():
            peer.positions[:size, self.rank].copy_(positions[:size], non_blocking=True)
            peer.scores[:size, self.rank].copy_(scores[:size], non_blocking=True)
        self.lost_candidates = self._meet("candidates")
        for rank in self.lost_candidates:
            self.positions[:size, rank] = -1
            self.scores[:size, rank] = float("-inf")
        return self.positions[:size], self.scores[:size]

    def arm(self, size: int) -> None:
        pass  # every peer rewrites its candidate rows each step; the sparse core re-arms the mailbox

    def _meet(self, exchange: str) -> list[int]:
        """Meet the peers after this rank's pushes; on CUDA, order this rank's stream after
        the pushes of every peer that came. Returns the ranks that did not."""
        if self.mailbox.is_cuda:
            self.pushed[exchange] = torch.cuda.Event()
            self.pushed[exchange].record()
        missing = self.rendezvous.meet(exchange, self.rank)
        if self.mailbox.is_cuda:
            for peer in self.others():
                if peer.rank not in missing:
                    torch.cuda.current_stream().wait_event(peer.pushed[exchange])
        return missing


class DcpGroup:
    """The dcp ranks of one DCP group in this process, each a DecodeStep on its own shard of
    one unsharded layer, run eagerly (graph capture needs the in-kernel publishes: issue 12).

    Arguments:
        shape: RankShape of a rank (its tp; its dcp is replaced by `dcp`). tp must be a
            multiple of dcp: the unsharded layer has dcp x heads-per-rank heads.
        dcp: int >= 2, the group's size.
        devices: one torch device for every rank, or a list of one per rank (None: "cpu"
            for the torch backend, the current CUDA device for cute).
        capture_sizes, backend, max_context, seed, budget_ns: as DecodeStep's; the seed
            draws the unsharded layer.
        wait_s: how long a rank waits at an exchange for the others.

    Attributes: unsharded (the LayerState every rank's shard comes from, on the first
    device), steps (the ranks' DecodeSteps), times (seconds of each rank's last step,
    None for an absent rank) and group_time (of the last group step)."""

    def __init__(
        self,
        shape: RankShape,
        dcp: int,
        devices=None,
        capture_sizes=(1, 2, 4, 8),
        backend: str = "torch",
        max_context: int = 4096,
        seed: int = 0,
        budget_ns: int = DEFAULT_BUDGET_NS,
        wait_s: float = 10.0,
    ):
        topo = shape.topology
        if not isinstance(dcp, int) or dcp < 2:
            raise ValueError(f"a DCP group needs dcp >= 2, got {dcp!r}")
        if topo.tp % dcp:
            raise ValueError(f"tp {topo.tp} must be a multiple of dcp {dcp}: the unsharded layer has tp / dcp")
        if backend not in GROUP_POLICY:
            raise ValueError(f"backend {backend!r}: expected one of {tuple(GROUP_POLICY)}")
        if devices is None:
            devices = "cpu" if backend == "torch" else "cuda"
        devices = list(devices) if isinstance(devices, list | tuple) else [devices] * dcp
        if len(devices) != dcp:
            raise ValueError(f"devices: one for every rank or one per rank ({dcp}), got {len(devices)}")
        self.devices = [self._device(d) for d in devices]
        self.dcp = dcp
        unsharded = RankShape(shape.model, replace(topo, tp=topo.tp // dcp, dcp=1, rank=0, split=False))
        sizes = sorted(set(capture_sizes))
        self.unsharded = LayerState(unsharded, sizes[-1], max_context, seed, self.devices[0])
        self.rendezvous = Rendezvous(dcp, wait_s)
        self.transports: list[GroupTransport | None] = [None] * dcp
        check_rows = backend == "torch"
        self.steps: list[DecodeStep] = []
        for rank, device in enumerate(self.devices):
            rank_shape = shape.with_topology(dcp=dcp, rank=rank)
            state = LayerState(rank_shape, sizes[-1], max_context, seed, device)
            state.load_shard(self.unsharded)  # before the backend: Kernels derives W_UK^T from it
            step = DecodeStep(
                rank_shape,
                capture_sizes=sizes,
                policy=GROUP_POLICY[backend],
                backend=backend,
                device=device,
                max_context=max_context,
                seed=seed,
                budget_ns=budget_ns,
                transport=lambda s, mailbox: GroupTransport(s, mailbox, self.transports, self.rendezvous, check_rows),
                state=state,
            )
            step.stages.warm(step.sizes)  # a compile inside a step would hold the peers past wait_s
            self.steps.append(step)
        self.streams = [torch.cuda.Stream(d) if d.type == "cuda" else None for d in self.devices]
        self.times: list[float | None] = [None] * dcp
        self.group_time: float | None = None

    @staticmethod
    def _device(device) -> torch.device:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def rank_inputs(self, inputs: StepInputs) -> list[StepInputs]:
        """The unsharded layer's inputs as each rank takes them: the same qkv and context
        lengths, the rank's own block tables and new-token slots (-1 off the rank)."""
        ranks = []
        for step in self.steps:
            state, dev = step.state, step.device
            lens = inputs.context_lens.to(dev)
            tables = state.caches.block_tables[: inputs.batch]
            ranks.append(StepInputs(inputs.qkv.to(dev), lens, state.new_token_slots(lens, tables), tables))
        return ranks

    def step(self, inputs: StepInputs, absent: Collection[int] = ()) -> list[StepOutputs | None]:
        """One decode step of every rank, each in its own thread; returns each rank's outputs
        (views of its buffers, valid until the next step). inputs: the unsharded layer's
        (self.unsharded.inputs(...)). absent: ranks that do not run (a fault: the others'
        steps then raise MailboxTimeout naming it). A failed step re-arms every mailbox
        before it raises, so the next step starts clean."""
        ranks = self.rank_inputs(inputs)
        for step, stream in zip(self.steps, self.streams):  # the ranks' inputs were made on this stream
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(step.device))
        self.rendezvous.reset()
        outputs: list[StepOutputs | None] = [None] * self.dcp
        errors: list[Exception | None] = [None] * self.dcp
        self.times = [None] * self.dcp

        def run(rank: int) -> None:
            started = time.perf_counter()
            try:
                with self._on(rank):
                    outputs[rank] = self.steps[rank].step(ranks[rank], eager=True)
                    if self.streams[rank] is not None:
                        self.streams[rank].synchronize()
            except Exception as error:  # re-raised by the group, in rank order
                errors[rank] = error
            self.times[rank] = time.perf_counter() - started

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(self.dcp) if rank not in absent]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.group_time = time.perf_counter() - started
        # a rank's own error first: the others' timeouts are its consequence
        failed = [error for error in errors if error is not None]
        failed.sort(key=lambda error: isinstance(error, MailboxTimeout | CandidatesTimeout))
        if failed or absent:
            self._rearm()
        if failed:
            raise failed[0]
        for transport in self.transports:
            if transport.lost_candidates:
                raise CandidatesTimeout(transport.rank, transport.lost_candidates)
        return outputs

    def _on(self, rank: int) -> ExitStack:
        """The rank's device and stream as the thread's current ones (nothing on the CPU)."""
        stack = ExitStack()
        if self.streams[rank] is not None:
            stack.enter_context(torch.cuda.device(self.devices[rank]))
            stack.enter_context(torch.cuda.stream(self.streams[rank]))
        return stack

    def _rearm(self) -> None:
        """Every mailbox armed again (a failed step left pushed rows no sparse core re-armed)."""
        for step in self.steps:
            formats.arm(step.caches.mailbox)
            if step.device.type == "cuda":
                torch.cuda.synchronize(step.device)

    def combine(self, outputs: list[StepOutputs]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranks' attention combined (reference.combine_ranks) on the first device: out
        fp32 [B, gathered, 512] and lse [B, gathered] of the unsharded layer."""
        dev = self.devices[0]
        return ref.combine_ranks([o.out.to(dev) for o in outputs], [o.lse.to(dev) for o in outputs])
