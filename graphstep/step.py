"""DecodeStep: the query stage of one DSA layer, captured per batch size as a CUDA graph.

    step = DecodeStep(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), capture_sizes=[1, 4, 16, 64])
    step.capture()
    out = step.step(step.state.inputs(3))     # pads 3 -> 4, replays, returns the 3 real rows

Per captured size the policy (graphstep.policy.overlap_for) picks the mode:
  serial     main: MlaQuery(store_qc, poll under DCP) -> indexer -> sparse core
  fork       main: QueryNorm -> indexer ------------------------> join -> sparse core
             side:          MlaQuery -> QueryWait (DCP) ------/
  fork_poll  fork, the mailbox polled by its readers: under DCP MlaQuery polls the peers'
             rows itself (no QueryWait); on one rank the sparse core polls its query rows
             and the side stream joins after it (a kernel with two predecessors, the join,
             is not launched early under PDL).
The indexer is IndexKey (first, whatever the mode), wq_b, scoring, top-k and, under DCP,
the merge with the other ranks' candidates. run_stages issues this data path; a backend
(graphstep.stages) runs each stage: "cute" as CuTe DSL kernels chained with PDL, "torch"
in torch (the plain-torch baseline). The exchanges with the other DCP ranks go through a
transport (graphstep.transport); on one GPU, SimulatedPeers plays them from PeerInputs.

Padding: a batch pads up to the next captured size; pad rows have slot -1 (the cute
kernels write nothing for them, the torch stages write to the state's spare page) and
context length 1. A batch above the largest captured size is an error. The mailbox's
query rows are re-armed inside the step by the sparse core, their last reader (in its
kernel; the transport's arm() re-arms whatever else its exchanges need); a poll that
gives up raises MailboxTimeout: under DCP from step() itself, on one rank (fork_poll's
sparse core) from check() or the next step with check_values=True, before it runs; either
way the mailbox is armed again first.

Range guards: an id out of range (a slot, a block-table page, a length past the RoPE table)
that reaches the kernels (check_values=False) writes nothing, reads a hole or a clamped RoPE
row, and is recorded in the step's error word; check() raises InputRangeError for it on
demand, and step() at the latest on the next step with check_values=True (in the one
device-to-host read its value checks make), or at once under DCP (which reads the word
after every step anyway).
"""

from __future__ import annotations

import gc
import warnings
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from . import formats
from .launch import DEFAULT_BUDGET_NS, ErrorWord, MailboxTimeout, check_budget, guard_bounds
from .policy import MODES, modes_for, side_stream
from .shapes import RankShape, check_batch, check_capture_sizes
from .stages import Buffers, CuteStages, Stages, TorchStages
from .state import LayerCaches, LayerState, PeerInputs, StepInputs, StepOutputs, check_tensors
from .transport import SimulatedPeers, SingleRank, Transport

BACKENDS: dict[str, type[Stages]] = {"cute": CuteStages, "torch": TorchStages}
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)  # vLLM's: 1, 2, 4, then steps of 8


class DecodeStep:
    """The decode step of one DSA layer on one rank, captured as one CUDA graph per batch size.

    Arguments:
        shape: RankShape. The model (ModelShape, e.g. preset("deepseek-v3.2")) and this
            rank's Topology (tp, dcp, rank, wide, split, q_format, mla_cache).
        capture_sizes: iterable of int. The batch sizes to capture a graph for; a step of B
            tokens replays the smallest size >= B, whose pad rows write no cache row that is
            read and are not returned. The largest sizes the static buffers (default: vLLM's
            1, 2, 4, 8, 16, ..., 64).
        policy: str or None. The overlap mode per size: a mode ("serial", "fork",
            "fork_poll") or a "rows:mode,..." table; None takes the topology's default table
            (graphstep.policy.QUERY_OVERLAP).
        backend: "cute" (CuTe DSL kernels chained with PDL; needs an sm_90 GPU) or "torch"
            (graph-capturable torch, the baseline; also runs on the CPU with eager=True).
        device: the torch device of the state, the buffers and the graphs.
        max_context: int. The longest context (tokens, the new one included) of a step; sizes
            the block tables and the caches (max_batch x max_context tokens, sharded by DCP).
        seed: int. Seed of the random weights and caches (LayerState).
        pdl: bool. Chain the cute kernels with Programmatic Dependent Launch.
        budget_ns: int. How long a poll of the mailbox (DCP's, or fork_poll's sparse core on
            one rank) waits for a chunk before it gives up (MailboxTimeout, see above); at
            most 15 s (kernels/guards.py MAX_BUDGET_NS).
        transport: callable (shape, mailbox) -> Transport, or None. This rank's end of the
            DCP exchanges (graphstep.transport); None: SimulatedPeers under DCP (the other
            ranks played from step()'s `peers`), SingleRank without.
        state: LayerState or None. The weights and caches to step on (a DcpGroup's shard of
            one unsharded layer), built before the backend, which may derive tensors from the
            weights; its shape, device and max_context must be the step's and its max_batch
            the largest captured size (seed is then unused). None: drawn from `seed`.

    Attributes: state (LayerState: weights, caches, the mailbox), buffers (the static
    Buffers the graphs read and write), stages (the backend), transport (the DCP exchanges),
    modes ({size: mode}), graphs ({(size, mode): CUDAGraph}), error (the ErrorWord of the
    polls and the range guards; check() reads it).
    """

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
        transport=None,
        state: LayerState | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {tuple(BACKENDS)}")
        sizes = check_capture_sizes(capture_sizes)
        if policy is not None and not isinstance(policy, str):
            raise TypeError(f"policy must be a mode or a 'rows:mode,...' table (str) or None, got {policy!r}")
        check_budget(budget_ns)
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
        self.modes = modes_for(sizes, policy, dcp=topo.dcp > 1, wide=topo.wide, split=topo.split)
        if state is None:
            state = LayerState(shape, max_batch=sizes[-1], max_context=max_context, seed=seed, device=self.device)
        elif (state.shape, state.device, state.max_batch, state.max_context) != (
            shape,
            self.device,
            sizes[-1],
            max_context,
        ):
            raise ValueError(
                f"state: a LayerState of {shape.model.name} {shape.topology} on {self.device} for {sizes[-1]} x "
                f"{max_context} tokens, got {state.shape.model.name} {state.shape.topology} on {state.device} for "
                f"{state.max_batch} x {state.max_context}"
            )
        self.state = state
        self.error = ErrorWord.new(self.device)
        self.bounds = guard_bounds(self.state)  # what the range guards hold each id to
        self.buffers = Buffers.allocate(self.state)
        self.stages: Stages = BACKENDS[backend](self.state, self.buffers, self.error, budget_ns, pdl)
        make_transport = transport or (SimulatedPeers if topo.dcp > 1 else SingleRank)
        self.transport: Transport = make_transport(shape, self.caches.mailbox)
        self.stages.transport = self.transport
        self._use_exchange(0)  # a transport's parity-0 buffers are the step's own between issues
        # the query side stream (fork modes): shared by every step of a device, unless a caller
        # whose steps wait on each other's kernels (a DcpGroup on one GPU) gives each its own
        self.side = side_stream(self.device.index) if self.device.type == "cuda" else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._captured_pointers: tuple[int, ...] | None = None
        self.nonfinite_rows: list[int] = []  # rows of the last checked step's qkv with NaN or inf
        # load()'s copies (_load_plan): the buffers they view, their padding values, the plan per batch
        self._load_views: tuple = ()
        self._load_padding: list[torch.Tensor] = []
        self._load_plans: dict[int, tuple[list, list]] = {}
        self._output_views: tuple = ()  # outputs()'s views per batch, and the buffers they view (_outputs)
        self._output_plans: dict[int, tuple] = {}

    @property
    def caches(self) -> LayerCaches:
        """The state's caches and mailbox (the graphs read and write them in place)."""
        return self.state.caches

    def padded(self, batch: int) -> int:
        """The captured size a batch runs at."""
        check_batch(batch)
        for size in self.sizes:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds the largest captured size {self.sizes[-1]} (captured: {self.sizes})")

    # -- the data path of one captured size ----------------------------------------------------

    def _use_exchange(self, parity: int) -> None:
        """Point the mailbox and the own-candidate buffers at the transport's of `parity`
        (nothing for a transport without exchange buffers)."""
        exchange = self.transport.exchange(parity)
        if exchange is not None:
            self.state.caches.mailbox = exchange.mailbox
            self.buffers.own_positions, self.buffers.own_scores = exchange.positions, exchange.scores

    @contextmanager
    def _parity(self, parity: int):
        if not 0 <= parity < self.transport.parities:
            raise ValueError(f"parity {parity}: this step's transport has {self.transport.parities}")
        self._use_exchange(parity)
        try:
            yield
        finally:
            self._use_exchange(0)

    def run_stages(self, size: int, mode: str, parity: int = 0) -> None:
        """Issue one step of `size` rows in `mode` on the current stream (what a graph holds);
        parity: which of the transport's exchange buffers (a DCP group's step count % 2)."""
        for phase in self.phases(size, mode, parity):
            phase()

    def phases(self, size: int, mode: str, parity: int = 0) -> list:
        """One step's launches as three callables, each issuing on the current stream (and on
        the side stream, joined inside them): produce (the indexer to TopK, MlaQuery with its
        publish), exchange (the waits on the peers: CandidateSync, QueryWait), consume
        (DcpMerge, the join, the sparse core). run_stages calls them in order. A DcpGroup on
        one GPU issues each phase for every rank before the next phase of any: its streams may
        share a hardware queue, where a launch waiting for its stream holds back every launch
        behind it, and in this order no rank's wait is queued ahead of what a peer must run."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        stages, transport, b = self.stages, self.transport, self.buffers
        dcp, fork = self.shape.topology.dcp > 1, mode != "serial"
        side = self.side if fork and self.device.type == "cuda" else None
        peers = []

        def on_side():
            return torch.cuda.stream(side) if side is not None else nullcontext()

        def produce():
            stages.guard(size)
            if not fork:
                transport.publish_query_rows(size)
                stages.index_key(size)
                stages.mla_query(size, store_qc=True, poll=dcp)
                transport.share_query_rows(size)
            else:
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(self.device))
                with on_side():  # the peers' rows land beside this rank's chain, as their remote stores do
                    transport.publish_query_rows(size)
                stages.key_and_query_norm(size)
            stages.index_query(size)
            stages.index_scores(size)
            stages.top_k(size)
            if fork:
                with on_side():
                    stages.mla_query(size, store_qc=False, poll=dcp and mode == "fork_poll")
                    transport.share_query_rows(size)

        def exchange():
            if dcp:
                peers.append(transport.publish_candidates(b.own_positions, b.own_scores, size))
                if peers[0].flags is not None:
                    stages.candidate_sync(peers[0], size)
            if dcp and mode == "fork":
                with on_side():
                    stages.query_wait(size)

        def consume():
            if dcp:
                stages.dcp_merge(peers[0], size)  # under DCP the indexer ends in the merge -> buffers.slots
            # fork_poll on one rank: the sparse core waits for its query rows itself, and the side
            # stream joins after it, so its node keeps one predecessor (a join is not launched early)
            poll = mode == "fork_poll" and not dcp and stages.polls_query_rows(size)
            if side is not None and not poll:
                torch.cuda.current_stream(self.device).wait_stream(side)
            # the query rows' last reader: it also copies them to q_out and re-arms them
            stages.sparse_core(size, poll=poll)
            if side is not None and poll:
                torch.cuda.current_stream(self.device).wait_stream(side)
            transport.arm(size)

        def at_parity(phase):
            def issue():
                with self._parity(parity):
                    phase()

            return issue

        return [at_parity(phase) for phase in (produce, exchange, consume)]

    # -- capture and replay ------------------------------------------------------------------

    def plan(self, modes: tuple[str, ...] | None = None) -> list[tuple[int, str, int]]:
        """What capture() captures: (size, mode, parity) per graph, largest size first."""
        if isinstance(modes, str):
            raise TypeError(f"modes must be a tuple of mode names, e.g. ({modes!r},), got the string {modes!r}")
        for mode in modes or ():
            if mode not in MODES:
                raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        return [
            (size, mode, parity)
            for size in reversed(self.sizes)
            for mode in dict.fromkeys([self.modes[size], *(modes or ())])
            for parity in range(self.transport.parities)
        ]

    def capture(
        self,
        modes: tuple[str, ...] | None = None,
        keep_graph: bool = False,
        warm_up: bool = True,
        raise_recorded: bool = True,
    ) -> None:
        """Compile and warm every kernel, then capture one graph per size (and per extra mode
        in `modes`, and per parity of the transport), largest first, into one memory pool,
        with garbage collection paused. warm_up=False: the caller has run every graph's
        stages eagerly once already (a DcpGroup, whose ranks must run them together).
        raise_recorded=False: range errors the warm-up records are cleared, not raised (a
        probe whose outputs are marks, not slots: bench_indexer.py --top-k-trace-step)."""
        if self.device.type != "cuda":
            raise RuntimeError("graph capture needs a CUDA device; on the CPU use step(..., eager=True)")
        plan = self.plan(modes)
        self.stages.warm(self.sizes, {mode for _, mode, _ in plan})
        if warm_up:
            warm = torch.cuda.Stream(self.device)
            warm.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(warm):
                for size, mode, parity in plan:
                    self.run_stages(size, mode, parity)  # module loads, cuBLAS handles, allocator warm-up
            torch.cuda.current_stream(self.device).wait_stream(warm)
            torch.cuda.synchronize(self.device)
            if raise_recorded:
                self._raise_recorded()
            else:
                self.error.reset()
        pool = torch.cuda.graph_pool_handle()
        gc.collect()
        gc.disable()  # a compiled kernel's finalizer unloads its module: none may run mid-capture
        try:
            for size, mode, parity in plan:
                graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
                with torch.cuda.graph(graph, pool=pool):
                    self.run_stages(size, mode, parity)
                self.graphs[(size, mode) if parity == 0 else (size, mode, parity)] = graph
        finally:
            gc.enable()
        torch.cuda.synchronize(self.device)
        self._captured_pointers = self._pointers()

    def graph(self, size: int, mode: str | None = None, parity: int = 0) -> torch.cuda.CUDAGraph:
        """The captured graph of `size` in `mode` (default: the policy's mode for the size);
        parity 1: a DCP group's odd steps (key (size, mode, 1))."""
        mode = mode or self.modes.get(size)
        key = (size, mode) if parity == 0 else (size, mode, parity)
        if key not in self.graphs:
            raise RuntimeError(
                f"no graph captured for batch {size} in mode {mode!r}"
                + (f" at parity {parity}" if parity else "")
                + f": captured {sorted(self.graphs, key=str)} (call capture() first)"
            )
        return self.graphs[key]

    def replay(self, size: int, mode: str | None = None, parity: int = 0) -> None:
        """Replay a captured graph on the static buffers as they are (benchmarks)."""
        self._check_pointers()
        self.graph(size, mode, parity).replay()

    def outputs(self, batch: int) -> StepOutputs:
        """Views of the last step's outputs for its `batch` real rows (valid until the next step)."""
        self.padded(batch)  # a batch no captured size holds has no rows here
        return self._outputs(batch)

    def _outputs(self, batch: int) -> StepOutputs:
        """outputs() for a batch step() has checked already: a new StepOutputs around views made
        once per batch (as load()'s copies: slicing five buffers per step cost ~5 us of host
        time), made again when a buffer was replaced."""
        b = self.buffers
        viewed = (b.qc, b.slots, b.q_out, b.out, b.lse)
        if len(self._output_views) != len(viewed) or any(x is not y for x, y in zip(self._output_views, viewed)):
            self._output_views, self._output_plans = viewed, {}
        if batch not in self._output_plans:
            q = b.q_out[:batch].view(formats.q_dtype(self.shape.topology.q_format))
            self._output_plans[batch] = (b.qc[:batch], b.slots[:batch], q, b.out[:batch], b.lse[:batch])
        return StepOutputs(*self._output_plans[batch])

    def _check_pointers(self) -> None:
        if self._captured_pointers is None:
            raise RuntimeError("step() before capture(): call capture() first, or step(..., eager=True)")
        if self._pointers() != self._captured_pointers:
            raise RuntimeError(
                "the step's buffers were replaced after capture: the graphs still point at the old "
                "ones; capture() again"
            )

    def _pointers(self) -> tuple[int, ...]:
        """Where the graphs read and write: the static buffers and the caches."""
        c = self.caches
        return self.buffers.pointers() + (c.mailbox.data_ptr(), c.mla_cache.data_ptr(), c.index_cache.data_ptr())

    # -- one serving step ----------------------------------------------------------------------

    def load(self, inputs: StepInputs, peers: PeerInputs | None = None, check_values: bool = True) -> int:
        """Validate `inputs` and copy them into the static buffers, padded. Returns the size.
        check_values: also check the values (one device-to-host sync): context lengths in
        [1, max_context], each block table's used pages in the pool, each slot -1 or the new
        token's slot through its own block table, and the transport's checks of `peers`
        (SimulatedPeers: the candidate positions); NaN/inf rows of qkv are reported
        (NonFiniteInputs warning, self.nonfinite_rows), not refused. peers: what the
        transport takes for the other ranks (SimulatedPeers: PeerInputs; otherwise None)."""
        batch, size = self._validate(inputs, peers, check_values)
        destinations, padding = self._load_plan(batch, size)
        sources = [inputs.qkv, inputs.context_lens, inputs.slot_mapping, inputs.block_tables, *padding]
        torch._foreach_copy_(destinations, sources)  # one host call for the rows and their padding
        self.transport.load(peers, batch, size)
        return size

    def _load_plan(self, batch: int, size: int) -> tuple[list, list]:
        """load()'s copies for `batch` rows at captured size `size`: the four input buffers' first
        `batch` rows, then (size > batch) their padded rows, and the padding values for those
        (qkv 0, context 1, slot -1, the spare page; slices of one max_batch-row tensor each).
        Made once per batch, then reused while the buffers are the same tensors (slicing and
        filling per step cost ~10 us of host time); a replaced buffer drops every plan."""
        b = self.buffers
        inputs = (b.qkv, b.context_lens, b.slot_mapping, b.block_tables)
        if len(self._load_views) != len(inputs) or any(x is not y for x, y in zip(self._load_views, inputs)):
            values = (0, 1, -1, self.state.trash_page)
            self._load_views, self._load_plans = inputs, {}
            self._load_padding = [torch.full_like(t, v) for t, v in zip(inputs, values)]
        if batch not in self._load_plans:
            destinations, padding = [t[:batch] for t in inputs], []
            if size > batch:
                destinations += [t[batch:size] for t in inputs]
                padding = [p[: size - batch] for p in self._load_padding]
            self._load_plans[batch] = (destinations, padding)
        return self._load_plans[batch]

    def step(
        self, inputs: StepInputs, peers: PeerInputs | None = None, eager: bool = False, check_values: bool = True
    ) -> StepOutputs:
        """Run one decode step; returns views of the outputs' real rows (valid until the next step).

        Shapes, dtypes and devices are always checked (no synchronization); check_values
        also checks the values (see load()), which costs one device-to-host sync: a serving
        loop that guarantees them can turn it off. Under DCP the step always synchronizes
        to read QueryWait's error word.

        With check_values=False, an out-of-range id that reaches the kernels is guarded
        there and recorded: check() raises InputRangeError for it; so does the next step
        with check_values=True (before it runs; under DCP, this step itself)."""
        size = self.load(inputs, peers, check_values)
        if eager:
            self.run_stages(size, self.modes[size])
        else:
            self.replay(size)  # checks the buffers' addresses once
        if self.shape.topology.dcp > 1:
            self._raise_recorded()
        return self._outputs(inputs.batch)

    def check(self) -> None:
        """Synchronize with the device and raise what the steps so far left in the error word:
        InputRangeError (a kernel met an id out of range: which kernel, token, value and the
        range expected) or MailboxTimeout (a mailbox poll gave up; the mailbox is armed
        again). The word is then reset, so the next step runs normally. Costs one
        synchronization: call it when you choose."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._raise_recorded()

    def _raise_recorded(self, words: list[int] | None = None) -> None:
        """Raise what the error word holds (ErrorWord.check) and reset it; words: its values
        if already read. A poll that gave up also leaves the mailbox as the late publisher
        left it (rows published after their reader re-armed them), which the next step's
        poll would take for its own: it is armed again first (the device is idle here: the
        word was read)."""
        dcp = self.shape.topology.dcp > 1
        heads, rank = (self.shape.heads, self.shape.topology.rank) if dcp else (None, None)
        try:
            self.error.check(self.shape.gathered, self.shape.mailbox_row_chunks, heads, self.bounds, words, rank)
        except MailboxTimeout:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            formats.arm(self.caches.mailbox)
            raise

    def _validate(self, inputs: StepInputs, peers: PeerInputs | None, check_values: bool = True) -> tuple[int, int]:
        """The checks of load(); returns (batch, the captured size it runs at)."""
        m = self.shape.model
        if not isinstance(inputs, StepInputs):
            raise TypeError(f"step() takes StepInputs, got {type(inputs).__name__}")
        qkv = inputs.qkv
        if isinstance(qkv, torch.Tensor) and qkv.dim() != 2:
            raise ValueError(f"inputs.qkv must have shape [B, {m.packed_width}], got {list(qkv.shape)}")
        batch = qkv.shape[0] if isinstance(qkv, torch.Tensor) else 0
        expect = {
            "qkv": (inputs.qkv, torch.bfloat16, (batch, m.packed_width)),
            "context_lens": (inputs.context_lens, torch.int32, (batch,)),
            "slot_mapping": (inputs.slot_mapping, torch.int32, (batch,)),
            "block_tables": (inputs.block_tables, torch.int32, (batch, self.state.pages_per_seq)),
        }
        check_tensors("inputs", expect, self.device)
        if batch == 0:
            raise ValueError(f"batch must be at least 1 (captured sizes: {self.sizes})")
        size = self.padded(batch)  # raises for a batch above every captured size, before the value checks
        self.transport.check(peers, batch)
        self.nonfinite_rows = []
        if check_values:
            self._check_values(inputs, peers)
        return batch, size

    def _check_values(self, inputs: StepInputs, peers: PeerInputs | None) -> None:
        """The values' ranges, with one device-to-host copy: on the inputs' device only what
        must stay there (qkv's rows finite, the transport's checks of the peers' candidate
        lists), read back with the small integer inputs and the error word in one int32
        tensor; the integer checks then run in numpy on the host copy (as ~40 torch calls of
        5-55 us each they took ~0.5 ms a step on the H200: bench/RESULTS.md session 44)."""
        st, topo, page = self.state, self.shape.topology, self.shape.model.page_size
        batch, columns = inputs.block_tables.shape
        transport_checks = []  # only a transport that takes peers has checks (transport.check required them)
        if peers is not None:
            transport_checks = self.transport.value_checks(peers, inputs.context_lens.clamp(1, st.max_context))
        # x * 0 is 0 for finite x and NaN for NaN or inf: a row's sum is NaN iff the row is not all finite
        # (two device ops); its fp32 bits travel as int32 with the integer inputs
        nonfinite_bits = (inputs.qkv * 0).sum(1, dtype=torch.float32).view(torch.int32)
        peer_flags = [torch.stack([bad for bad, _ in transport_checks]).flatten().int()] if transport_checks else []
        packed = [inputs.context_lens, inputs.slot_mapping, inputs.block_tables.flatten(), nonfinite_bits]
        host = torch.cat(packed + peer_flags + [self.error.word]).cpu().numpy()  # the one read (all on one device)
        parts, start = [], 0  # (np.split costs more than the checks it feeds)
        for n in (batch, batch, batch * columns, batch, batch * len(transport_checks), self.error.word.numel()):
            parts.append(host[start : start + n])
            start += n
        lens, slots, tables, nonfinite_sums, peer_bad, word = parts
        tables = tables.reshape(batch, columns)
        lens, slots = lens.astype(np.int64), slots.astype(np.int64)
        len_bad = (lens < 1) | (lens > st.max_context)
        safe = lens.clip(1, st.max_context)
        # the new token's slot: -1, or the slot its block table holds at its local index (LayerState.new_token_slots'
        # formula in numpy: every checked test step, its slots made by new_token_slots, holds the two equal)
        pos = safe - 1
        local = pos // topo.dcp
        own_page = tables[np.arange(batch), np.minimum(local // page, columns - 1)].astype(np.int64)
        want = np.where(pos % topo.dcp == topo.rank, own_page * page + local % page, -1)
        slot_bad = (slots != -1) & (slots != want)
        # two tokens writing one slot (their new tokens on one shared page): the later row
        dup_bad = np.tril((slots[:, None] == slots[None, :]) & (slots[None, :] != -1), -1).any(1)
        # the used part of each block table: pages of [0, local length) (state.local_lens; safe >= 1 keeps it >= 0)
        used = ((safe - topo.rank + topo.dcp - 1) // topo.dcp + page - 1) // page
        page_bad = ((tables < 0) | (tables >= st.trash_page)) & (np.arange(columns)[None] < used[:, None])
        # an earlier unchecked step's range error first (the word is reset: the next call runs)
        self._raise_recorded(word.tolist())
        if len_bad.any():
            row = int(np.argmax(len_bad))
            raise ValueError(
                f"inputs.context_lens[{row}] = {int(lens[row])}: "
                f"must be in [1, {st.max_context}] (the step's max_context)"
            )
        if page_bad.any():
            row, col = (int(i[0]) for i in np.nonzero(page_bad))
            raise ValueError(
                f"inputs.block_tables[{row}, {col}] = {int(tables[row, col])}: a page of the used part "
                f"(the first {int(used[row])} of row {row}, context {int(lens[row])}) must be in "
                f"[0, {st.trash_page}) (page {st.trash_page} is the spare page of padded rows)"
            )
        if slot_bad.any():
            row = int(np.argmax(slot_bad))
            slot, p = int(slots[row]), int(pos[row])
            if p % topo.dcp != topo.rank:
                where = f"position {p} lives on DCP rank {p % topo.dcp}, not rank {topo.rank}: its slot here must be -1"
            else:
                pool = st.trash_page * page
                inside = f"outside the pool [0, {pool})" if not 0 <= slot < pool else "not the new token's slot"
                where = (
                    f"{inside}: position {p} is at page {int(want[row]) // page} of block_tables[{row}], slot "
                    f"{int(want[row])} (or -1 to write nothing)"
                )
            raise ValueError(f"inputs.slot_mapping[{row}] = {slot}: {where}")
        if dup_bad.any():
            row = int(np.argmax(dup_bad))
            slot = int(slots[row])
            first = int(np.argmax(slots == slot))
            raise ValueError(
                f"inputs.slot_mapping[{row}] = {slot}: also row {first}'s slot: two tokens would write one cache "
                f"row (their block tables share the page of the new token)"
            )
        for (_, fail), bad in zip(transport_checks, peer_bad.reshape(-1, batch)):
            if bad.any():
                fail(int(np.argmax(bad)))
        self.nonfinite_rows = np.flatnonzero(np.isnan(nonfinite_sums.view(np.float32))).tolist()
        if self.nonfinite_rows:
            warnings.warn(NonFiniteInputs(self.nonfinite_rows), stacklevel=4)


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
