"""The stages of a step over its static buffers, one class per backend.

DecodeStep.run_stages issues the data path (which stage, in what order, on which stream);
a backend (`Stages`) says how each stage runs. Every stage reads and writes the rows
[0, size) of the step's `Buffers` and the state's caches, on the current stream, without
synchronizing, so a graph captured around the calls holds the whole step. `CuteStages`
launches the CuTe DSL kernels (graphstep.launch); `TorchStages` runs graph-capturable torch
(graphstep.torch_stages, the plain-torch baseline). A new backend is one more subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import formats, torch_stages
from . import reference as ref
from .launch import ErrorWord, Kernels
from .state import LayerState, StepInputs
from .transport import PeerCandidates, Transport


@dataclass
class Buffers:
    """Static buffers sized for the largest captured batch; graphs slice them."""

    qkv: torch.Tensor  # bf16 [B, packed width] the inputs, padded
    context_lens: torch.Tensor  # int32 [B]
    slot_mapping: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, pages per sequence]
    qc: torch.Tensor  # the indexer's q_c bf16 [B, 1536]
    qc_private: torch.Tensor  # MlaQuery's own q_c when it runs off the main stream
    workspace: torch.Tensor  # MlaQuery's raw q [B, heads, 192] fp32
    index_q: torch.Tensor  # the indexer's e4m3 queries [B, 64, 128] (uint8)
    index_w: torch.Tensor  # its folded head weights [B, 64] fp32
    scores: torch.Tensor  # DsaIndex's scores [B, local positions a block table holds] fp32
    own_positions: torch.Tensor  # DCP: this rank's top-k candidates, global positions [B, topk]
    own_scores: torch.Tensor  # and their scores
    slots: torch.Tensor  # the indexer's selection [B, topk]
    q_out: torch.Tensor  # the query rows the sparse core read (it re-arms them in the mailbox)
    out: torch.Tensor  # sparse core [B, gathered, 512] fp32
    lse: torch.Tensor  # [B, gathered] fp32

    @classmethod
    def allocate(cls, state: LayerState) -> Buffers:
        """Buffers for the state's max_batch rows: padding values in the inputs (slot -1,
        context 1, block tables of the spare page), zeros or empty selections elsewhere."""
        s, rows, dev = state.shape, state.max_batch, state.device
        m, k = s.model, s.model.index_topk
        return cls(
            qkv=torch.zeros(rows, m.packed_width, dtype=torch.bfloat16, device=dev),
            context_lens=torch.ones(rows, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int32, device=dev),
            block_tables=torch.full((rows, state.pages_per_seq), state.trash_page, dtype=torch.int32, device=dev),
            qc=torch.zeros(rows, m.q_lora_rank, dtype=torch.bfloat16, device=dev),
            qc_private=torch.zeros(rows, m.q_lora_rank, dtype=torch.bfloat16, device=dev),
            workspace=torch.zeros(rows, s.heads, m.qk_head_dim, device=dev),
            index_q=torch.zeros(rows, m.index_heads, m.index_dim, dtype=torch.uint8, device=dev),
            index_w=torch.zeros(rows, m.index_heads, device=dev),
            scores=torch.zeros(rows, state.pages_per_seq * m.page_size, device=dev),
            own_positions=torch.full((rows, k), -1, dtype=torch.int32, device=dev),
            own_scores=torch.full((rows, k), float("-inf"), device=dev),
            slots=torch.full((rows, k), -1, dtype=torch.int32, device=dev),
            q_out=torch.zeros(rows, s.gathered, m.query_row * s.q_bytes, dtype=torch.uint8, device=dev),
            out=torch.zeros(rows, s.gathered, m.kv_lora_rank, device=dev),
            lse=torch.zeros(rows, s.gathered, device=dev),
        )

    def inputs(self, size: int) -> StepInputs:
        """The input buffers' first `size` rows."""
        return StepInputs(self.qkv[:size], self.context_lens[:size], self.slot_mapping[:size], self.block_tables[:size])

    def pointers(self) -> tuple[int, ...]:
        """Every buffer's address: the graphs hold these, so a replaced buffer is detected."""
        return tuple(t.data_ptr() for t in vars(self).values())


