"""Host side of the CuTe DSL kernels: torch tensors in, launches on the current stream.

`Kernels` binds the compiled kernels of one RankShape to a state's weights; every op comes
from kernels/catalog.py. Compile every variant of the capture sizes with `warm(sizes, width)`
before any graph capture: a module load inside capture fails. `TvmFfiKernels` launches the
same kernels through CuTe DSL's TVM-FFI ABI, for callers that pay the host time of each
eager call (graphstep.ops); its modules load at their first launch instead.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .shapes import RankShape, tiled_from
from .state import LayerWeights

INT32_MAX = 2**31 - 1
DEFAULT_BUDGET_NS = 200_000_000  # 200 ms: far beyond any healthy publish, far below a hang


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.uint8: cutlass.Uint8,
    }
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"no kernel pointer type for {dtype}") from None


def ptr(tensor: torch.Tensor, align: int = 16):
    """A global pointer to a CUDA tensor's first element."""
    from .kernels.primitives import gmem_ptr

    if not tensor.is_cuda:
        raise ValueError(f"kernel arguments must be CUDA tensors, got one on {tensor.device}")
    if tensor.data_ptr() % align:
        raise ValueError(f"kernel argument at {tensor.data_ptr():#x} is not {align}-byte aligned")
    return gmem_ptr(_cutlass_dtype(tensor.dtype), tensor.data_ptr(), align)


def current_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class MailboxTimeout(RuntimeError):
    """A mailbox chunk never landed within QueryWait's budget."""

    def __init__(self, token: int, row: int, chunk: int):
        super().__init__(
            f"DCP mailbox: token {token}, head row {row}, chunk {chunk} was never published "
            f"(QueryWait gave up after its budget; the step's outputs are invalid)"
        )
        self.token, self.row, self.chunk = token, row, chunk


