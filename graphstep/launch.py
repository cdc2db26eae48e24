"""Host side of the CuTe DSL kernels: torch tensors in, launches on the current stream.

`Kernels` binds the compiled kernels of one RankShape to a state's weights; every op comes
from kernels/catalog.py. Compile every variant of the capture sizes with `warm(sizes, width)`
before any graph capture: a module load inside capture fails. `TvmFfiKernels` launches the
same kernels through CuTe DSL's TVM-FFI ABI, for callers that pay the host time of each
eager call (graphstep.ops); its modules load at their first launch instead.

Every kernel that addresses memory with an id from the step's inputs (a slot, a block-table
page, a RoPE row at context_lens - 1) holds it to the bounds its launcher passes, taken
from the tensors' shapes (`pool_slots`, `pool_pages`, `rope_rows`), and records the first
offence in the ErrorWord (kernels/guards.py); `ErrorWord.check` raises InputRangeError.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .kernels import guards
from .shapes import RankShape, tiled_from
from .state import LayerWeights

INT32_MAX = 2**31 - 1
DEFAULT_BUDGET_NS = 200_000_000  # 200 ms: far beyond any healthy publish, far below a hang


def check_budget(budget_ns) -> int:
    """Return budget_ns if it is an int in [0, guards.MAX_BUDGET_NS], else raise ValueError:
    a kernel's mbarrier waits may sit behind its poll, and they trap after
    guards.MBAR_WAIT_LIMIT_NS (kernels/guards.py)."""
    if not isinstance(budget_ns, int) or isinstance(budget_ns, bool) or not 0 <= budget_ns <= guards.MAX_BUDGET_NS:
        raise ValueError(
            f"budget_ns must be an int in [0, {guards.MAX_BUDGET_NS}] (ns a poll waits; kernels/guards.py), "
            f"got {budget_ns!r}"
        )
    return budget_ns


KERNEL_DTYPES = (torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8)  # what a pointer can be


def _cutlass_dtype(dtype: torch.dtype):
    """The CuTe DSL type of a KERNEL_DTYPES dtype."""
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
        torch.uint8: cutlass.Uint8,
    }
    return table[dtype]


def checked_address(tensor: torch.Tensor, align: int = 16) -> int:
    """The address of a CUDA tensor's first element, refused unless it is on the GPU,
    `align`-byte aligned and of a dtype a kernel pointer can have (KERNEL_DTYPES)."""
    if not tensor.is_cuda:
        raise ValueError(f"kernel arguments must be CUDA tensors, got one on {tensor.device}")
    return aligned_address(tensor, align)


def aligned_address(tensor: torch.Tensor, align: int = 16) -> int:
    """checked_address without the device check (the CPU tests' stand-in launches use it)."""
    if tensor.data_ptr() % align:
        raise ValueError(f"kernel argument at {tensor.data_ptr():#x} is not {align}-byte aligned")
    if tensor.dtype not in KERNEL_DTYPES:
        raise TypeError(f"no kernel pointer type for {tensor.dtype}")
    return tensor.data_ptr()


def ptr(tensor: torch.Tensor, align: int = 16):
    """A global pointer to a CUDA tensor's first element."""
    from .kernels.primitives import gmem_ptr

    address = checked_address(tensor, align)
    return gmem_ptr(_cutlass_dtype(tensor.dtype), address, align)


def current_stream():
    """torch's current CUDA stream as the driver handle the compiled kernels launch on."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class MailboxTimeout(RuntimeError):
    """A mailbox chunk never landed within a poll's budget (QueryWait's or MlaQuery's under
    DCP, the sparse core's in fork_poll on one rank). heads: head rows per rank under DCP,
    to name the rank that owns the row (rank = row // heads) and never published it."""

    def __init__(self, token: int, row: int, chunk: int, heads: int | None = None):
        owner = "" if heads is None else f" (rank {row // heads}'s)"
        where = "DCP mailbox" if heads is not None else "mailbox"
        super().__init__(
            f"{where}: token {token}, head row {row}{owner}, chunk {chunk} was never published "
            f"(a poll gave up after its budget; the step's outputs are invalid)"
        )
        self.token, self.row, self.chunk = token, row, chunk
        self.rank = None if heads is None else row // heads


class CandidatesTimeout(RuntimeError):
    """Some ranks' top-k candidates never arrived (their step stopped, or never ran, between
    TopK and the exchange). rank: the rank that waited (None: unknown); missing: the ranks
    it waited for in vain (CandidateSync names the lowest one)."""

    def __init__(self, rank: int | None, missing: list[int]):
        who = "this rank" if rank is None else f"rank {rank}"
        super().__init__(
            f"DCP candidates: {who} never received the candidates of ranks {missing} (the step's outputs are invalid)"
        )
        self.rank, self.missing = rank, missing


class InputRangeError(ValueError):
    """A kernel met an id from the step's inputs out of its range (a step run with
    check_values=False): it wrote nothing for it, read it as a hole or clamped a RoPE row,
    and recorded it. check: the kernels/guards.py check id; kernel, argument: its names;
    token: the row of the batch; value: the id; bounds: [lo, hi) it had to be in, if known."""

    def __init__(self, check: int, token: int, value: int, bounds: tuple[int, int] | None = None):
        kernel, argument, what = guards.CHECKS.get(check, (f"kernel check {check}", "an input", "its range"))
        if argument == "context_lens":
            expected = f"in [1, {bounds[1] - 1}] ({what})" if bounds else f"in [1, {what}]"
            effect = "RoPE row 0 was read instead"
        else:
            expected = f"in [{bounds[0]}, {bounds[1]}) ({what})" if bounds else f"one of {what}"
            effect = "nothing was written for it" if argument == "slot_mapping" else "it was treated as a hole"
        super().__init__(
            f"{kernel}: token {token}'s {argument} value {value} is out of range: it must be {expected}; {effect}, "
            f"and token {token}'s outputs of that step are not meaningful (the step ran with check_values=False)"
        )
        self.check, self.kernel, self.argument, self.token, self.value = check, kernel, argument, token, value
        self.bounds = bounds


# the cleared word: no poll gave up (flag 0, index INT32_MAX), no range record (int64 2**63 - 1),
# no candidate wait gave up (flag 0, rank INT32_MAX)
_CLEAR = [0, INT32_MAX, -1, INT32_MAX, 0, INT32_MAX]


@dataclass
class ErrorWord:
    """int32 [6] on the device: the mailbox polls' (flag, lowest missing linear chunk index),
    the range guards' record, one int64 in words 2-3 (kernels/guards.py), then
    CandidateSync's (flag, lowest rank whose candidates never came) in words 4-5."""

    word: torch.Tensor

    @classmethod
    def new(cls, device) -> "ErrorWord":
        """A cleared error word on `device`."""
        return cls(torch.tensor(_CLEAR, dtype=torch.int32, device=device))

    def reset(self) -> None:
        """Clear the word (no chunk missing, no range record) for the next step."""
        self.word.copy_(torch.tensor(_CLEAR[: self.word.numel()], dtype=torch.int32))  # ops' words: 4

    @property
    def record(self) -> torch.Tensor:
        """The range record as an int64 [1] view (what the torch backend min-reduces into)."""
        return self.word[2:4].view(torch.int64)

    def check(
        self,
        gathered: int,
        row_chunks: int,
        heads: int | None = None,
        bounds: dict | None = None,
        words: list[int] | None = None,
        rank: int | None = None,
    ) -> None:
        """Raise InputRangeError if a kernel met an id out of range, else MailboxTimeout if
        a poll gave up, else CandidatesTimeout if a candidate wait did (reading the word
        synchronizes with the device), resetting the word in each case. heads: head rows
        per rank, to name the rank that never published; bounds: {check: (lo, hi)} for the
        message (guard_bounds); words: the word's six values if the caller already read them
        (no second transfer); rank: this rank, for CandidatesTimeout's message."""
        words = self.word.tolist() if words is None else list(words)
        # a 4-word tensor (graphstep.ops' error argument) has no candidate pair
        flag, index, low, high, candidates, missing = words + _CLEAR[len(words) :]
        found = guards.unpack((high << 32) | (low & 0xFFFFFFFF))
        if found is not None:
            self.reset()
            check, token, value = found
            raise InputRangeError(check, token, value, (bounds or {}).get(check))
        if flag:
            self.reset()
            token, rest = divmod(index, gathered * row_chunks)
            raise MailboxTimeout(token, rest // row_chunks, rest % row_chunks, heads)
        if candidates:
            self.reset()
            raise CandidatesTimeout(rank, [missing])


def on_cuda(device) -> bool:
    """Whether `device` (a torch.device, a string or None) is a CUDA device: what the device
    queries below (SMs, resident clusters) ask; off CUDA they answer for the tuned part."""
    return device is not None and torch.device(device).type == "cuda"


def sm_count(device=None) -> int:
    """The SMs of `device` if it is a CUDA device (a MIG slice's own), else the 132 of an H100
    SXM / H200 the kernels are tuned on (sparse_core.SMS): what bounds a polling launch."""
    from .kernels.sparse_core import SMS

    if not on_cuda(device):
        return SMS
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


# An empty kernel for the occupancy queries of `cluster_fits` (CUTLASS's hardware_info asks the
# driver with one the same way).
_EMPTY_PTX = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry cluster_probe()\n{\n\tret;\n}\n\0"
_FITS: dict[tuple[int, int, int], bool] = {}


def cluster_fits(device, ctas: int, per_sm: int) -> bool:
    """Whether a cluster of `ctas` CTAs, `per_sm` of them an SM, can be resident at once on
    `device` (cuOccupancyMaxActiveClusters >= 1 for an empty kernel whose shared memory
    lets exactly per_sm CTAs share an SM; a cluster must fit in one GPC). True off CUDA.
    Asked once per (device, ctas, per_sm). The H100 SXM's and H200's GPCs hold TopK's 16-CTA
    clusters; an H20's or H100 PCIe's may not (top_k.split_for then picks a smaller split)."""
    if not on_cuda(device):
        return True
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (index, ctas, per_sm)
    if key not in _FITS:
        _FITS[key] = _max_active_clusters(index, ctas, per_sm) >= 1
    return _FITS[key]


def _max_active_clusters(index: int, ctas: int, per_sm: int) -> int:
    """cuOccupancyMaxActiveClusters of clusters of `ctas` CTAs at `per_sm` CTAs an SM on
    device `index`, in its primary context (torch's), pushed for the query: 0 where the
    driver refuses the cluster size (an invalid cluster size or value); any other error raises."""
    from cuda.bindings import driver as cu

    def checked(result):
        error, *values = result
        if error != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cluster_fits: {error.name}")
        return values[0] if values else None

    checked(cu.cuInit(0))
    device = checked(cu.cuDeviceGet(index))
    context = checked(cu.cuDevicePrimaryCtxRetain(device))
    try:
        checked(cu.cuCtxPushCurrent(context))
    except RuntimeError:
        cu.cuDevicePrimaryCtxRelease(device)
        raise
    try:
        attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        smem = checked(cu.cuDeviceGetAttribute(attribute, device)) // per_sm - 1024  # 1 KB a CTA is reserved
        module = checked(cu.cuModuleLoadData(_EMPTY_PTX))
        try:
            function = checked(cu.cuModuleGetFunction(module, b"cluster_probe"))
            attribute = cu.CUfunction_attribute
            checked(cu.cuFuncSetAttribute(function, attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            checked(cu.cuFuncSetAttribute(function, attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
            cluster = cu.CUlaunchAttribute()
            cluster.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = ctas, 1, 1
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = ctas, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = 128, 1, 1
            config.sharedMemBytes = smem  # per_sm of these fill an SM's shared memory, per_sm + 1 do not
            config.attrs, config.numAttrs = [cluster], 1
            error, count = cu.cuOccupancyMaxActiveClusters(function, config)
            if error in (cu.CUresult.CUDA_ERROR_INVALID_CLUSTER_SIZE, cu.CUresult.CUDA_ERROR_INVALID_VALUE):
                return 0  # a cluster size the driver refuses (past 16, its non-portable limit)
            return checked((error, count))
        finally:
            cu.cuModuleUnload(module)
    finally:
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(device)


def pool_slots(cache: torch.Tensor, page_size: int) -> int:
    """Slots of a paged cache [pages, ...] (the MLA or the indexer cache) as a kernel bound."""
    return min(cache.shape[0] * page_size, INT32_MAX)


def rope_rows(cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Positions a RoPE table pair holds: the kernels read row context_lens - 1 below it."""
    return min(cos.shape[0], sin.shape[0], INT32_MAX)


def guard_bounds(state) -> dict[int, tuple[int, int]]:
    """Per range check (kernels/guards.py), the [lo, hi) the kernels hold its value to over
    this LayerState's tensors (what the launchers pass them)."""
    m, w, c = state.shape.model, state.weights, state.caches
    index_pages = min(c.index_cache.shape[0], INT32_MAX)
    index_len = rope_rows(w.index_rope_cos, w.index_rope_sin) + 1
    mla_len = rope_rows(w.rope_cos, w.rope_sin) + 1
    positions = state.pages_per_seq * m.page_size * state.shape.topology.dcp
    return {
        guards.INDEX_KEY_SLOT: (0, pool_slots(c.index_cache, m.page_size)),
        guards.INDEX_KEY_LENGTH: (1, index_len),
        guards.MLA_QUERY_SLOT: (0, pool_slots(c.mla_cache, m.page_size)),
        guards.MLA_QUERY_LENGTH: (1, mla_len),
        guards.INDEX_QUERY_LENGTH: (1, index_len),
        guards.DSA_INDEX_PAGE: (0, index_pages),
        guards.TOP_K_PAGE: (0, index_pages),
        guards.DCP_MERGE_POSITION: (0, positions),
        guards.DCP_MERGE_PAGE: (0, index_pages),
        guards.SPARSE_CORE_SLOT: (0, pool_slots(c.mla_cache, m.page_size)),
    }


class Kernels:
    """The compiled kernels of one rank, bound to its weights: one launcher per kernel, so
    a step, a benchmark or a test launches exactly what the step's graphs hold.

    Conventions of every launcher (B = `batch`; sizes for DeepSeek-V3.2, names from
    RankShape / ModelShape): a tensor argument is a CUDA tensor, contiguous and row-major
    in the shape given (a kernel gets only its base pointer and computes the rest from
    compile-time strides), 16-byte aligned (int32 and fp32 vectors read per element: 4);
    "[>= B, ...]" means the first B rows are read or written and the rest are untouched.
    Launches go on the current stream, chained with PDL when `pdl`; none synchronizes.
    The variant launched must have been compiled (`warm`) before a graph capture.
    `error`: the ErrorWord a kernel's range guards record an out-of-range id in (None: a
    word of the launcher's own per device, never read).
    """

    def __init__(self, shape: RankShape, weights: LayerWeights | None, pdl: bool = True):
        """weights: None for a caller that binds them per launch (`bind`). Raises ValueError
        for a shape some kernel is not written for (kernels/catalog.py check)."""
        from .kernels import catalog

        catalog.check(shape)
        self.shape, self.weights, self.pdl = shape, weights, pdl
        # The absorption reads W_UK with K (the nope dim) contiguous: a one-time transpose.
        self.w_uk_t = None if weights is None else weights.w_uk.transpose(1, 2).contiguous()
        self.eps = shape.model.rms_eps
        self._sinks: dict[torch.device, ErrorWord] = {}  # error words of launches given none
        self._stacked: dict[torch.device, torch.Tensor] = {}  # DcpMerge's offsets of stacked candidates
        self._sms: dict[torch.device | None, int] = {}  # sm_count per device, asked once
        self._splits: dict[tuple, object] = {}  # top_k_split's picks per (width, batch, device)

    def _error(self, error: ErrorWord | None, like: torch.Tensor) -> ErrorWord:
        """`error`, or this launcher's own word on `like`'s device (created at its first
        eager launch there, before any capture)."""
        if error is not None:
            return error
        if like.device not in self._sinks:
            self._sinks[like.device] = ErrorWord.new(like.device)
        return self._sinks[like.device]

    def bind(self, weights, w_uk_t: torch.Tensor | None = None) -> "Kernels":
        """These compiled kernels over other weights of the same shape, without a compile or
        a copy (graphstep.ops passes a layer's weights with each call). weights: an object
        with the LayerWeights fields the launches read; w_uk_t: W_UK with the nope dim
        contiguous (bf16 [heads, 512, 128]), for MlaQuery."""
        bound = copy.copy(self)
        bound.weights, bound.w_uk_t = weights, w_uk_t
        return bound

    def tiled(self, batch: int) -> bool:
        """Whether QueryNorm (alone or inside MlaQuery) runs its tiled variant at this batch."""
        return batch >= tiled_from(self.shape.heads)

    def mla_query_tokens(self, batch: int) -> int:
        """MlaQuery's project at this batch: the streamed kernel's token rows, or 0 (the
        register kernel; kernels/mla_query.py stream_tokens)."""
        from .kernels.mla_query import stream_tokens

        return stream_tokens(batch, self.shape.heads)

    def compiled(self, kernel: str, **choice):
        """The compiled variant of `kernel` for this rank and the launch-time `choice`
        (kernels/catalog.py build)."""
        from .kernels import catalog

        variant = catalog.build(self.shape, kernel, self.pdl, **choice)
        return catalog.compile_op(variant.op, variant.args)

    def top_k_split(self, width: int, batch: int, device=None):
        """The TopK variant the launcher uses for rows of `width` scores at this batch on
        `device` (its clusters resident there: `cluster_fits`; None: the H100 SXM / H200's)."""
        from .kernels.top_k import split_for

        key = (width, batch, device)
        if key not in self._splits:  # (an eager launch's host time: split_for and the probes once)
            self._splits[key] = split_for(width, batch, self._fits(device))
        return self._splits[key]

    def _fits(self, device):
        """top_k.split_for's predicate on `device` (None where every split fits: off CUDA)."""
        if not on_cuda(device):
            return None
        return lambda split: cluster_fits(device, split.ctas, split.per_sm)

    def sparse_core_plan(self, batch: int) -> int:
        """The slots per SparseCore CTA a launch of `batch` tokens uses."""
        from .kernels.sparse_core import plan

        s = self.shape
        return plan(batch, s.q_heads, s.model.index_topk, s.topology.mla_cache)

    def sparse_core_polls(self, batch: int, slots_per_cta: int | None = None, device=None) -> bool:
        """Whether a launch of `batch` tokens (at the plan's slots_per_cta unless given) on
        `device` may poll the mailbox (fork_poll): its partial CTAs, each of which may hold an SM
        while it spins, leave some of the device's SMs to the rows' publisher
        (sparse_core.may_poll; device None or not CUDA: the 132 SMs the kernels are tuned on)."""
        from .kernels import sparse_core

        spc = slots_per_cta or self.sparse_core_plan(batch)
        if device not in self._sms:
            self._sms[device] = sm_count(device)
        return sparse_core.may_poll(batch, self.shape.q_heads, self.shape.model.index_topk, spc, self._sms[device])

    def sparse_core_buffers(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """SparseCore's split partials for launches of up to `rows` tokens: (out [n, q_heads,
        512], (max, sum) [n, q_heads, 2]) fp32, n = the most (token, split) pairs a launch
        of 1 .. rows tokens makes."""
        from .kernels.sparse_core import partial_rows

        s = self.shape
        n = max(partial_rows(b, s.q_heads, s.model.index_topk, self.sparse_core_plan(b)) for b in range(1, rows + 1))
        return (
            torch.empty(n, s.q_heads, s.model.kv_lora_rank, device=device),
            torch.empty(n, s.q_heads, 2, device=device),
        )

    def variants(
        self, batches, width: int | None = None, polls=(False, True), group: bool = False, device=None
    ) -> list:
        """The catalog's variants this rank launches for steps of these batch sizes over block
        tables of `width` scores (None: every TopK split) on `device` (top_k_split); group: as a
        rank of a DCP group exchanging through peer memory."""
        from .kernels import catalog

        norms = sorted({self.tiled(b) for b in batches})
        widths = None if width is None else (width,)
        return catalog.variants(self.shape, self.pdl, batches, norms, widths, polls, group, self._fits(device))

    def warm(
        self, batches=range(1, 65), width: int | None = None, polls=(False, True), group: bool = False, device=None
    ) -> None:
        """Compile every variant `variants` lists (no launches); by default those of batches
        1 .. 64 with every TopK split. On a CUDA device also asks which TopK clusters it holds
        (`cluster_fits`), so no launch asks the driver, inside a capture or out."""
        from .kernels import catalog

        for variant in self.variants(batches, width, polls, group, device):
            catalog.compile_op(variant.op, variant.args)
        self._probe_clusters(device)

    def _probe_clusters(self, device) -> None:
        """cluster_fits for every TopK split on `device` (CUDA only), before any capture."""
        from .kernels.top_k import SPLITS

        if on_cuda(device):
            for split in SPLITS:
                cluster_fits(device, split.ctas, split.per_sm)

    # -- how a launch passes its arguments: CuTe DSL values (TvmFfiKernels: plain ones) --

    def _ptr(self, tensor: torch.Tensor, align: int = 16):
        return ptr(tensor, align)

    def _i32(self, value: int):
        from cutlass import Int32

        return Int32(value)

    def _i64(self, value: int):
        from cutlass import Int64

        return Int64(value)

    def _f32(self, value: float):
        from cutlass import Float32

        return Float32(value)

    def _stream(self):
        return current_stream()

    # -- launches on the current stream ------------------------------------------------

    def query_norm(self, qkv: torch.Tensor, qc: torch.Tensor, batch: int) -> None:
        """QueryNorm: the RMSNorm of q_a (gamma_q, rms_eps), the indexer's q_c on the main stream.

        qkv: bf16 [>= B, packed_width 2304], the packed projection rows (q_a = columns 0 .. 1535).
        qc: bf16 [>= B, q_lora_rank 1536], written; bit-identical to MlaQuery's own q_c.
        batch: B >= 1 (the row or tiled variant is chosen by `tiled(batch)`)."""
        self.compiled("query_norm", tiled=self.tiled(batch))(
            self._ptr(qkv),
            self._ptr(self.weights.gamma_q),
            self._ptr(qc),
            self._i32(batch),
            self._f32(self.eps),
            self._stream(),
        )

    def mla_query(
        self,
        qkv,
        context_lens,
        slots,
        qc,
        qc_private,
        workspace,
        q_rows,
        mla_cache,
        error: ErrorWord,
        batch: int,
        store_qc: bool,
        poll: bool,
        budget_ns: int = DEFAULT_BUDGET_NS,
        mailbox_offsets: torch.Tensor | None = None,
    ) -> None:
        """MlaQuery, three PDL-chained kernels: q_a RMSNorm, then Q_B with the kv_a RMSNorm,
        RoPE and the new tokens' MLA cache rows, then the W_UK absorption into this rank's
        query rows of the mailbox (polling every rank's rows first when `poll`).

        qkv: bf16 [>= B, packed_width 2304], the packed projection rows.
        context_lens: int32 [>= B], tokens per sequence over all ranks (RoPE position =
            context_lens - 1).
        slots: int32 [>= B], this rank's MLA cache slot of each new token (page x 64 +
            offset); -1 writes nothing.
        qc, qc_private: bf16 [>= B, q_lora_rank 1536]; the normalized q_a is written to `qc`
            (store_qc: it is the indexer's q_c, serial mode) or to `qc_private` (fork modes).
        workspace: fp32 [>= B, heads, qk_head_dim 192], Q_B's output (scratch).
        q_rows: uint8 [>= B, q_heads, 576 x q_bytes], the mailbox (armed: all 0xFF); this
            rank's head rows [rank x heads, (rank + 1) x heads) of each token are written as
            bf16 (q_bytes 2) or e4m3 (q_bytes 1) per Topology.q_format, in 16-byte chunks.
        mla_cache: the paged MLA cache, bf16 [pages, 64, 576] or uint8 [pages, 64, 656]
            (Topology.mla_cache; addressed as bytes).
        error: the ErrorWord a poll that gives up writes (token, row, chunk) to, and the range
            guards a slot outside the cache or a length outside [1, rope rows].
        batch: B >= 1. store_qc, poll: as above (poll: the fork_poll and serial DCP modes).
        budget_ns: how long a poll waits for one chunk before it gives up.
        mailbox_offsets: int64 [dcp] or None. In a DCP group, rank s's mailbox minus
            `q_rows` in bytes (0 for this rank; peer memory of this GPU or, over P2P, of
            another): the rows are stored into every rank's mailbox. None: `q_rows` only."""
        w = self.weights
        op = self.compiled(
            "mla_query",
            tiled=self.tiled(batch),
            poll=poll,
            remote=mailbox_offsets is not None,
            tokens=self.mla_query_tokens(batch),
        )
        op(
            self._ptr(qkv),
            self._ptr(w.gamma_q),
            self._ptr(w.gamma_kv),
            self._ptr(w.w_qb),
            self._ptr(self.w_uk_t),
            self._ptr(w.rope_cos),
            self._ptr(w.rope_sin),
            self._ptr(context_lens, 4),
            self._ptr(slots, 4),
            self._ptr(qc if store_qc else qc_private),
            self._ptr(workspace),
            self._ptr(q_rows),
            self._ptr(error.word.view(torch.int64) if mailbox_offsets is None else mailbox_offsets, 8),  # (unread)
            self._ptr(mla_cache.view(torch.uint8)),
            self._ptr(error.word, 8),
            self._i32(batch),
            self._f32(self.eps),
            self._i64(budget_ns),
            self._i32(pool_slots(mla_cache, self.shape.model.page_size)),
            self._i32(rope_rows(w.rope_cos, w.rope_sin)),
            self._stream(),
        )

    def query_wait(
        self, q_rows: torch.Tensor, error: ErrorWord, batch: int, budget_ns: int = DEFAULT_BUDGET_NS
    ) -> None:
        """QueryWait (DCP, fork mode): wait until every chunk of every rank's query rows of
        the B tokens has landed, recording the lowest one that never did in `error`.

        q_rows: uint8 [>= B, q_heads, 576 x q_bytes], the mailbox; head rows [0, gathered)
            of each token are polled (read only).
        error: the ErrorWord; batch: B >= 1; budget_ns: how long it waits for one chunk."""
        from .kernels.query_wait import grid_for

        op = self.compiled("query_wait")
        chunks = batch * self.shape.gathered * self.shape.mailbox_row_chunks
        op(
            self._ptr(q_rows),
            self._ptr(error.word, 8),
            self._i32(batch),
            self._i32(grid_for(chunks)),
            self._i64(budget_ns),
            self._stream(),
        )

    # -- the indexer --

    def index_key(self, qkv, context_lens, slots, index_cache, batch: int, error: ErrorWord | None = None) -> None:
        """IndexKey: the new tokens' indexer keys (LayerNorm, NeoX RoPE, the Hadamard rotation
        when ModelShape.index_rotation, e4m3 with a per-token scale) at their cache slots.

        qkv: bf16 [>= B, packed_width 2304], the packed projection rows (idx_k = columns
            2112 .. 2239).
        context_lens: int32 [>= B], tokens per sequence over all ranks (RoPE position =
            context_lens - 1).
        slots: int32 [>= B], this rank's cache slot of each new token; -1 writes nothing.
        index_cache: uint8 [pages, 64 x 132 = 8448]: per page 64 x 128 e4m3 keys, then 64
            fp32 scales (formats.index_cache_views).
        batch: B >= 1. error: records a slot outside the cache or a length outside [1, rope rows]."""
        keys, bounds = self._index_key_args(qkv, context_lens, slots, index_cache, error)
        self.compiled("index_key")(self._ptr(qkv), *keys, self._i32(batch), *bounds, self._stream())

    def key_and_query_norm(
        self, qkv, qc, context_lens, slots, index_cache, batch: int, error: ErrorWord | None = None
    ) -> None:
        """IndexKey and QueryNorm in one launch (kernels/key_and_norm.py): the arguments and
        outputs of index_key and query_norm, bit-identical to theirs."""
        keys, bounds = self._index_key_args(qkv, context_lens, slots, index_cache, error)
        self.compiled("key_and_norm", tiled=self.tiled(batch))(
            self._ptr(qkv),
            self._ptr(self.weights.gamma_q),
            self._ptr(qc),
            *keys,
            self._i32(batch),
            self._f32(self.eps),
            *bounds,
            self._stream(),
        )

    def _index_key_args(self, qkv, context_lens, slots, index_cache, error: ErrorWord | None) -> tuple:
        """IndexKey's part of a launch (index_key, key_and_query_norm): its weights, inputs,
        cache and error word, then its guards' bounds (cache slots, RoPE rows)."""
        w = self.weights
        keys = (
            self._ptr(w.index_norm_weight),
            self._ptr(w.index_norm_bias),
            self._ptr(w.index_rope_cos),
            self._ptr(w.index_rope_sin),
            self._ptr(context_lens, 4),
            self._ptr(slots, 4),
            self._ptr(index_cache),
            self._ptr(self._error(error, qkv).word, 8),
        )
        bounds = (
            self._i32(pool_slots(index_cache, self.shape.model.page_size)),
            self._i32(rope_rows(w.index_rope_cos, w.index_rope_sin)),
        )
        return keys, bounds

    def index_query(self, qc, qkv, context_lens, q_out, w_out, batch: int, error: ErrorWord | None = None) -> None:
        """IndexQuery: wq_b, NeoX RoPE, the Hadamard rotation (index_rotation), per-head e4m3
        quantization and the folded head weights, in one kernel. One launch of the variant
        that holds the batch; above 64 tokens, one per chunk of 64 (index_query.launches).
        The kernel reads wq_b and q_c by TMA: each launch's compiled host code encodes their
        tensor maps (a CUDA graph holds them by value, so a replay pays nothing).

        qc: bf16 [>= B, q_lora_rank 1536], QueryNorm's q_c (only the launch's B rows are
            in its tensor map).
        qkv: bf16 [>= B, packed_width 2304], the packed rows (idx_w = columns 2240 .. 2303,
            the head weights' logits).
        context_lens: int32 [>= B], tokens per sequence over all ranks (RoPE position =
            context_lens - 1).
        q_out: uint8 [>= B, index_heads 64, index_dim 128], the e4m3 queries, written.
        w_out: fp32 [>= B, index_heads 64], idx_w x heads^-0.5 x q_scale x dim^-0.5, written.
        batch: B >= 1. error: records a length outside [1, rope rows]."""
        from .kernels.index_query import launches

        w = self.weights
        word, rows_bound = self._error(error, qc).word, rope_rows(w.index_rope_cos, w.index_rope_sin)
        for start, rows, tokens in launches(batch):
            self.compiled("index_query", tokens=tokens)(
                self._ptr(qc[start:]),
                self._ptr(w.wq_b_index),
                self._ptr(qkv[start:]),
                self._ptr(w.index_rope_cos),
                self._ptr(w.index_rope_sin),
                self._ptr(context_lens[start:], 4),
                self._ptr(q_out[start:]),
                self._ptr(w_out[start:]),
                self._ptr(word, 8),
                self._i32(rows),
                self._i32(rows_bound),
                self._i32(start),
                self._stream(),
            )

    def dsa_index(
        self,
        q,
        head_w,
        index_cache,
        block_tables,
        context_lens,
        scores,
        batch: int,
        pages_per_cta: int | None = None,
        error: ErrorWord | None = None,
        ring: int | None = None,
    ) -> None:
        """DsaIndex: score[b, i] = k_scale[i] x sum_h w[b, h] x relu(q[b, h] . k[i]) for every
        local position i a block table holds; -inf at and past the local length.

        q: uint8 [>= B, index_heads 64, index_dim 128], IndexQuery's e4m3 queries.
        head_w: fp32 [>= B, index_heads 64], IndexQuery's head weights.
        index_cache: uint8 [pages, 8448], the paged indexer cache (see index_key).
        block_tables: int32 [>= B, pages_per_seq], local index i at page [b, i // 64]; its
            width (shape[1]) is the row stride and sets the scores' width.
        context_lens: int32 [>= B], tokens per sequence over all ranks (the local length
            under DCP is ceil((len - rank) / dcp)).
        scores: fp32 [>= B, pages_per_seq x 64], written.
        batch: B >= 1.
        pages_per_cta: the run of block-table pages each CTA streams, >= 1 (default: the
            host's choice for this batch and table width, `dsa_index.pages_per_cta`).
        error: records a page of the used part outside the cache (scored -inf).
        ring: the pages in flight per CTA, one of `dsa_index.RINGS` (default: the host's
            choice for this launch, `dsa_index.ring_for`)."""
        from .kernels.dsa_index import RINGS, ring_for
        from .kernels.dsa_index import pages_per_cta as choose  # (the argument has its name)

        pages = block_tables.shape[1]
        run = choose(batch, pages) if pages_per_cta is None else pages_per_cta
        if run < 1:
            raise ValueError(f"pages_per_cta must be >= 1, got {run}")
        ring = ring_for(batch, pages, run) if ring is None else ring
        if ring not in RINGS:
            raise ValueError(f"ring must be one of {RINGS}, got {ring}")
        self.compiled("dsa_index", stages=ring)(
            self._ptr(q),
            self._ptr(head_w),
            self._ptr(index_cache),
            self._ptr(block_tables, 4),
            self._ptr(context_lens, 4),
            self._ptr(scores, 4),
            self._i32(batch),
            self._i32(pages),
            self._i32(run),
            self._ptr(self._error(error, q).word, 8),
            self._i32(min(index_cache.shape[0], INT32_MAX)),
            self._stream(),
        )

    def top_k(
        self,
        scores,
        block_tables,
        context_lens,
        out,
        out_scores,
        batch: int,
        split="auto",
        error: ErrorWord | None = None,
        pool_pages: int = INT32_MAX,
    ) -> None:
        """TopK: the index_topk (2048) best of each row of DsaIndex's scores, in ascending
        position, equal scores to the lower position first, -1 padded.

        scores: fp32 [>= B, pages_per_seq x 64], DsaIndex's (-inf past the local length).
        block_tables: int32 [>= B, pages_per_seq], maps the chosen positions to cache slots.
        context_lens: int32 [>= B], tokens per sequence over all ranks.
        out: int32 [>= B, topk], written: cache slots, or under DCP this rank's candidates as
            global positions (local x dcp + rank).
        out_scores: fp32 [>= B, topk], under DCP the candidates' scores (-inf padded);
            unread and unwritten otherwise (pass any fp32 CUDA tensor).
        batch: B >= 1.
        split: "auto" (top_k_split's choice for the block table's width and this batch), a
            top_k.Split that holds rows of the table's width, or None (one CTA per row).
        error, pool_pages: a kept position whose page is outside [0, pool_pages) (the
            indexer cache's pages) becomes slot -1, recorded in `error`."""
        width = block_tables.shape[1] * self.shape.model.page_size
        if isinstance(split, str):
            if split != "auto":
                raise ValueError(f"split must be 'auto', a Split or None, got {split!r}")
            split = self.top_k_split(width, batch, scores.device)
        elif split is not None and split.capacity < width:
            raise ValueError(f"TopK split {split.name} holds rows of up to {split.capacity} scores, not {width}")
        self.compiled("top_k", split=split)(
            self._ptr(scores),
            self._ptr(block_tables, 4),
            self._ptr(context_lens, 4),
            self._ptr(out, 4),
            self._ptr(out_scores, 4),
            self._i32(batch),
            self._i32(block_tables.shape[1]),
            self._ptr(self._error(error, scores).word, 8),
            self._i32(min(pool_pages, INT32_MAX)),
            self._stream(),
        )

    def dcp_merge(
        self,
        own_positions,
        own_scores,
        peer_positions,
        peer_scores,
        block_tables,
        out,
        batch: int,
        error: ErrorWord | None = None,
        pool_pages: int = INT32_MAX,
        peer_offsets: torch.Tensor | None = None,
        token_stride: int | None = None,
    ) -> None:
        """DcpMerge (DCP): every rank's candidates -> this rank's share of the global top-k
        (the same set the index_topk best over all ranks would be) as local cache slots.

        own_positions: int32 [>= B, topk], TopK's global positions (ascending, -1 padded).
        own_scores: fp32 [>= B, topk], their scores (-inf padded).
        peer_positions: int32, every rank's candidates: [>= B, dcp, topk] (this rank's row
            [:, rank] is not read), or, with peer_offsets, where rank r's [>= B, topk] list
            lies peer_offsets[r] bytes away (a DCP group: the peers' own TopK outputs).
        peer_scores: fp32, their scores, laid out alike.
        peer_offsets, token_stride: int64 [dcp] or None: rank r's lists start peer_offsets[r] bytes from
            peer_positions / peer_scores, token_stride elements apart per token (None: the
            [>= B, dcp, topk] layout, offsets r x topk x 4 and stride dcp x topk). Multiples of
            16 bytes and of 4 elements. The offsets are read before the PDL wait: set up once,
            never written by the kernel launched before this one.
        block_tables: int32 [>= B, pages_per_seq], maps this rank's local indices to slots.
        out: int32 [>= B, topk], written: this rank's slots, compacted to the front, -1 padded.
        batch: B >= 1.
        error, pool_pages: a kept candidate past the block table or whose page is outside
            [0, pool_pages) becomes slot -1, recorded in `error`."""
        k, dcp = self.shape.model.index_topk, self.shape.topology.dcp
        if peer_offsets is None:
            peer_offsets, token_stride = self.stacked_offsets(peer_positions.device), dcp * k
        if token_stride % 4:
            raise ValueError(f"DcpMerge reads 16-byte vectors: token_stride {token_stride} must be a multiple of 4")
        self.compiled("dcp_merge")(
            self._ptr(own_positions),  # the candidate lists: 16-byte vectors
            self._ptr(own_scores),
            self._ptr(peer_positions),
            self._ptr(peer_scores),
            self._ptr(block_tables, 4),
            self._ptr(out, 4),
            self._i32(batch),
            self._i32(block_tables.shape[1]),
            self._ptr(self._error(error, out).word, 8),
            self._i32(min(pool_pages, INT32_MAX)),
            self._ptr(peer_offsets, 8),
            self._i32(token_stride),
            self._stream(),
        )

    def stacked_offsets(self, device) -> torch.Tensor:
        """DcpMerge's peer_offsets for candidates stacked [B, dcp, topk]: r x topk x 4 bytes
        (made at the first call per device: before any capture, as warm() and the step's
        transports do)."""
        device = torch.device(device)
        if device not in self._stacked:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("DcpMerge's stacked offsets are made eagerly: launch it once before a capture")
            k, dcp = self.shape.model.index_topk, self.shape.topology.dcp
            # a host copy, not a kernel: DcpMerge reads the offsets before its PDL wait
            self._stacked[device] = torch.tensor([r * k * 4 for r in range(dcp)], dtype=torch.int64, device=device)
        return self._stacked[device]

    def candidate_sync(
        self, flags: torch.Tensor, offsets: torch.Tensor, error: ErrorWord, budget_ns: int = DEFAULT_BUDGET_NS
    ) -> None:
        """CandidateSync (a DCP group, after TopK): this rank's flag set in every other rank's
        `flags`, then a bounded wait for every other rank's flag in its own, re-armed to 0.

        flags: int32 [>= dcp], this rank's flags of the step's parity (word s: rank s's
            candidates are complete); rank s's flags lie offsets[s] bytes away.
        offsets: int64 [dcp], rank s's exchange memory minus this rank's, in bytes.
        error, budget_ns: a rank whose flag never came within budget_ns is recorded in
            error's words 4-5 (the lowest such rank) and the kernel exits."""
        self.compiled("candidate_sync")(
            self._ptr(flags, 4), self._ptr(offsets, 8), self._ptr(error.word, 8), self._i64(budget_ns), self._stream()
        )

    def sparse_core(
        self,
        q_rows,
        slots,
        mla_cache,
        partial_o,
        partial_ml,
        out,
        lse,
        batch: int,
        slots_per_cta: int | None = None,
        q_out=None,
        error: ErrorWord | None = None,
        poll_budget_ns: int | None = None,
    ) -> None:
        """SparseCore: sparse MLA decode of every gathered query row over its token's selected
        MLA cache rows (online softmax, split over CTAs by the plan, then a combine).

        q_rows: uint8 [>= B, q_heads, 576 x q_bytes], the mailbox; head rows [0, gathered)
            of each token are read (bf16 or e4m3 per Topology.q_format).
        slots: int32 [>= B, topk], this rank's cache slots to attend (-1: none).
        mla_cache: bf16 [pages, 64, 576] or uint8 [pages, 64, 656] (Topology.mla_cache).
        partial_o: fp32 [n, q_heads, kv_lora_rank 512], partial_ml: fp32 [n, q_heads, 2]
            (max, sum): the splits' partials, n >= B x topk / slots_per_cta when a token
            is split (sparse_core_buffers allocates them for the plan).
        out: fp32 [>= B, gathered, kv_lora_rank 512], written: attention in latent space
            (before W_UV).
        lse: fp32 [>= B, gathered], written: natural-log log-sum-exp of the scaled scores
            (-inf and out 0 for a token with no slot).
        batch: B >= 1.
        slots_per_cta: the plan's choice (`sparse_core_plan`) unless given (benchmarks
            sweep it).
        q_out: uint8 [>= B, gathered, 576 x q_bytes] or None. Given (the step's launch), the
            rows read are copied there and re-armed (0xFF) in q_rows once every reader of
            them is done; None leaves q_rows as it was.
        error: records a slot outside the cache (read as -1: a hole), and a query row chunk
            still unpublished when a poll gives up.
        poll_budget_ns: None, or each CTA first waits (before its PDL wait) until the query rows
            it reads are published in q_rows, each chunk for at most this long (the step's
            fork_poll on one rank: MlaQuery writes them on the side stream, joined after this
            launch); only where `sparse_core_polls(batch, slots_per_cta)`."""
        from .kernels.sparse_core import partial_rows

        spc = slots_per_cta or self.sparse_core_plan(batch)
        needed = partial_rows(batch, self.shape.q_heads, self.shape.model.index_topk, spc)
        if partial_o.shape[0] < needed or partial_ml.shape[0] < needed:
            raise ValueError(
                f"SparseCore partials hold {partial_o.shape[0]} rows, a launch of {batch} tokens at "
                f"{spc} slots per CTA needs {needed}"
            )
        if q_out is not None and (
            q_out.dtype != torch.uint8
            or q_out.shape[0] < batch
            or tuple(q_out.shape[1:]) != (self.shape.gathered, q_rows.shape[-1])
        ):
            raise ValueError(
                f"SparseCore q_out must be uint8 [>= {batch}, {self.shape.gathered}, {q_rows.shape[-1]}], "
                f"got {q_out.dtype} {tuple(q_out.shape)}"
            )
        poll = poll_budget_ns is not None
        if poll and not self.sparse_core_polls(batch, spc, q_rows.device):
            raise ValueError(
                f"SparseCore: a polling launch of {batch} tokens at {spc} slots per CTA would have more partial "
                f"CTAs than may spin beside the rows' publisher on {sm_count(q_rows.device)} SMs "
                "(sparse_core.may_poll)"
            )
        self.compiled("sparse_core", slots=spc, publish=q_out is not None, poll=poll)(
            self._ptr(q_rows),
            self._ptr(slots),
            self._ptr(mla_cache.view(torch.uint8)),
            self._ptr(partial_o),
            self._ptr(partial_ml, 8),
            self._ptr(out),
            self._ptr(lse, 4),
            self._ptr(q_rows if q_out is None else q_out),  # (unread without q_out)
            self._i32(batch),
            self._ptr(self._error(error, slots).word, 8),
            self._i32(pool_slots(mla_cache, self.shape.model.page_size)),
            self._i64(poll_budget_ns if poll else 0),
            self._stream(),
        )


def tvm_ffi_available() -> bool:
    """Whether apache-tvm-ffi is installed (the `ffi` extra), which TvmFfiKernels needs."""
    import importlib.util

    return importlib.util.find_spec("tvm_ffi") is not None


def compile_tvm_ffi(variant, arch: str | None = None):
    """`variant` (a kernels/catalog.py Variant) compiled with CuTe DSL's TVM-FFI ABI: its
    pointers, scalars and stream become plain ints and floats at the call."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    options = (cute.EnableTVMFFI,) if arch is None else (cute.EnableTVMFFI, cute.GPUArch(arch))
    return cute.compile[options](variant.op, *variant.args, make_fake_stream())


class TvmFfiKernels(Kernels):
    """Kernels whose launches go through CuTe DSL's TVM-FFI ABI: a launch passes each tensor's
    data_ptr(), Python ints and floats and the stream's handle to one C call, and finds its
    function in a dict, instead of wrapping each argument in a CuTe DSL value and building
    the catalog's variant (the host time of an eager call; a graph replay has none).

    A kernel's module loads on its first launch, not at compile: before a graph capture,
    launch every variant it holds once (`warm` only compiles)."""

    def __init__(self, shape: RankShape, weights: LayerWeights | None, pdl: bool = True):
        super().__init__(shape, weights, pdl)
        self._by_choice: dict[tuple, object] = {}  # (kernel, choice) -> the C function
        self._by_variant: dict[str, tuple] = {}  # variant name -> (compiled function, its C function)

    def _function(self, variant):
        if variant.name not in self._by_variant:
            compiled = compile_tvm_ffi(variant)
            # the compiled function owns the module; its tvm_ffi.Function (where it wraps one)
            # takes positional arguments without the Python kwargs wrapper
            raw = compiled.__tvm_ffi_object__() if hasattr(compiled, "__tvm_ffi_object__") else compiled
            self._by_variant[variant.name] = (compiled, raw)
        return self._by_variant[variant.name][1]

    def compiled(self, kernel: str, **choice):
        key = (kernel, tuple(sorted(choice.items())))
        function = self._by_choice.get(key)
        if function is None:
            from .kernels import catalog

            function = self._by_choice[key] = self._function(catalog.build(self.shape, kernel, self.pdl, **choice))
        return function

    def warm(
        self, batches=range(1, 65), width: int | None = None, polls=(False, True), group: bool = False, device=None
    ) -> None:
        for variant in self.variants(batches, width, polls, group, device):
            self._function(variant)
        self._probe_clusters(device)

    def _ptr(self, tensor: torch.Tensor, align: int = 16) -> int:
        return checked_address(tensor, align)

    def _i32(self, value: int) -> int:
        return value

    _i64 = _i32

    def _f32(self, value: float) -> float:
        return value

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream
