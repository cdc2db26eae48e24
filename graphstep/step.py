"""DecodeStep: the query stage of one DSA layer, captured per batch size as a CUDA graph.

    step = DecodeStep(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), capture_sizes=[1, 4, 16, 64])
    step.capture()
    out = step.step(step.state.inputs(3))     # pads 3 -> 4, replays, returns the 3 real rows

Per captured size the policy (graphstep.policy.overlap_for) picks the mode:
  serial     main: MlaQuery(store_qc, poll under DCP) -> indexer -> sparse core
  fork       main: QueryNorm -> indexer ------------------------> join -> sparse core
             side:          MlaQuery -> QueryWait (DCP) ------/
  fork_poll  fork, MlaQuery polling the mailbox itself, no QueryWait.
Backends: "cute" runs every stage as CuTe DSL kernels chained with PDL: QueryNorm,
MlaQuery, QueryWait, the indexer's key insert (IndexKey), wq_b (IndexQuery), scoring
(DsaIndex), top-k (TopK), DCP merge (DcpMerge) and the sparse core (SparseCore). "torch"
runs every stage in torch (graphstep.torch_stages; the plain-torch baseline). "torch" runs every
stage in torch (the plain-torch baseline).

Padding: a batch pads up to the next captured size; pad rows have slot -1 (their cache
writes go to the state's spare page) and context length 1. A batch above the largest
captured size is an error. The mailbox (DCP) is re-armed by the step itself, after the
sparse core, the last reader of the query rows; a poll that gives up raises
MailboxTimeout from step().
"""

from __future__ import annotations

import gc
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from . import formats, torch_stages
from . import reference as ref
from .launch import DEFAULT_BUDGET_NS, ErrorWord, Kernels
from .policy import MODES, overlap_for, side_stream
from .shapes import RankShape, check_batch
from .state import LayerCaches, LayerState, PeerInputs, StepInputs, local_lens

BACKENDS = ("cute", "torch")
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)  # vLLM's: 1, 2, 4, then steps of 8


@dataclass
class Buffers:
    """Static buffers sized for the largest captured batch; graphs slice them."""

    qkv: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    qc: torch.Tensor  # the indexer's q_c
    qc_private: torch.Tensor  # MlaQuery's own q_c when it runs off the main stream
    workspace: torch.Tensor  # MlaQuery's raw q [B, heads, 192] fp32
    index_q: torch.Tensor  # the indexer's e4m3 queries [B, 64, 128] (uint8)
    index_w: torch.Tensor  # its folded head weights [B, 64] fp32
    scores: torch.Tensor  # DsaIndex's scores [B, local positions a block table holds] fp32
    own_positions: torch.Tensor  # DCP: this rank's top-k candidates, global positions [B, topk]
    own_scores: torch.Tensor  # and their scores
    slots: torch.Tensor  # the indexer's selection [B, topk]
    partial_o: torch.Tensor  # SparseCore's split partials (cute backend; empty for torch)
    partial_ml: torch.Tensor
    q_out: torch.Tensor  # the query rows the sparse core read (the mailbox is re-armed after)
    out: torch.Tensor  # sparse core [B, gathered, 512] fp32
    lse: torch.Tensor  # [B, gathered] fp32
    peer_rows: torch.Tensor  # DCP: what the peers publish, encoded like the mailbox
    peer_positions: torch.Tensor
    peer_scores: torch.Tensor

    def pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in vars(self).values())