class Stages(ABC):
    """One backend's stages. Each method runs one stage for the rows [0, size) on the
    current stream; what it reads and writes is in its docstring (b = the step's Buffers)."""

    def __init__(self, state: LayerState, buffers: Buffers, error: ErrorWord, budget_ns: int, pdl: bool = True):
        """error: the word the polls report a lost chunk in; budget_ns: how long a poll waits;
        pdl: chain the stages with Programmatic Dependent Launch (backends that launch kernels)."""
        self.state, self.buffers, self.error, self.budget_ns = state, buffers, error, budget_ns
        self.transport: Transport | None = None  # the step's (DecodeStep sets it)

    def polls_query_rows(self, size: int) -> bool:
        """Whether sparse_core(size, poll=True) waits for the mailbox's rows itself, so that
        fork_poll on one rank joins the side stream after the sparse core rather than before."""
        return False

    @abstractmethod
    def warm(self, sizes, modes=("fork",)) -> None:
        """Prepare everything a graph capture of these sizes in these modes cannot (compile,
        load modules); no launches."""

    @abstractmethod
    def guard(self, size: int) -> None:
        """The inputs' ids out of range (b.slot_mapping, b.context_lens, b.block_tables):
        whatever a backend does before any stage uses them (record them in the step's error
        word, make them safe). First in the step, on the main stream before the fork."""

    @abstractmethod
    def index_key(self, size: int) -> None:
        """The new tokens' indexer keys (LayerNorm, RoPE, rotation, e4m3) from b.qkv at b.slot_mapping
        of the indexer cache; slot -1 writes nothing where a block table reads. First on the
        main stream: it needs only the inputs."""

    @abstractmethod
    def key_and_query_norm(self, size: int) -> None:
        """index_key and the q_a RMSNorm (b.qkv -> b.qc, the indexer's q_c): how the fork modes
        open the main stream (neither reads what the other writes, so a backend may run both
        at once)."""

    @abstractmethod
    def index_query(self, size: int) -> None:
        """wq_b, RoPE, the Hadamard rotation, e4m3 and the folded head weights: b.qc, b.qkv ->
        b.index_q, b.index_w."""

    @abstractmethod
    def index_scores(self, size: int) -> None:
        """DsaIndex: b.index_q, b.index_w and the indexer cache through b.block_tables ->
        b.scores, every local position a block table holds (-inf past the length)."""

    @abstractmethod
    def top_k(self, size: int) -> None:
        """The index_topk best of b.scores: cache slots in b.slots, or under DCP this rank's
        candidates in b.own_positions (global positions) and b.own_scores."""

    def candidate_sync(self, peers: PeerCandidates, size: int) -> None:
        """A DCP group exchanging through peer memory: tell the peers this rank's candidates
        are complete and wait for theirs (peers.flags, the transport's offsets)."""
        raise RuntimeError(f"the {type(self).__name__} backend cannot exchange candidates through peer memory")

    @abstractmethod
    def dcp_merge(self, peers: PeerCandidates, size: int) -> None:
        """DCP: b.own_positions / b.own_scores and every rank's candidates (from the
        transport) -> this rank's share of the global top-k as cache slots in b.slots."""

    @abstractmethod
    def mla_query(self, size: int, store_qc: bool, poll: bool) -> None:
        """MlaQuery: q_a RMSNorm into b.qc (store_qc: it is the indexer's) or b.qc_private,
        Q_B, W_UK absorption, RoPE; this rank's query rows into the mailbox; the new tokens'
        MLA cache rows at b.slot_mapping. poll: then wait until every rank's rows landed."""

    @abstractmethod
    def query_wait(self, size: int) -> None:
        """Wait until every rank's query rows of the step landed in the mailbox (DCP),
        recording a chunk that never did in the step's error word."""

    @abstractmethod
    def sparse_core(self, size: int, poll: bool = False) -> None:
        """Sparse MLA attention of the mailbox's query rows over the MLA cache rows at
        b.slots -> b.out, b.lse. As the rows' last reader it also copies them to b.q_out
        (the step's returned query rows) and re-arms them in the mailbox for the next step.
        poll (where polls_query_rows(size)): first wait until the rows are published,
        recording a chunk that never was in the step's error word."""