@dataclass
class ErrorWord:
    """int32 [2] on the device: (flag, lowest missing linear chunk index)."""

    word: torch.Tensor

    @classmethod
    def new(cls, device) -> "ErrorWord":
        return cls(torch.tensor([0, INT32_MAX], dtype=torch.int32, device=device))

    def reset(self) -> None:
        self.word.copy_(torch.tensor([0, INT32_MAX], dtype=torch.int32))

    def check(self, gathered: int, row_chunks: int) -> None:
        """Raise MailboxTimeout if a poll gave up (synchronizes with the device), then re-arm."""
        flag, index = self.word.tolist()
        if flag:
            self.reset()
            token, rest = divmod(index, gathered * row_chunks)
            raise MailboxTimeout(token, rest // row_chunks, rest % row_chunks)


class Kernels:
    """The compiled kernels of one rank, bound to its weights."""

    def __init__(self, shape: RankShape, weights: LayerWeights | None, pdl: bool = True):
        """weights: None for a caller that binds them per launch (`bind`). Raises ValueError
        for a shape some kernel is not written for (kernels/catalog.py check)."""
        from .kernels import catalog

        catalog.check(shape)
        self.shape, self.weights, self.pdl = shape, weights, pdl
        # The absorption reads W_UK with K (the nope dim) contiguous: a one-time transpose.
        self.w_uk_t = None if weights is None else weights.w_uk.transpose(1, 2).contiguous()
        self.eps = shape.model.rms_eps

    def bind(self, weights, w_uk_t: torch.Tensor | None = None) -> "Kernels":
        """These compiled kernels over other weights of the same shape, without a compile or
        a copy (graphstep.ops passes a layer's weights with each call). weights: an object
        with the LayerWeights fields the launches read; w_uk_t: W_UK with the nope dim
        contiguous (bf16 [heads, 512, 128]), for MlaQuery."""
        bound = copy.copy(self)
        bound.weights, bound.w_uk_t = weights, w_uk_t
        return bound

    def tiled(self, batch: int) -> bool:
        return batch >= tiled_from(self.shape.heads)

    def compiled(self, kernel: str, **choice):
        """The compiled variant of `kernel` for this rank and the launch-time `choice`
        (kernels/catalog.py build)."""
        from .kernels import catalog

        variant = catalog.build(self.shape, kernel, self.pdl, **choice)
        return catalog.compile_op(variant.op, variant.args)

    def top_k_split(self, width: int, batch: int):
        """The TopK variant the launcher uses for rows of `width` scores at this batch."""
        from .kernels.top_k import split_for

        return split_for(width, batch)

    def sparse_core_plan(self, batch: int) -> int:
        """The slots per SparseCore CTA a launch of `batch` tokens uses."""
        from .kernels.sparse_core import plan

        return plan(batch, self.shape.q_heads, self.shape.model.index_topk)

    def sparse_core_buffers(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """SparseCore's split partials for launches of up to `rows` tokens: (out [n, q_heads,
        512], (max, sum) [n, q_heads, 2]) fp32, n = the most (token, split) pairs a launch
        of 1 .. rows tokens makes."""
        from .kernels.sparse_core import partial_rows

        s = self.shape
        n = max(partial_rows(b, s.q_heads, s.model.index_topk) for b in range(1, rows + 1))
        return (
            torch.empty(n, s.q_heads, s.model.kv_lora_rank, device=device),
            torch.empty(n, s.q_heads, 2, device=device),
        )

    def variants(self, batches, width: int | None = None, polls=(False, True)) -> list:
        """The catalog's variants this rank launches for steps of these batch sizes over block
        tables of `width` scores (None: every TopK split)."""
        from .kernels import catalog

        norms = sorted({self.tiled(b) for b in batches})
        widths = None if width is None else (width,)
        return catalog.variants(self.shape, self.pdl, batches, norms, widths, polls)

    def warm(self, batches=range(1, 65), width: int | None = None, polls=(False, True)) -> None:
        """Compile every variant `variants` lists (no launches); by default those of batches
        1 .. 64 with every TopK split."""
        from .kernels import catalog

        for variant in self.variants(batches, width, polls):
            catalog.compile_op(variant.op, variant.args)

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
    ) -> None:
        """MlaQuery normalizes q_a into `qc` (the indexer's q_c, store_qc) or `qc_private`
        (both bf16 [>= batch, 1536]) and reads it from there. q_rows: the uint8 query-row
        buffer / mailbox [>= batch, q_heads, 576 x q_bytes]; workspace: fp32
        [>= batch, heads, 192]; mla_cache: the MLA cache (any dtype, addressed as bytes)."""
        w = self.weights
        op = self.compiled("mla_query", tiled=self.tiled(batch), poll=poll)
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
            self._ptr(mla_cache.view(torch.uint8)),
            self._ptr(error.word, 8),
            self._i32(batch),
            self._f32(self.eps),
            self._i64(budget_ns),
            self._stream(),
        )

    def query_wait(
        self, q_rows: torch.Tensor, error: ErrorWord, batch: int, budget_ns: int = DEFAULT_BUDGET_NS
    ) -> None:
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

    def index_key(self, qkv, context_lens, slots, index_cache, batch: int) -> None:
        """The new tokens' indexer keys (LayerNorm, RoPE, e4m3) at their slots of the
        paged indexer cache (uint8 [pages, 8448]); slot -1 writes nothing."""
        w = self.weights
        self.compiled("index_key")(
            self._ptr(qkv),
            self._ptr(w.index_norm_weight),
            self._ptr(w.index_norm_bias),
            self._ptr(w.index_rope_cos),
            self._ptr(w.index_rope_sin),
            self._ptr(context_lens, 4),
            self._ptr(slots, 4),
            self._ptr(index_cache),
            self._i32(batch),
            self._stream(),
        )

    def index_query(self, qc, qkv, context_lens, q_out, w_out, batch: int) -> None:
        """wq_b + RoPE + e4m3 quantization + head weights in one kernel: q_out uint8
        [>= batch, 64, 128], w_out fp32 [>= batch, 64]. One launch of the variant that holds
        the batch; above 64 tokens, one per chunk of 64 (kernels/index_query.py launches)."""
        from .kernels.index_query import launches

        w = self.weights
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
                self._i32(rows),
                self._stream(),
            )

    def dsa_index(
        self, q, head_w, index_cache, block_tables, context_lens, scores, batch: int, pages_per_cta: int | None = None
    ) -> None:
        """scores fp32 [>= batch, pages_per_seq x 64]: every local position scored or -inf.
        pages_per_cta: the run of block-table pages each CTA streams (default: the host's
        choice for this batch and table width, `dsa_index.pages_per_cta`)."""
        from .kernels.dsa_index import pages_per_cta as choose

        pages = block_tables.shape[1]
        run = choose(batch, pages) if pages_per_cta is None else pages_per_cta
        if run < 1:
            raise ValueError(f"pages_per_cta must be >= 1, got {run}")
        self.compiled("dsa_index")(
            self._ptr(q),
            self._ptr(head_w),
            self._ptr(index_cache),
            self._ptr(block_tables, 4),
            self._ptr(context_lens, 4),
            self._ptr(scores, 4),
            self._i32(batch),
            self._i32(pages),
            self._i32(run),
            self._stream(),
        )

    def top_k(self, scores, block_tables, context_lens, out, out_scores, batch: int, split="auto") -> None:
        """The index_topk best of each row of DsaIndex's scores, in ascending position:
        out int32 [>= batch, topk] cache slots, or under DCP this rank's candidates (global
        positions in out, their scores in out_scores fp32 [>= batch, topk]; unused
        otherwise, pass any fp32 CUDA tensor). split: "auto" (top_k_split's choice for the
        block table's width and this batch), a top_k.Split, or None (one CTA per row)."""
        width = block_tables.shape[1] * self.shape.model.page_size
        if isinstance(split, str):
            if split != "auto":
                raise ValueError(f"split must be 'auto', a Split or None, got {split!r}")
            split = self.top_k_split(width, batch)
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
            self._stream(),
        )

    def dcp_merge(self, own_positions, own_scores, peer_positions, peer_scores, block_tables, out, batch: int) -> None:
        """DCP: this rank's candidates (TopK's, [>= batch, topk]) and every rank's
        (peer_*, [>= batch, dcp, topk]; this rank's row unused) -> out int32 [>= batch,
        topk]: this rank's share of the global top-k as local cache slots, -1 padded."""
        self.compiled("dcp_merge")(
            self._ptr(own_positions, 4),
            self._ptr(own_scores, 4),
            self._ptr(peer_positions, 4),
            self._ptr(peer_scores, 4),
            self._ptr(block_tables, 4),
            self._ptr(out, 4),
            self._i32(batch),
            self._i32(block_tables.shape[1]),
            self._stream(),
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
    ) -> None:
        """Sparse MLA decode: q_rows the mailbox / query rows (uint8 [>= batch, q_heads,
        576 x q_bytes]), slots int32 [>= batch, topk] (-1: none; 16-byte aligned) -> out fp32 [>= batch,
        gathered, 512], lse fp32 [>= batch, gathered]; partials from sparse_core_buffers.
        slots_per_cta: the plan's choice unless given (benchmarks sweep it; the partials
        must then hold batch x topk / slots_per_cta rows). q_out (uint8 [>= batch, gathered,
        576 x q_bytes]): the step's publish -- the rows read are copied there and re-armed
        (0xFF) in q_rows once every reader is done; None leaves q_rows as it was."""
        spc = slots_per_cta or self.sparse_core_plan(batch)
        k = self.shape.model.index_topk
        needed = batch * k // spc if spc < k else 0  # one split: no partials
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
        self.compiled("sparse_core", slots=spc, publish=q_out is not None)(
            self._ptr(q_rows),
            self._ptr(slots),
            self._ptr(mla_cache.view(torch.uint8)),
            self._ptr(partial_o),
            self._ptr(partial_ml, 8),
            self._ptr(out),
            self._ptr(lse, 4),
            self._ptr(q_rows if q_out is None else q_out),  # (unread without q_out)
            self._i32(batch),
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

    def warm(self, batches=range(1, 65), width: int | None = None, polls=(False, True)) -> None:
        for variant in self.variants(batches, width, polls):
            self._function(variant)

    def _ptr(self, tensor: torch.Tensor, align: int = 16) -> int:
        if not tensor.is_cuda:
            raise ValueError(f"kernel arguments must be CUDA tensors, got one on {tensor.device}")
        address = tensor.data_ptr()
        if address % align:
            raise ValueError(f"kernel argument at {address:#x} is not {align}-byte aligned")
        return address

    def _i32(self, value: int) -> int:
        return value

    _i64 = _i32

    def _f32(self, value: float) -> float:
        return value

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream
