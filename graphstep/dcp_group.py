"""DcpGroup: the ranks of one decode-context-parallel (DCP) group in one process.

Rank r is a DecodeStep of `shape.with_topology(dcp=d, rank=r)` holding the shard of ONE
unsharded layer (`DcpGroup.unsharded`, LayerState.load_shard): Q_B and W_UK of its heads,
the cached tokens at positions p % d == r. The ranks exchange their query rows and their
top-k candidates every step, and `combine_ranks` (graphstep.reference) turns the ranks'
(out, lse) into the attention of the unsharded layer. Two ways to exchange
(docs/design.md section 4):

- cute backend, `PeerTransport`: the kernels themselves. MlaQuery stores each rank's rows
  into every rank's mailbox (remote 16-byte stores), QueryWait polls the own mailbox,
  CandidateSync sets a ready flag in every peer after TopK and waits for theirs, DcpMerge
  reads the peers' candidates where their TopK left them. No host meeting and no copy:
  each rank's step is one CUDA graph per size and step parity, and `DcpGroup.step`
  launches every rank's on its own stream, then checks them all. The buffers the peers
  write are doubled by the step's parity, because a rank may start step N + 1 while a
  slower one still reads step N.
- torch backend, `GroupTransport`: every rank's step runs eagerly in its own host thread
  and the ranks meet at the two exchanges (a host condition), pushing their rows and
  candidates into the others' buffers with copies; torch has no poll, so the transport
  checks the mailbox as QueryWait would. Pushing, not pulling: a rank's buffers are
  written by the others and read, then re-armed, by their owner alone, so one meeting per
  exchange suffices.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from contextlib import ExitStack

import torch

from . import formats
from . import reference as ref
from .launch import DEFAULT_BUDGET_NS, CandidatesTimeout, MailboxTimeout, check_budget
from .shapes import MAX_DCP, RankShape, check_capture_sizes, check_positive_number
from .state import LayerState, PeerInputs, StepInputs, StepOutputs
from .step import DecodeStep
from .transport import Exchange, PeerCandidates, Transport, ValueCheck

# torch: the rows exchange before the indexer (no poll); cute: QueryWait polls on the side
# stream while the indexer runs (serial and fork_poll would poll inside MlaQuery's grid, whose
# many CTAs could hold the SMs a peer on the same GPU needs to publish)
GROUP_POLICY = {"torch": "serial", "cute": "fork"}
FLAG_WORDS = MAX_DCP  # CandidateSync's flags per parity: one per rank
SPIN_CYCLES_PER_S = 1.98e9  # torch.cuda._sleep's cycles per second at the H200's boost clock (delays)


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


class GroupRank(Transport):
    """What every transport of a DcpGroup rank shares: the other ranks are real, so a step
    takes no `peers` and nothing is staged before it."""

    def check(self, peers: PeerInputs | None, batch: int) -> None:
        if peers is not None:
            raise ValueError("a DcpGroup rank takes no peers: the other ranks are real (DcpGroup.step)")

    def value_checks(self, peers: PeerInputs | None, context_lens: torch.Tensor) -> list[ValueCheck]:
        return []

    def load(self, peers: PeerInputs | None, batch: int, size: int) -> None:
        pass  # the peers write during the step


class GroupTransport(GroupRank):
    """One rank's end of a torch-backend group's exchanges: pushes into the other ranks'
    buffers, then meets them (Rendezvous), then checks the mailbox as QueryWait would (torch
    has no poll) and raises MailboxTimeout. peers: every rank's GroupTransport, by rank
    (filled as the ranks are built).

    positions int32 / scores fp32 [max_batch, dcp, topk]: every rank's candidates as
    DcpMerge reads them, row r written by rank r (this rank's row unused)."""

    def __init__(self, shape: RankShape, mailbox: torch.Tensor, peers: list, rendezvous: Rendezvous):
        self.shape, self.mailbox, self.peers, self.rendezvous = shape, mailbox, peers, rendezvous
        self.rank = shape.topology.rank
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

    def publish_query_rows(self, size: int) -> None:
        pass  # the peers push theirs after their MlaQuery (share_query_rows)

    def share_query_rows(self, size: int) -> None:
        """Push this rank's rows into every peer's mailbox, meet, then raise MailboxTimeout
        for the first chunk of this mailbox that never landed."""
        own = self.own
        for peer in self.others():
            peer.mailbox[:size, own].copy_(self.mailbox[:size, own], non_blocking=True)
        self._meet("rows")
        lost = formats.first_missing(self.mailbox, size, self.shape.gathered)
        if lost is not None:
            raise MailboxTimeout(*lost, heads=self.shape.heads)

    def publish_candidates(self, positions: torch.Tensor, scores: torch.Tensor, size: int) -> PeerCandidates:
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
        return PeerCandidates(self.positions[:size], self.scores[:size])

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


class PeerTransport(GroupRank):
    """One rank's end of a DcpGroup whose kernels exchange through each other's memory.

    Every rank holds one `memory` allocation of the same layout, so one byte offset per rank
    (`mailbox_offsets[s]`: rank s's memory minus this rank's, 0 for this rank) addresses any
    of rank s's buffers from the same buffer of this rank's:

        mailbox    uint8 [2, max_batch, q_heads, 576 x q_bytes]  armed (0xFF)
        positions  int32 [2, max_batch, topk]   this rank's TopK candidates (global positions)
        scores     fp32  [2, max_batch, topk]   and their scores
        flags      int32 [2, 32]                word s: rank s's candidates are complete

    The leading 2 is the step's parity. Who writes and who re-arms (one writer, one
    re-arming reader per word, as for a mailbox chunk):
    - mailbox rows [r x H, (r + 1) x H): rank r's MlaQuery (remote stores); read by the
      owner's QueryWait and sparse core, which re-arms them;
    - positions / scores: the owner's TopK; read in place by every rank's DcpMerge; never
      re-armed (rewritten every step of that parity);
    - flag word r of rank s: rank r's CandidateSync sets it; rank s's re-arms it to 0.
    Why two parities suffice: a rank finishes step N only after every rank published
    step N's rows and candidates, which each did in stream order after finishing step
    N - 1. So ranks are at most one step apart: while a slow rank reads half N % 2, a fast
    one writes half (N + 1) % 2, and it writes half N % 2 again (step N + 2) only after the
    slow one's step N + 1 published, i.e. after its step N read and re-armed everything.

    On several GPUs the offsets point into the peers' memory over P2P (peer access is
    enabled by `connect`); the kernels are the same."""

    parities = 2

    def __init__(self, shape: RankShape, mailbox: torch.Tensor, peers: list):
        rows, q_heads, row_bytes = mailbox.shape
        k, dev = shape.model.index_topk, mailbox.device
        sizes = [2 * rows * q_heads * row_bytes, 2 * rows * k * 4, 2 * rows * k * 4, 2 * FLAG_WORDS * 4]
        self.memory = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
        mailboxes, positions, scores, flags = torch.split(self.memory, sizes)
        self.mailboxes = mailboxes.view(2, rows, q_heads, row_bytes)
        self.positions = positions.view(torch.int32).view(2, rows, k)
        self.scores = scores.view(torch.float32).view(2, rows, k)
        self.flags = flags.view(torch.int32).view(2, FLAG_WORDS)
        self.shape, self.peers, self.rank = shape, peers, shape.topology.rank
        self.parity = 0  # the parity being issued (exchange())
        self.rearm()
        self.positions.fill_(-1)
        self.scores.fill_(float("-inf"))
        peers[self.rank] = self

    def connect(self) -> None:
        """Once every rank's transport exists: the offsets to the peers' memory (peer access
        enabled where a peer is on another GPU). Before any warm-up or capture."""
        if any(peer is None for peer in self.peers):
            raise RuntimeError("PeerTransport.connect: not every rank's transport exists yet")
        dev = self.memory.device
        for peer in self.peers:
            if peer.memory.device != dev:
                enable_peer_access(dev, peer.memory.device)
        offsets = [peer.memory.data_ptr() - self.memory.data_ptr() for peer in self.peers]
        self.mailbox_offsets = torch.tensor(offsets, dtype=torch.int64, device=dev)

    def rearm(self) -> None:
        """Both halves armed: every mailbox chunk the sentinel, every flag 0."""
        formats.arm(self.mailboxes)
        self.flags.zero_()

    def exchange(self, parity: int) -> Exchange:
        """The buffers of `parity`; also selects it for publish_candidates."""
        self.parity = parity
        return Exchange(self.mailboxes[parity], self.positions[parity], self.scores[parity])

    def publish_query_rows(self, size: int) -> None:
        pass  # the peers' MlaQuery stores their rows here

    def share_query_rows(self, size: int) -> None:
        pass  # this rank's MlaQuery stored its rows into every mailbox (mailbox_offsets)

    def publish_candidates(self, positions: torch.Tensor, scores: torch.Tensor, size: int) -> PeerCandidates:
        """Launches nothing itself: the step runs CandidateSync on the flags returned, then
        DcpMerge reads the peers' lists `mailbox_offsets` bytes from this rank's."""
        k = self.shape.model.index_topk
        return PeerCandidates(positions, scores, self.mailbox_offsets, k, self.flags[self.parity])


def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Let `device`'s kernels address `peer`'s memory (P2P); ValueError where the GPUs cannot.
    Not exercised on a single-GPU machine."""
    if not torch.cuda.can_device_access_peer(device.index, peer.index):
        raise ValueError(f"{device} cannot access {peer}'s memory (no P2P between them): a DcpGroup needs it")
    from cuda.bindings import runtime

    with torch.cuda.device(device):
        (status,) = runtime.cudaDeviceEnablePeerAccess(peer.index, 0)
    if status not in (runtime.cudaError_t.cudaSuccess, runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
        raise RuntimeError(f"cudaDeviceEnablePeerAccess({device} -> {peer}): {status}")


class DcpGroup:
    """The dcp ranks of one DCP group in this process, each a DecodeStep on its own shard of
    one unsharded layer (the module docstring: how they exchange).

    Arguments:
        shape: RankShape of a rank (its tp; its dcp is replaced by `dcp`). tp must be a
            multiple of dcp: the unsharded layer has dcp x heads-per-rank heads.
        dcp: int, 2 <= dcp <= 32, the group's size.
        devices: one torch device for every rank, or a list of one per rank (None: "cpu"
            for the torch backend, the current CUDA device for cute). Ranks on different
            GPUs need P2P between them (cute).
        capture_sizes, backend, max_context, seed, budget_ns: as DecodeStep's; the seed
            draws the unsharded layer; budget_ns bounds each rank's waits for the others.
        wait_s: torch backend: how long a rank waits at an exchange for the others.

    Attributes: unsharded (the LayerState every rank's shard comes from, on the first
    device), steps (the ranks' DecodeSteps), transports, steps_run (group steps so far: the
    parity of the next is steps_run % 2), times (seconds of each rank's last step: GPU time
    from its launch to its end for cute, host time for torch; None for an absent rank) and
    group_time (host seconds of the last group step, launch to the last rank's end)."""

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
        if not isinstance(dcp, int) or not 2 <= dcp <= FLAG_WORDS:
            raise ValueError(f"a DCP group needs 2 <= dcp <= {FLAG_WORDS}, got {dcp!r}")
        if backend not in GROUP_POLICY:
            raise ValueError(f"backend {backend!r}: expected one of {tuple(GROUP_POLICY)}")
        check_budget(budget_ns)
        # the host rendezvous's bound (torch backend): without one a missing rank hangs the group
        check_positive_number(wait_s, "wait_s", " of seconds")
        if devices is None:
            devices = "cpu" if backend == "torch" else "cuda"
        devices = list(devices) if isinstance(devices, list | tuple) else [devices] * dcp
        if len(devices) != dcp:
            raise ValueError(f"devices: one for every rank or one per rank ({dcp}), got {len(devices)}")
        self.devices = [self._device(d) for d in devices]
        self.dcp, self.backend = dcp, backend
        unsharded = shape.with_topology(dcp=dcp, rank=0, split=False).unsharded()  # (raises unless dcp divides tp)
        sizes = check_capture_sizes(capture_sizes)
        self.unsharded = LayerState(unsharded, sizes[-1], max_context, seed, self.devices[0])
        self.rendezvous = Rendezvous(dcp, wait_s)
        self.transports: list[Transport | None] = [None] * dcp
        if backend == "cute":
            make_transport = lambda s, mailbox: PeerTransport(s, mailbox, self.transports)
        else:
            make_transport = lambda s, mailbox: GroupTransport(s, mailbox, self.transports, self.rendezvous)
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
                transport=make_transport,
                state=state,
            )
            if device.type == "cuda":
                step.side = torch.cuda.Stream(device)  # a shared side stream would queue a rank behind its peer
            self.steps.append(step)
        for transport in self.transports:
            if isinstance(transport, PeerTransport):
                transport.connect()
        for step in self.steps:
            step.stages.warm(step.sizes)  # a compile inside a step would hold the peers past their wait
        self.streams = [torch.cuda.Stream(d) if d.type == "cuda" else None for d in self.devices]
        self.steps_run = 0
        self.times: list[float | None] = [None] * dcp
        self.group_time: float | None = None
        if backend == "cute":
            self._load_modules()

    def _load_modules(self) -> None:
        """Launch every kernel of every rank once, each rank alone with a zero wait budget,
        then re-arm. CUDA loads a kernel lazily at its first launch, and that load may wait
        for the device to go idle: in a group, behind a peer's kernel spinning for this
        rank's rows, which then gives up (MailboxTimeout) before they come."""
        for rank, step in enumerate(self.steps):
            budget, step.stages.budget_ns = step.stages.budget_ns, 0
            try:
                with self._on(rank):
                    for size, mode in dict.fromkeys((size, mode) for size, mode, _ in step.plan()):
                        step.run_stages(size, mode)
                    torch.cuda.current_stream().synchronize()
            finally:
                step.stages.budget_ns = budget
            step.error.reset()  # the waits gave up, as meant
        for rank in range(self.dcp):
            with self._on(rank):
                torch.cuda._sleep(1)  # step(delays=...)'s spin kernel, loaded too
        self._rearm()

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

    def capture(self) -> None:
        """cute: capture every rank's graphs (each size, both parities). Each graph's stages
        first run once eagerly on every rank together (a rank alone would wait for its peers
        in vain), which also loads the modules and warms the allocator."""
        if self.backend != "cute":
            raise RuntimeError("a DcpGroup captures graphs with the cute backend only (torch runs eagerly)")
        for size, mode, parity in self.steps[0].plan():
            self._issue({rank: (size, mode) for rank in range(self.dcp)}, parity)
            self._raise(self._finish(range(self.dcp)))
        for rank, step in enumerate(self.steps):
            with self._on(rank):
                step.capture(warm_up=False)

    def step(
        self, inputs: StepInputs, absent: Collection[int] = (), eager: bool = False, delays: dict | None = None
    ) -> list[StepOutputs | None]:
        """One decode step of every rank; returns each rank's outputs (views of its buffers,
        valid until the next step; None for an absent rank). inputs: the unsharded layer's
        (self.unsharded.inputs(...)). absent: ranks that do not run (a fault: the others'
        steps then raise MailboxTimeout or CandidatesTimeout naming it). A failed step
        re-arms every rank's exchange buffers before it raises, so the next step starts
        clean. cute only: eager issues the stages instead of replaying the graphs (capture()
        first otherwise); delays: {rank: seconds} of GPU spin before that rank's step."""
        ranks = self.rank_inputs(inputs)
        for step, stream in zip(self.steps, self.streams):  # the ranks' inputs were made on this stream
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(step.device))
        if self.backend == "cute":
            return self._step_kernels(ranks, set(absent), eager, delays or {})
        if delays:
            raise ValueError("delays: cute backend only")
        return self._step_threads(ranks, set(absent))

    def _step_kernels(self, ranks: list[StepInputs], absent: set[int], eager: bool, delays: dict):
        """cute: load every present rank, launch each on its stream (graphs or eager stages,
        of this step's parity), then wait for all and raise the first rank's error."""
        present = [rank for rank in range(self.dcp) if rank not in absent]
        parity = self.steps_run % 2
        sizes = {}
        for rank in present:
            with self._on(rank):
                sizes[rank] = self.steps[rank].load(ranks[rank])
        events = {
            rank: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for rank in present
        }
        started = time.perf_counter()
        for rank in present:
            with self._on(rank):
                if rank in delays:
                    torch.cuda._sleep(int(delays[rank] * SPIN_CYCLES_PER_S))
                events[rank][0].record()
        if eager:
            self._issue({rank: (sizes[rank], self.steps[rank].modes[sizes[rank]]) for rank in present}, parity)
        for rank in present:
            with self._on(rank):
                if not eager:
                    self.steps[rank].replay(sizes[rank], parity=parity)
                events[rank][1].record()
        self.steps_run += 1
        errors = self._finish(present, rearm=bool(absent))
        self.group_time = time.perf_counter() - started
        self.times = [events[r][0].elapsed_time(events[r][1]) / 1e3 if r in events else None for r in range(self.dcp)]
        self._raise(errors)
        return [self.steps[r].outputs(ranks[r].batch) if r in events else None for r in range(self.dcp)]

    def _issue(self, launches: dict[int, tuple[int, str]], parity: int) -> None:
        """Issue the ranks' steps ({rank: (size, mode)}) eagerly, phase by phase
        (DecodeStep.phases): every rank's produce, then every exchange, then every consume.
        Issued rank after rank, a launch waiting for its stream (behind a rank's wait on its
        peers) could sit in a shared hardware queue ahead of a peer's launch that wait needs:
        the likely cause of a group of 4 losing rank 3's rows in its 32K warm-up on the H200."""
        phases = {rank: self.steps[rank].phases(size, mode, parity) for rank, (size, mode) in launches.items()}
        for phase in range(3):
            for rank, issue in phases.items():
                with self._on(rank):
                    issue[phase]()

    def load(self, inputs: StepInputs) -> int:
        """Load the unsharded layer's inputs into every rank's buffers without checking their
        values (benchmarks); returns the captured size they run at."""
        sizes = set()
        for rank, (step, rank_inputs) in enumerate(zip(self.steps, self.rank_inputs(inputs))):
            with self._on(rank):
                sizes.add(step.load(rank_inputs, check_values=False))
        self._sync()
        return sizes.pop()

    def replay(self, size: int, gate_s: float = 0.0) -> tuple[torch.cuda.Event, torch.cuda.Event, list]:
        """Replay every rank's graph of `size` on the buffers as they are (benchmarks), each on
        its stream, without waiting or checking. Returns CUDA events: the group's start and
        end (on the current stream: after the last rank's end) and each rank's (start, end).
        gate_s: a GPU spin of that long before the start, so that every rank's graph is
        launched before any begins (one host thread launches them one after the other)."""
        parity = self.steps_run % 2
        self.steps_run += 1
        main = torch.cuda.current_stream(self.devices[0])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if gate_s:
            torch.cuda._sleep(int(gate_s * SPIN_CYCLES_PER_S))
        start.record(main)
        ranks = []
        for rank, step in enumerate(self.steps):
            with self._on(rank):
                torch.cuda.current_stream().wait_event(start)
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
                step.replay(size, parity=parity)
                events[1].record()
                ranks.append(events)
        for _, rank_end in ranks:
            main.wait_event(rank_end)
        end.record(main)
        return start, end, ranks

    def _sync(self) -> None:
        for device in dict.fromkeys(self.devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def check(self) -> None:
        """Wait for every rank and raise what their error words hold (after replays, which
        check nothing): the first rank's own error, else its timeout; every rank's in
        `.group_errors`."""
        self._raise(self._finish(range(self.dcp)))

    @staticmethod
    def _raise(errors: list[Exception]) -> None:
        if errors:
            errors[0].group_errors = errors  # every rank's, for the post-mortem
            raise errors[0]

    def _finish(self, ranks, rearm: bool = False) -> list[Exception]:
        """Wait for these ranks' steps and collect what their error words hold (own errors
        first: the others' timeouts are their consequence); after a failure or with `rearm`,
        re-arm every rank's exchange buffers."""
        errors = []
        for rank in ranks:
            try:
                self.steps[rank].check()
            except (MailboxTimeout, CandidatesTimeout, ValueError) as error:
                errors.append(error)
        errors.sort(key=lambda error: isinstance(error, MailboxTimeout | CandidatesTimeout))
        if errors or rearm:
            self._rearm()
        return errors

    def _step_threads(self, ranks: list[StepInputs], absent: set[int]) -> list[StepOutputs | None]:
        """torch: every present rank's step eagerly in its own thread, meeting at the exchanges."""
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
        self.steps_run += 1
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
        """Every rank's exchange buffers armed again (a failed step left rows and flags that
        no owner read and re-armed), after every rank's work is done."""
        self._sync()
        for step in self.steps:
            if isinstance(step.transport, PeerTransport):
                step.transport.rearm()
            else:
                formats.arm(step.caches.mailbox)
        self._sync()

    def combine(self, outputs: list[StepOutputs]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranks' attention combined (reference.combine_ranks) on the first device: out
        fp32 [B, gathered, 512] and lse [B, gathered] of the unsharded layer."""
        dev = self.devices[0]
        return ref.combine_ranks([o.out.to(dev) for o in outputs], [o.lse.to(dev) for o in outputs])