class CuteStages(Stages):
    """Every stage a CuTe DSL kernel, chained with Programmatic Dependent Launch."""

    def __init__(self, state: LayerState, buffers: Buffers, error: ErrorWord, budget_ns: int, pdl: bool = True):
        super().__init__(state, buffers, error, budget_ns, pdl)
        self.kernels = Kernels(state.shape, state.weights, pdl)
        # SparseCore's split partials, for launches of up to max_batch tokens
        self.partial_o, self.partial_ml = self.kernels.sparse_core_buffers(buffers.qkv.shape[0], state.device)

    def warm(self, sizes, modes=("fork",)) -> None:
        shape = self.state.shape
        group = self.transport is not None and self.transport.mailbox_offsets is not None
        # the polling variants: MlaQuery's under DCP (fork_poll and serial); SparseCore's on one
        # rank in fork_poll only. A group runs fork only (dcp_group.GROUP_POLICY).
        dcp = shape.topology.dcp > 1
        polls = (False,) if group or not (dcp or "fork_poll" in modes) else (False, True)
        self.kernels.warm(sizes, self.state.pages_per_seq * shape.model.page_size, polls, group, self.state.device)
        if shape.topology.dcp > 1:
            self.kernels.stacked_offsets(self.state.device)  # DcpMerge's, made before any capture

    def guard(self, size: int) -> None:
        pass  # each kernel guards its own reads and writes and records (kernels/guards.py)

    def index_key(self, size: int) -> None:
        b = self.buffers
        self.kernels.index_key(b.qkv, b.context_lens, b.slot_mapping, self.state.caches.index_cache, size, self.error)

    def key_and_query_norm(self, size: int) -> None:
        b = self.buffers  # one launch (kernels/key_and_norm.py): IndexQuery's weight loads start a kernel earlier
        cache = self.state.caches.index_cache
        self.kernels.key_and_query_norm(b.qkv, b.qc, b.context_lens, b.slot_mapping, cache, size, self.error)

    def index_query(self, size: int) -> None:
        b = self.buffers
        self.kernels.index_query(b.qc, b.qkv, b.context_lens, b.index_q, b.index_w, size, self.error)

    def index_scores(self, size: int) -> None:
        b = self.buffers
        cache = self.state.caches.index_cache
        self.kernels.dsa_index(
            b.index_q, b.index_w, cache, b.block_tables, b.context_lens, b.scores, size, error=self.error
        )

    def top_k(self, size: int) -> None:
        b = self.buffers
        out = b.slots if self.state.shape.topology.dcp == 1 else b.own_positions
        pages = self.state.caches.index_cache.shape[0]
        self.kernels.top_k(
            b.scores, b.block_tables, b.context_lens, out, b.own_scores, size, error=self.error, pool_pages=pages
        )

    def candidate_sync(self, peers: PeerCandidates, size: int) -> None:
        self.kernels.candidate_sync(peers.flags, peers.offsets, self.error, self.budget_ns)

    def dcp_merge(self, peers: PeerCandidates, size: int) -> None:
        b = self.buffers
        pages = self.state.caches.index_cache.shape[0]
        self.kernels.dcp_merge(
            b.own_positions,
            b.own_scores,
            peers.positions,
            peers.scores,
            b.block_tables,
            b.slots,
            size,
            self.error,
            pages,
            peers.offsets,
            peers.token_stride,
        )

    def mla_query(self, size: int, store_qc: bool, poll: bool) -> None:
        b, caches = self.buffers, self.state.caches
        self.kernels.mla_query(
            b.qkv,
            b.context_lens,
            b.slot_mapping,
            b.qc,
            b.qc_private,
            b.workspace,
            caches.mailbox,
            caches.mla_cache,
            self.error,
            size,
            store_qc,
            poll,
            self.budget_ns,
            self.transport.mailbox_offsets if self.transport is not None else None,
        )

    def query_wait(self, size: int) -> None:
        self.kernels.query_wait(self.state.caches.mailbox, self.error, size, self.budget_ns)

    def polls_query_rows(self, size: int) -> bool:
        # where the partial launch leaves SMs of this device to MlaQuery (sparse_core.may_poll)
        return self.kernels.sparse_core_polls(size, device=self.state.device)

    def sparse_core(self, size: int, poll: bool = False) -> None:
        b, caches = self.buffers, self.state.caches
        self.kernels.sparse_core(
            caches.mailbox,
            b.slots,
            caches.mla_cache,
            self.partial_o,
            self.partial_ml,
            b.out,
            b.lse,
            size,
            q_out=b.q_out,
            error=self.error,
            poll_budget_ns=self.budget_ns if poll else None,
        )  # (the kernel publishes: no copy or fill launch after it)


