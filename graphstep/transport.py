"""How one rank's step meets the other ranks of its DCP group: the transport.

Under decode context parallelism (DCP) the ranks exchange two things per step:

- query rows: every rank attends every rank's heads over its own cache shard, so rank r's
  MlaQuery rows must land in every rank's mailbox at head rows [r x H, (r + 1) x H) of each
  token (H = heads per rank). The mailbox is armed (all 0xFF) before a step; QueryWait, or
  MlaQuery polling, waits until no 32-bit word of a chunk is the sentinel.
- top-k candidates: each rank's TopK picks its best index_topk local positions (as global
  positions and their scores); DcpMerge merges every rank's into the global top-k and
  keeps this rank's share as cache slots.

A `Transport` is this rank's end of both exchanges. `DecodeStep` calls it at fixed points
of its data path (see each method), with the same calls in eager runs and graph captures,
so whatever a transport launches is captured into the step's graphs. `SimulatedPeers`
plays the other ranks on this rank's GPU from inputs loaded before the step; `SingleRank`
is the transport of a step without DCP; in a `DcpGroup` (graphstep.dcp_group),
`PeerTransport` lets the kernels exchange through the ranks' memory (cute) and
`GroupTransport` copies between host threads that meet (torch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import formats
from .shapes import RankShape
from .state import PeerInputs, check_tensors

ValueCheck = tuple[torch.Tensor, Callable[[int], None]]  # (flags [batch] bool, raise for a flagged row)


@dataclass
class PeerCandidates:
    """Every rank's TopK candidates of a step as DcpMerge reads them (what
    Transport.publish_candidates returns).

    positions int32 / scores fp32: stacked [size, dcp, topk] (row r rank r's; offsets None),
    or, in a group exchanging through peer memory, this rank's own lists [>= size, topk]
    with rank r's `offsets[r]` bytes away and `token_stride` elements per token.
    flags: int32 [>= dcp], the ready flags CandidateSync sets in the peers and waits on
    here before DcpMerge (None: the candidates are in place already)."""

    positions: torch.Tensor
    scores: torch.Tensor
    offsets: torch.Tensor | None = None
    token_stride: int | None = None
    flags: torch.Tensor | None = None


@dataclass
class Exchange:
    """The buffers a transport's peers write into, for one step parity: they replace the
    step's mailbox and own-candidate buffers while the step of that parity is issued."""

    mailbox: torch.Tensor  # uint8 [max_batch, q_heads, 576 x q_bytes], armed
    positions: torch.Tensor  # int32 [max_batch, topk]: this rank's TopK candidates
    scores: torch.Tensor  # fp32 [max_batch, topk]


class Transport(ABC):
    """This rank's end of the DCP exchanges. The host-side methods run in DecodeStep.load()
    and step(); the others are called while the step's stages are issued (eager or under
    graph capture) on the stream named in each docstring, and must not synchronize.

    parities: how many copies of its exchange buffers the transport alternates between
    (2: a DCP group whose ranks may be one step apart; the step captures a graph per size
    and parity). mailbox_offsets: int64 [dcp] or None; given, MlaQuery stores this rank's
    rows into every rank's mailbox itself (rank s's mailbox_offsets[s] bytes away)."""

    parities = 1
    mailbox_offsets: torch.Tensor | None = None

    def exchange(self, parity: int) -> Exchange | None:
        """The buffers of this parity the step must use instead of its own (None: its own)."""
        return None

    # -- host side: what step() was given for the other ranks --------------------------------

    @abstractmethod
    def check(self, peers: PeerInputs | None, batch: int) -> None:
        """Check the `peers` argument of step() / load() for a batch of `batch` tokens:
        types, shapes, dtypes and devices (no device read). Raise TypeError / ValueError."""

    @abstractmethod
    def value_checks(self, peers: PeerInputs | None, context_lens: torch.Tensor) -> list[ValueCheck]:
        """Checks of `peers`' values for step(check_values=True): per check, bool flags
        [batch] computed on the device (True: the row is bad) and a function that raises the
        error of a flagged row. The step reads every flag with its own in one device-to-host
        copy. context_lens: int32 [batch], the inputs' lengths clamped to [1, max_context] (a
        row whose length is out of range is refused before any of these checks' errors).
        Called only with peers (a step without them has no transport checks)."""

    @abstractmethod
    def load(self, peers: PeerInputs | None, batch: int, size: int) -> None:
        """Stage what the other ranks contribute to the next step of `batch` real tokens,
        padded to the captured `size` (host side, after check(); copies on the current stream)."""

    # -- in the step ---------------------------------------------------------------------------

    @abstractmethod
    def publish_query_rows(self, size: int) -> None:
        """The other ranks' query rows of this step land in this rank's mailbox (uint8
        [tokens, q_heads, 576 x q_bytes], rows [r x H, (r + 1) x H) of rank r != this rank),
        in whole 16-byte chunks (this rank's own rows are its MlaQuery's). Called first in the
        step (the mailbox is armed at that point): on the side stream once it forks (fork
        modes: whatever it launches runs beside this rank's main chain, as the peers' remote
        stores would, and before this rank's MlaQuery), on the main stream in serial. The rows
        need not have landed when it returns: the step's readers (QueryWait, MlaQuery's poll)
        wait on the chunks themselves."""

    @abstractmethod
    def share_query_rows(self, size: int) -> None:
        """This rank's query rows, just written into its own mailbox by its MlaQuery, go to
        the other ranks. Called right after MlaQuery, on its stream, before QueryWait. Nothing
        to do when MlaQuery stores into the peers itself (remote stores), without DCP, or when
        the peers are simulated; a transport that copies the rows instead
        (dcp_group.GroupTransport) does it here."""

    @abstractmethod
    def publish_candidates(self, positions: torch.Tensor, scores: torch.Tensor, size: int) -> PeerCandidates:
        """Hand this rank's TopK candidates (global positions int32, scores fp32 [>= size,
        topk], ascending position, -1 / -inf padded) to the other ranks and return every
        rank's as DcpMerge reads them (PeerCandidates; this rank's row is not read). Called
        under DCP only, on the main stream, after TopK and before DcpMerge; the tensors
        returned must stay where they are across replays."""

    def arm(self, size: int) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Re-arm what this transport's exchanges need for the next step, besides the query
        rows: those the sparse core re-arms itself, as their last reader (in its kernel: no
        copy or fill launch ends the step). Called last in the step, on the main stream.
        Nothing by default: SingleRank and SimulatedPeers have nothing else to re-arm; a
        transport whose exchange buffers need a re-arm no kernel does overrides it (PeerTransport
        needs none: CandidateSync re-arms its flags)."""


class SingleRank(Transport):
    """A step without DCP: nothing to exchange. Its query rows still pass through the
    mailbox buffer (re-armed by the sparse core), so the step's launches are the same with
    or without DCP."""

    def __init__(self, shape: RankShape, mailbox: torch.Tensor):
        self.shape, self.mailbox = shape, mailbox

    def check(self, peers: PeerInputs | None, batch: int) -> None:
        if peers is not None:
            name = self.shape.topology.name
            raise ValueError(f"peers are only for a DCP step; this step's topology is {name} (dcp 1)")

    def value_checks(self, peers: PeerInputs | None, context_lens: torch.Tensor) -> list[ValueCheck]:
        return []

    def load(self, peers: PeerInputs | None, batch: int, size: int) -> None:
        pass  # no other ranks

    def publish_query_rows(self, size: int) -> None:
        pass  # every row is this rank's own, written by its MlaQuery

    def share_query_rows(self, size: int) -> None:
        pass  # no other rank

    def publish_candidates(self, positions: torch.Tensor, scores: torch.Tensor, size: int) -> PeerCandidates:
        raise RuntimeError("a step without DCP exchanges no candidates: its TopK writes the slots")


class SimulatedPeers(Transport):
    """The other DCP ranks played on this rank's GPU: what they contribute to a step is
    given to step() as PeerInputs (their query rows in fp32, their candidates), staged by
    load() into buffers of the largest captured size, and put in place inside the step.

    rows: uint8 [max_batch, gathered, 576 x q_bytes], the peers' query rows encoded like
    the mailbox (this rank's rows unused); positions int32 / scores fp32 [max_batch, dcp,
    topk], every rank's candidates (this rank's row unused). Pad rows of a padded batch
    count as published (zeros) and offer no candidate (-1 / -inf)."""

    def __init__(self, shape: RankShape, mailbox: torch.Tensor):
        self.shape, self.mailbox = shape, mailbox
        rows, dev, topo, k = mailbox.shape[0], mailbox.device, shape.topology, shape.model.index_topk
        self.rows = torch.zeros(rows, shape.gathered, mailbox.shape[-1], dtype=torch.uint8, device=dev)
        self.positions = torch.full((rows, topo.dcp, k), -1, dtype=torch.int32, device=dev)
        self.scores = torch.full((rows, topo.dcp, k), float("-inf"), device=dev)

    @property
    def own(self) -> slice:
        """This rank's head rows of each token in the mailbox."""
        rank, heads = self.shape.topology.rank, self.shape.heads
        return slice(rank * heads, (rank + 1) * heads)

    def check(self, peers: PeerInputs | None, batch: int) -> None:
        if peers is None:
            raise ValueError("a DCP step needs peers=PeerInputs (what the other ranks contribute)")
        if not isinstance(peers, PeerInputs):
            raise TypeError(f"peers must be PeerInputs, got {type(peers).__name__}")
        s, dcp, k = self.shape, self.shape.topology.dcp, self.shape.model.index_topk
        check_tensors(
            "peers",
            {
                "rows": (peers.rows, torch.float32, (batch, s.gathered, s.model.query_row)),
                "positions": (peers.positions, torch.int32, (batch, dcp, k)),
                "scores": (peers.scores, torch.float32, (batch, dcp, k)),
            },
            self.mailbox.device,
            contiguous=False,
        )

    def value_checks(self, peers: PeerInputs | None, context_lens: torch.Tensor) -> list[ValueCheck]:
        bad = self._bad_positions(peers, context_lens)
        return [(bad.any(1), lambda row: self._raise_bad_position(peers, bad, row, context_lens))]

    def _bad_positions(self, peers: PeerInputs, lens: torch.Tensor) -> torch.Tensor:
        """[B, dcp x topk] True where another rank's candidate position is neither -1 nor a
        position of its own rank below the token's context length (this rank's are ignored)."""
        topo = self.shape.topology
        positions = peers.positions.long()
        ranks = torch.arange(topo.dcp, device=positions.device)[None, :, None]
        ok = (positions == -1) | (
            (positions >= 0) & (positions < lens[:, None, None]) & (positions % topo.dcp == ranks)
        )
        return (~ok & (ranks != topo.rank)).flatten(1)

    def _raise_bad_position(self, peers: PeerInputs, bad: torch.Tensor, row: int, lens: torch.Tensor) -> None:
        dcp, k = self.shape.topology.dcp, self.shape.model.index_topk
        rank, i = divmod(int(bad[row].nonzero()[0, 0]), k)
        raise ValueError(
            f"peers.positions[{row}, {rank}, {i}] = {int(peers.positions[row, rank, i])}: rank {rank}'s "
            f"candidates must be -1 or positions p < {int(lens[row])} (the context length) with "
            f"p % {dcp} == {rank}"
        )

    def load(self, peers: PeerInputs | None, batch: int, size: int) -> None:
        encoded = formats.encode_q_rows(peers.rows, self.shape.topology.q_format)
        self.rows[:batch] = encoded.view(batch, self.shape.gathered, -1)
        self.positions[:batch] = peers.positions
        self.scores[:batch] = peers.scores
        if size > batch:  # the padded rows (as DecodeStep.load: host dispatches saved at a captured size)
            self.rows[batch:size] = 0  # pad rows count as published
            self.positions[batch:size] = -1
            self.scores[batch:size] = float("-inf")

    def publish_query_rows(self, size: int) -> None:
        """Two copies from the staged rows (remote stores by the peers' MlaQuery on real DCP;
        in a fork mode on the side stream, off this rank's main chain: session 40's trace had
        them ahead of it, 1.1 us at B = 1 and 3.6 at B = 4 on an H100)."""
        own, gathered = self.own, self.shape.gathered
        self.mailbox[:size, : own.start] = self.rows[:size, : own.start]
        self.mailbox[:size, own.stop : gathered] = self.rows[:size, own.stop :]

    def share_query_rows(self, size: int) -> None:
        pass  # the simulated peers need nothing of this rank's

    def publish_candidates(self, positions: torch.Tensor, scores: torch.Tensor, size: int) -> PeerCandidates:
        """Launches nothing: the peers' candidates were staged by load(), and DcpMerge reads
        this rank's own from `positions` / `scores` directly."""
        return PeerCandidates(self.positions[:size], self.scores[:size])