class DecodeStep:
    def __init__(
        self,
        shape: RankShape,
        capture_sizes=DEFAULT_CAPTURE_SIZES,
        policy: str | None = None,
        backend: str = "cute",
        device="cuda",
        max_context: int = 32768,
        seed: int = 0,
        pdl: bool = True,
        budget_ns: int = DEFAULT_BUDGET_NS,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
        sizes = sorted({check_batch(size, "capture size") for size in capture_sizes})
        if not sizes:
            raise ValueError("capture_sizes must name at least one batch size")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: torch sees no CUDA device here (torch {torch.__version__}); "
                "on the CPU use DecodeStep(..., backend='torch', device='cpu') and step(..., eager=True)"
            )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if backend == "cute" and (self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (9, 0)):
            raise ValueError(f"the cute backend needs an sm_90 CUDA device, got {self.device}")
        topo = shape.topology
        self.shape, self.backend, self.sizes, self.pdl, self.budget_ns = shape, backend, sizes, pdl, budget_ns
        self.policy = policy
        self.modes = {
            size: overlap_for(size, policy, dcp=topo.dcp > 1, wide=topo.wide, split=topo.split) for size in sizes
        }
        self.state = LayerState(shape, max_batch=sizes[-1], max_context=max_context, seed=seed, device=self.device)
        self.kernels = Kernels(shape, self.state.weights, pdl) if backend == "cute" else None
        self.error = ErrorWord.new(self.device)
        self.buffers = self._buffers(sizes[-1])
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._captured_pointers: tuple[int, ...] | None = None
        self.nonfinite_rows: list[int] = []  # rows of the last checked step's qkv with NaN or inf

    def _buffers(self, rows: int) -> Buffers:
        s, dev = self.shape, self.device
        m, k = s.model, s.model.index_topk
        row_bytes = m.query_row * s.q_bytes
        partial_o, partial_ml = (
            self.kernels.sparse_core_buffers(rows, dev)
            if self.kernels is not None
            else (torch.empty(0, device=dev), torch.empty(0, device=dev))
        )
        return Buffers(
            qkv=torch.zeros(rows, m.packed_width, dtype=torch.bfloat16, device=dev),
            context_lens=torch.ones(rows, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int32, device=dev),
            block_tables=torch.full(
                (rows, self.state.pages_per_seq), self.state.trash_page, dtype=torch.int32, device=dev
            ),
            qc=torch.zeros(rows, m.q_lora_rank, dtype=torch.bfloat16, device=dev),
            qc_private=torch.zeros(rows, m.q_lora_rank, dtype=torch.bfloat16, device=dev),
            workspace=torch.zeros(rows, s.heads, m.qk_head_dim, device=dev),
            index_q=torch.zeros(rows, m.index_heads, m.index_dim, dtype=torch.uint8, device=dev),
            index_w=torch.zeros(rows, m.index_heads, device=dev),
            scores=torch.zeros(rows, self.state.pages_per_seq * m.page_size, device=dev),
            own_positions=torch.full((rows, k), -1, dtype=torch.int32, device=dev),
            own_scores=torch.full((rows, k), float("-inf"), device=dev),
            slots=torch.full((rows, k), -1, dtype=torch.int32, device=dev),
            partial_o=partial_o,
            partial_ml=partial_ml,
            q_out=torch.zeros(rows, s.gathered, row_bytes, dtype=torch.uint8, device=dev),
            out=torch.zeros(rows, s.gathered, m.kv_lora_rank, device=dev),
            lse=torch.zeros(rows, s.gathered, device=dev),
            peer_rows=torch.zeros(rows, s.gathered, row_bytes, dtype=torch.uint8, device=dev),
            peer_positions=torch.full((rows, s.topology.dcp, k), -1, dtype=torch.int32, device=dev),
            peer_scores=torch.full((rows, s.topology.dcp, k), float("-inf"), device=dev),
        )

    # -- the stages of one captured size ----------------------------------------------------

    @property
    def caches(self) -> LayerCaches:
        return self.state.caches

    def padded(self, batch: int) -> int:
        """The captured size a batch runs at."""
        check_batch(batch)
        for size in self.sizes:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds the largest captured size {self.sizes[-1]} (captured: {self.sizes})")

    def _views(self, size: int) -> StepInputs:
        b = self.buffers
        return StepInputs(b.qkv[:size], b.context_lens[:size], b.slot_mapping[:size], b.block_tables[:size])

    def run_stages(self, size: int, mode: str) -> None:
        """Launch one step of `size` rows in `mode` on the current stream (what a graph holds)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        s, b, caches = self.shape, self.buffers, self.caches
        dcp = s.topology.dcp > 1
        inputs = self._views(size)
        candidates = (b.peer_positions[:size], b.peer_scores[:size]) if dcp else None
        main = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if dcp:  # the peers' publishes into this rank's mailbox (remote writes on real DCP)
            own = slice(s.topology.rank * s.heads, (s.topology.rank + 1) * s.heads)
            caches.mailbox[:size, : own.start] = b.peer_rows[:size, : own.start]
            caches.mailbox[:size, own.stop : s.gathered] = b.peer_rows[:size, own.stop :]
        if mode == "serial":
            self._index_key_insert(size)
            self._mla_query(inputs, size, store_qc=True, poll=dcp)
            self._indexer(inputs, size, candidates)
        else:
            side = side_stream(self.device.index) if main is not None else None
            if side is not None:
                side.wait_stream(main)
            self._index_key_insert(size)
            self._query_norm(inputs, size)
            self._indexer(inputs, size, candidates)
            with torch.cuda.stream(side) if side is not None else nullcontext():
                self._mla_query(inputs, size, store_qc=False, poll=dcp and mode == "fork_poll")
                if dcp and mode == "fork":
                    self._query_wait(size)
            if side is not None:
                main.wait_stream(side)
        self._sparse_core(size)  # the mailbox's last reader: it copies the rows to q_out and re-arms them

    def _index_key_insert(self, size: int) -> None:
        """The new tokens' indexer keys. It needs only the inputs, so it opens the main
        stream's PDL chain: IndexKey -> QueryNorm -> IndexQuery -> DsaIndex -> TopK (the
        torch backend inserts its keys inside torch_stages.indexer)."""
        if self.kernels is not None:
            b = self.buffers
            self.kernels.index_key(b.qkv, b.context_lens, b.slot_mapping, self.caches.index_cache, size)

    def _indexer(self, inputs: StepInputs, size: int, candidates) -> None:
        """wq_b, scoring and top-k of the main stream -> buffers.slots."""
        b, caches, topo = self.buffers, self.caches, self.shape.topology
        if self.kernels is None:  # torch does its own key insert
            b.slots[:size] = torch_stages.indexer(self.state, caches, inputs, b.qc[:size], candidates)
            return
        k = self.kernels
        k.index_query(b.qc, b.qkv, b.context_lens, b.index_q, b.index_w, size)
        k.dsa_index(b.index_q, b.index_w, caches.index_cache, b.block_tables, b.context_lens, b.scores, size)
        if topo.dcp == 1:
            k.top_k(b.scores, b.block_tables, b.context_lens, b.slots, b.own_scores, size)
        else:
            k.top_k(b.scores, b.block_tables, b.context_lens, b.own_positions, b.own_scores, size)
            k.dcp_merge(b.own_positions, b.own_scores, b.peer_positions, b.peer_scores, b.block_tables, b.slots, size)

    def _sparse_core(self, size: int) -> None:
        b, caches = self.buffers, self.caches
        if self.kernels is not None:
            self.kernels.sparse_core(
                caches.mailbox, b.slots, caches.mla_cache, b.partial_o, b.partial_ml, b.out, b.lse, size, q_out=b.q_out
            )
        else:
            torch_stages.sparse_core(self.state, caches, b.slots[:size], size, b.out[:size], b.lse[:size])
            b.q_out[:size] = caches.mailbox[:size, : self.shape.gathered]
            formats.arm(caches.mailbox[:size, : self.shape.gathered])

    def _query_norm(self, inputs: StepInputs, size: int) -> None:
        if self.kernels is not None:
            self.kernels.query_norm(self.buffers.qkv, self.buffers.qc, size)
        else:
            self.buffers.qc[:size] = ref.query_norm(self.state, inputs)

    def _mla_query(self, inputs: StepInputs, size: int, store_qc: bool, poll: bool) -> None:
        b = self.buffers
        if self.kernels is not None:
            self.kernels.mla_query(
                b.qkv,
                b.context_lens,
                b.slot_mapping,
                b.qc,
                b.qc_private,
                b.workspace,
                self.caches.mailbox,
                self.caches.mla_cache,
                self.error,
                size,
                store_qc,
                poll,
                self.budget_ns,
            )
        else:
            qc = b.qc if store_qc else b.qc_private
            qc[:size] = ref.query_norm(self.state, inputs)
            torch_stages.mla_query(self.state, inputs, self.caches, qc[:size])

    def _query_wait(self, size: int) -> None:
        if self.kernels is not None:
            self.kernels.query_wait(self.caches.mailbox, self.error, size, self.budget_ns)
        # torch has no way to poll: its peers' rows are in place before MlaQuery runs.

    # -- capture and replay ------------------------------------------------------------------

    def capture(self, modes: tuple[str, ...] | None = None, keep_graph: bool = False) -> None:
        """Compile and warm every kernel, then capture one graph per size (and per extra mode
        in `modes`), largest first, into one memory pool, with garbage collection paused."""
        if self.device.type != "cuda":
            raise RuntimeError("graph capture needs a CUDA device; on the CPU use step(..., eager=True)")
        for mode in modes or ():
            if mode not in MODES:
                raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        if self.kernels is not None:
            self.kernels.warm(self.sizes, self.state.pages_per_seq * self.shape.model.page_size)
        plan = [
            (size, mode) for size in reversed(self.sizes) for mode in dict.fromkeys([self.modes[size], *(modes or ())])
        ]
        warm = torch.cuda.Stream(self.device)
        warm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warm):
            for size, mode in plan:
                self.run_stages(size, mode)  # module loads, cuBLAS handles, allocator warm-up
        torch.cuda.current_stream(self.device).wait_stream(warm)
        torch.cuda.synchronize(self.device)
        self.error.check(self.shape.gathered, self.shape.mailbox_row_chunks)
        pool = torch.cuda.graph_pool_handle()
        gc.collect()
        gc.disable()  # a compiled kernel's finalizer unloads its module: none may run mid-capture
        try:
            for size, mode in plan:
                graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
                with torch.cuda.graph(graph, pool=pool):
                    self.run_stages(size, mode)
                self.graphs[(size, mode)] = graph
        finally:
            gc.enable()
        torch.cuda.synchronize(self.device)
        self._captured_pointers = self.buffers.pointers() + (
            self.caches.mailbox.data_ptr(),
            self.caches.mla_cache.data_ptr(),
            self.caches.index_cache.data_ptr(),
        )

    def graph(self, size: int, mode: str | None = None) -> torch.cuda.CUDAGraph:
        mode = mode or self.modes.get(size)
        if (size, mode) not in self.graphs:
            raise RuntimeError(
                f"no graph captured for batch {size} in mode {mode!r}: "
                f"captured {sorted(self.graphs)} (call capture() first)"
            )
        return self.graphs[(size, mode)]

    def replay(self, size: int, mode: str | None = None) -> None:
        """Replay a captured graph on the static buffers as they are (benchmarks)."""
        self._check_pointers()
        self.graph(size, mode).replay()

    def _check_pointers(self) -> None:
        if self._captured_pointers is None:
            raise RuntimeError("step() before capture(): call capture() first, or step(..., eager=True)")
        now = self.buffers.pointers() + (
            self.caches.mailbox.data_ptr(),
            self.caches.mla_cache.data_ptr(),
            self.caches.index_cache.data_ptr(),
        )
        if now != self._captured_pointers:
            raise RuntimeError(
                "the step's buffers were replaced after capture: the graphs still point at the old "
                "ones; capture() again"
            )

    # -- one serving step ----------------------------------------------------------------------

    def load(self, inputs: StepInputs, peers: PeerInputs | None = None, check_values: bool = True) -> int:
        """Validate `inputs` and copy them into the static buffers, padded. Returns the size.
        check_values: also check the values (one device-to-host sync): context lengths in
        [1, max_context], each block table's used pages in the pool, each slot -1 or the new
        token's slot through its own block table, the peers' candidate positions; NaN/inf
        rows of qkv are reported (NonFiniteInputs warning, self.nonfinite_rows), not refused."""
        batch = self._validate(inputs, peers, check_values)
        size = self.padded(batch)
        b = self.buffers
        b.qkv[:batch] = inputs.qkv
        b.qkv[batch:size] = 0
        b.context_lens[:batch] = inputs.context_lens
        b.context_lens[batch:size] = 1
        b.slot_mapping[:batch] = inputs.slot_mapping
        b.slot_mapping[batch:size] = -1
        b.block_tables[:batch] = inputs.block_tables
        b.block_tables[batch:size] = self.state.trash_page
        if peers is not None:
            b.peer_rows[:batch] = formats.encode_q_rows(peers.rows, self.shape.topology.q_format).view(
                batch, self.shape.gathered, -1
            )
            b.peer_rows[batch:size] = 0  # pad rows count as published
            b.peer_positions[:batch] = peers.positions
            b.peer_positions[batch:size] = -1
            b.peer_scores[:batch] = peers.scores
            b.peer_scores[batch:size] = float("-inf")
        return size

    def step(
        self, inputs: StepInputs, peers: PeerInputs | None = None, eager: bool = False, check_values: bool = True
    ) -> ref.StepOutputs:
        """Run one decode step; returns views of the outputs' real rows (valid until the next step).

        Shapes, dtypes and devices are always checked (no synchronization); check_values
        also checks the values (see load()), which costs one device-to-host sync: a serving
        loop that guarantees them can turn it off. Under DCP the step always synchronizes
        to read QueryWait's error word."""
        if not eager:
            self._check_pointers()
        size = self.load(inputs, peers, check_values)
        if eager:
            self.run_stages(size, self.modes[size])
        else:
            self.graph(size).replay()
        if self.shape.topology.dcp > 1:
            self.error.check(self.shape.gathered, self.shape.mailbox_row_chunks)
        batch, b = inputs.batch, self.buffers
        q = b.q_out[:batch].view(formats.q_dtype(self.shape.topology.q_format))  # a view: no work per step
        return ref.StepOutputs(b.qc[:batch], b.slots[:batch], q, b.out[:batch], b.lse[:batch])

    def _validate(self, inputs: StepInputs, peers: PeerInputs | None, check_values: bool = True) -> int:
        s, m = self.shape, self.shape.model
        if not isinstance(inputs, StepInputs):
            raise TypeError(f"step() takes StepInputs, got {type(inputs).__name__}")
        batch = inputs.qkv.shape[0] if inputs.qkv.dim() == 2 else 0
        expect = {
            "qkv": (inputs.qkv, torch.bfloat16, (batch, m.packed_width)),
            "context_lens": (inputs.context_lens, torch.int32, (batch,)),
            "slot_mapping": (inputs.slot_mapping, torch.int32, (batch,)),
            "block_tables": (inputs.block_tables, torch.int32, (batch, self.state.pages_per_seq)),
        }
        _check_tensors("inputs", expect, self.device)
        if batch == 0:
            raise ValueError(f"batch must be at least 1 (captured sizes: {self.sizes})")
        self.padded(batch)
        topo = s.topology
        if topo.dcp > 1:
            if peers is None:
                raise ValueError("a DCP step needs peers=PeerInputs (what the other ranks contribute)")
            if not isinstance(peers, PeerInputs):
                raise TypeError(f"peers must be PeerInputs, got {type(peers).__name__}")
            k = m.index_topk
            _check_tensors(
                "peers",
                {
                    "rows": (peers.rows, torch.float32, (batch, s.gathered, m.query_row)),
                    "positions": (peers.positions, torch.int32, (batch, topo.dcp, k)),
                    "scores": (peers.scores, torch.float32, (batch, topo.dcp, k)),
                },
                self.device,
                contiguous=False,
            )
        elif peers is not None:
            raise ValueError(f"peers are only for a DCP step; this step's topology is {topo.name} (dcp 1)")
        self.nonfinite_rows = []
        if check_values:
            self._check_values(inputs, peers)
        return batch

    def _check_values(self, inputs: StepInputs, peers: PeerInputs | None) -> None:
        """The values' ranges, with one device-to-host sync: per row, a flag for each check,
        computed on the inputs' device and read back together; the messages (only on a
        failure) read what they name."""
        st, topo, page = self.state, self.shape.topology, self.shape.model.page_size
        lens = inputs.context_lens.long()
        len_bad = (lens < 1) | (lens > st.max_context)
        safe = lens.clamp(1, st.max_context)
        # the new token's slot: -1, or the slot its block table holds at its local index
        pos = safe - 1
        local = torch.div(pos, topo.dcp, rounding_mode="floor")
        mine = pos % topo.dcp == topo.rank
        tables = inputs.block_tables
        held = tables.gather(1, torch.div(local, page, rounding_mode="floor")[:, None])[:, 0].long()
        want = torch.where(mine, held * page + local % page, -1)
        slot_bad = (inputs.slot_mapping != -1) & (inputs.slot_mapping.long() != want)
        # the used part of each block table: pages of [0, local length)
        used = torch.div(local_lens(safe, topo.dcp, topo.rank) + page - 1, page, rounding_mode="floor")
        columns = torch.arange(tables.shape[1], device=tables.device)[None]
        page_bad = ((tables < 0) | (tables >= st.trash_page)) & (columns < used[:, None])
        checks = [len_bad, page_bad.any(1), slot_bad, ~torch.isfinite(inputs.qkv).all(1)]
        if peers is not None:
            checks.append(self._peer_bad(peers, safe).any(1))
        flags = torch.stack(checks).tolist()  # the one sync
        if any(flags[0]):
            row = flags[0].index(True)
            raise ValueError(
                f"inputs.context_lens[{row}] = {int(inputs.context_lens[row])}: "
                f"must be in [1, {st.max_context}] (the step's max_context)"
            )
        if any(flags[1]):
            row = flags[1].index(True)
            col = int(page_bad[row].nonzero()[0, 0])
            raise ValueError(
                f"inputs.block_tables[{row}, {col}] = {int(tables[row, col])}: a page of the used part "
                f"(the first {int(used[row])} of row {row}, context {int(lens[row])}) must be in "
                f"[0, {st.trash_page}) (page {st.trash_page} is the spare page of padded rows)"
            )
        if any(flags[2]):
            row = flags[2].index(True)
            slot, p = int(inputs.slot_mapping[row]), int(pos[row])
            if not bool(mine[row]):
                where = f"position {p} lives on DCP rank {p % topo.dcp}, not rank {topo.rank}: its slot here must be -1"
            else:
                pool = st.trash_page * page
                inside = f"outside the pool [0, {pool})" if not 0 <= slot < pool else "not the new token's slot"
                where = (
                    f"{inside}: position {p} is at page {int(held[row])} of block_tables[{row}], slot "
                    f"{int(want[row])} (or -1 to write nothing)"
                )
            raise ValueError(f"inputs.slot_mapping[{row}] = {slot}: {where}")
        if peers is not None and any(flags[4]):
            row = flags[4].index(True)
            self._raise_peer(peers, row, safe)
        self.nonfinite_rows = [row for row, bad in enumerate(flags[3]) if bad]
        if self.nonfinite_rows:
            warnings.warn(NonFiniteInputs(self.nonfinite_rows), stacklevel=4)

    def _peer_bad(self, peers: PeerInputs, lens: torch.Tensor) -> torch.Tensor:
        """[B, dcp x topk] True where another rank's candidate position is neither -1 nor a
        position of its own rank below the token's context length (this rank's are ignored)."""
        topo = self.shape.topology
        positions = peers.positions.long()
        ranks = torch.arange(topo.dcp, device=positions.device)[None, :, None]
        ok = (positions == -1) | (
            (positions >= 0) & (positions < lens[:, None, None]) & (positions % topo.dcp == ranks)
        )
        return (~ok & (ranks != topo.rank)).flatten(1)

    def _raise_peer(self, peers: PeerInputs, row: int, lens: torch.Tensor) -> None:
        topo, k = self.shape.topology, self.shape.model.index_topk
        rank, i = divmod(int(self._peer_bad(peers, lens)[row].nonzero()[0, 0]), k)
        raise ValueError(
            f"peers.positions[{row}, {rank}, {i}] = {int(peers.positions[row, rank, i])}: rank {rank}'s "
            f"candidates must be -1 or positions p < {int(lens[row])} (the context length) with "
            f"p % {topo.dcp} == {rank}"
        )


class NonFiniteInputs(UserWarning):
    """step(check_values=True) saw NaN or inf in these tokens' qkv rows. The step still runs:
    each token's outputs depend only on its own inputs (and its own sequence's cache), so
    the other tokens' outputs are unaffected; these tokens' outputs are not meaningful.
    warnings.simplefilter("error", NonFiniteInputs) turns it into an error."""

    def __init__(self, rows: list[int]):
        super().__init__(
            f"inputs.qkv has NaN or inf in rows {rows}: their outputs are not meaningful; the other rows are unaffected"
        )
        self.rows = rows


def _check_tensors(owner: str, expect: dict, device: torch.device, contiguous: bool = True) -> None:
    for name, (tensor, dtype, shape) in expect.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{owner}.{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != dtype:
            raise ValueError(f"{owner}.{name} must be {dtype}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{owner}.{name} must have shape {list(shape)}, got {list(tensor.shape)}")
        if tensor.device != device:
            raise ValueError(f"{owner}.{name} must be on {device}, got {tensor.device}")
        if contiguous and not tensor.is_contiguous():
            raise ValueError(f"{owner}.{name} must be contiguous")