class TorchStages(Stages):
    """Every stage in graph-capturable torch: cuBLAS bf16 GEMMs for the projections, an fp32
    bmm over the dequantized indexer cache, torch.topk. Pad rows' cache writes go to the
    state's spare page."""

    def _inputs(self, size: int) -> StepInputs:
        return self.buffers.inputs(size)

    def warm(self, sizes, modes=("fork",)) -> None:
        pass  # nothing to compile: capture's warm-up pass creates the cuBLAS handles

    def guard(self, size: int) -> None:
        """Record as the kernels would and make the ids safe in the buffers, in place
        (torch_stages.guard_inputs): every torch stage after it stays in bounds."""
        torch_stages.guard_inputs(self.state, self._inputs(size), self.error.record)

    def index_key(self, size: int) -> None:
        torch_stages.index_key_insert(self.state, self._inputs(size), self.state.caches)

    def key_and_query_norm(self, size: int) -> None:
        inputs = self._inputs(size)
        torch_stages.index_key_insert(self.state, inputs, self.state.caches)
        self.buffers.qc[:size] = ref.query_norm(self.state, inputs)

    def index_query(self, size: int) -> None:
        b = self.buffers
        projected = F.linear(b.qc[:size], self.state.weights.wq_b_index)
        b.index_q[:size], b.index_w[:size] = ref.index_query_from(self.state, self._inputs(size), projected)

    def index_scores(self, size: int) -> None:
        b = self.buffers
        torch_stages.index_scores(
            self.state, self.state.caches, self._inputs(size), b.index_q[:size], b.index_w[:size], out=b.scores[:size]
        )

    def top_k(self, size: int) -> None:
        b, s = self.buffers, self.state.shape
        scores = b.scores[:size]
        local = torch_stages.topk_indices(scores, s.model.index_topk)
        if s.topology.dcp == 1:
            b.slots[:size] = ref.to_slots(local, b.block_tables[:size], s.model.page_size)
            return
        own = ref.candidates_at(scores, local, s.topology.dcp, s.topology.rank)
        b.own_positions[:size], b.own_scores[:size] = own.positions, own.scores

    def dcp_merge(self, peers: PeerCandidates, size: int) -> None:
        if peers.offsets is not None:
            raise RuntimeError("the torch backend reads stacked candidates [size, dcp, topk] only")
        b = self.buffers
        own = ref.Candidates(b.own_positions[:size], b.own_scores[:size])
        b.slots[:size] = ref.merge_ranks(self.state, own, peers.positions, peers.scores, b.block_tables[:size])

    def mla_query(self, size: int, store_qc: bool, poll: bool) -> None:
        """poll is moot: torch cannot wait on a chunk, and the transport's rows are in place
        before MlaQuery runs (on one GPU)."""
        b, inputs = self.buffers, self._inputs(size)
        qc = (b.qc if store_qc else b.qc_private)[:size]
        qc[:] = ref.query_norm(self.state, inputs)
        torch_stages.mla_query(self.state, inputs, self.state.caches, qc)

    def query_wait(self, size: int) -> None:
        pass  # torch has no way to poll: the transport's rows are in place before MlaQuery runs

    def sparse_core(self, size: int, poll: bool = False) -> None:
        """poll is never asked (polls_query_rows is False): the step joins before this."""
        if poll:
            raise RuntimeError("the torch backend cannot poll the mailbox: join the side stream before its sparse core")
        b, mailbox, gathered = self.buffers, self.state.caches.mailbox, self.state.shape.gathered
        torch_stages.sparse_core(self.state, self.state.caches, b.slots[:size], size, b.out[:size], b.lse[:size])
        b.q_out[:size] = mailbox[:size, :gathered]
        formats.arm(mailbox[:size, :gathered])
