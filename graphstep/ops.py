"""The CuTe DSL kernels as torch ops (`torch.ops.graphstep.*`), for code outside the step.

Each op launches one kernel (graphstep.launch) on the current stream and has a fake
implementation, so torch.compile traces it (fullgraph) and a user's own CUDA graph captures
it. An op takes tensors and the configuration as plain values: `shape`, the string
`shape_key(RankShape)` (every size and format the kernels compile in), and `pdl` (launch
with Programmatic Dependent Launch: harmless after a kernel that does not trigger it). The
weights are tensor arguments (a layer's LayerWeights fields), so one compiled kernel serves
every layer. B, the batch, is the first dim of the token-indexed inputs; every tensor is
contiguous, on one CUDA device, 16-byte aligned.

Eager calls go through CuTe DSL's TVM-FFI ABI where apache-tvm-ffi is installed (the `ffi`
extra; launch.TvmFfiKernels), else through its own calling path (launch.Kernels). A kernel
variant compiles on its first call (`warm(shape, batches, width)` compiles them ahead), and
a module load inside a graph capture fails: under TVM-FFI a module loads at its first
launch, so run each op once eagerly at every batch size before capturing it (the warm-up
torch.cuda.graph asks for anyway).

Outputs are new tensors; caches the kernels write in place (the MLA and indexer caches,
the query-row mailbox, the error word) are declared in `mutates_args`. Byte formats
(docs/design.md §3, graphstep.formats):
  query rows / mailbox: uint8 [rows, q_heads, 576 x q_bytes], per head row the absorbed
      latent 512 then the roped 64, bf16 (q_bytes 2) or e4m3 (q_bytes 1, Topology
      q_format "fp8"); armed rows hold 0xFF bytes until published.
  MLA cache: bf16 [pages, 64, 576], or uint8 [pages, 64, 656] (mla_cache "fp8": e4m3
      latent 512, 4 fp32 scales, bf16 rope 64).
  indexer cache: uint8 [pages, 64 x 132]: a page's 64 e4m3 keys of 128, then their 64 fp32
      scales.
  slots: cache slot = page x 64 + offset, -1 for none.

Range guards: every op that addresses memory with a slot, a block-table page or a RoPE row
at context_lens - 1 holds it to the tensors' bounds (an out-of-range id writes nothing, is
read as a hole, or reads RoPE row 0) and records (check, token, value) in `error`, an
int32 [4] error word, or launch.ErrorWord's [6] (`ErrorWord.new(device).word`; the ops
write words 0-3 only; `ErrorWord(error).check(...)` raises InputRangeError). Every op that
guards takes `error` as a required argument, just before `shape`: an optional mutated
argument trips torch's in-place view tracking (ADInplaceOrView) when a caller leaves it
out."""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import lru_cache
from types import SimpleNamespace

import torch
from torch import Tensor

from .launch import DEFAULT_BUDGET_NS, INT32_MAX, ErrorWord, Kernels, TvmFfiKernels, check_budget, tvm_ffi_available
from .shapes import ModelShape, RankShape, RopeScaling, Topology

BF16, FP32, I32, U8 = torch.bfloat16, torch.float32, torch.int32, torch.uint8
ANY = None  # a dim check_args does not hold to a size


def _error_arg(error):
    """check_args' spec of an `error` argument: int32 [4], or a whole ErrorWord's [6]."""
    words = error.numel() if isinstance(error, Tensor) and error.dim() == 1 and error.numel() == 6 else 4
    return (error, I32, (words,))


def shape_key(shape: RankShape) -> str:
    """The `shape` argument of every op: the RankShape as canonical JSON."""
    return json.dumps(asdict(shape), sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=None)
def rank_shape(key: str) -> RankShape:
    """The RankShape `shape_key` wrote."""
    try:
        fields = json.loads(key)
        model = dict(fields["model"])
        scaling = model.pop("rope_scaling")
        model["assumed"] = tuple(model["assumed"])
        rope = None if scaling is None else RopeScaling(**scaling)
        return RankShape(ModelShape(**model, rope_scaling=rope), Topology(**fields["topology"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"shape must be graphstep.ops.shape_key(RankShape), got {key[:80]!r}: {e}") from None


@lru_cache(maxsize=None)
def _kernels(key: str, pdl: bool) -> Kernels:
    """The launcher of the ops: through TVM-FFI where apache-tvm-ffi is installed (a few us of
    host time a call), else CuTe DSL's own calling path."""
    launcher = TvmFfiKernels if tvm_ffi_available() else Kernels
    return launcher(rank_shape(key), None, pdl)


def _launcher(op: str, key: str, pdl: bool, device: torch.device) -> Kernels:
    """The cached kernels of `key`, for arguments on `device` (check_args held them to one)."""
    if device.type != "cuda":
        raise ValueError(f"graphstep.{op}: the kernels run on CUDA tensors, got tensors on {device}")
    if device.index != torch.cuda.current_device():
        raise ValueError(
            f"graphstep.{op}: the tensors are on {device}, the current device is cuda:{torch.cuda.current_device()} "
            f"(the kernels launch on the current device: torch.cuda.set_device)"
        )
    return _kernels(key, pdl)


_LIBRARY = torch.library.Library("graphstep", "DEF")


class _Op:
    """A registered op: calling it dispatches torch.ops.graphstep.<name>."""

    def __init__(self, name: str, impl):
        self.name, self.__doc__ = name, impl.__doc__
        self.packet = getattr(torch.ops.graphstep, name)

    def __call__(self, *args, **kwargs):
        return self.packet(*args, **kwargs)

    def register_fake(self, fake):
        torch.library.register_fake(f"graphstep::{self.name}", fake, lib=_LIBRARY)
        return fake


def _op(name: str, mutates_args: tuple[str, ...]):
    """Define graphstep::<name> with the schema of the decorated function's annotations and
    register it as the op's kernel for every device (the real implementations refuse all
    but CUDA tensors). A plain torch.library definition, not torch.library.custom_op: the
    custom_op's autograd and aliasing layers cost about 10 us of host time per eager call."""

    def define(impl) -> _Op:
        _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=mutates_args))
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        return _Op(name, impl)

    return define


def warm(shape: RankShape, batches=range(1, 65), width: int | None = None, pdl: bool = True, device=None) -> None:
    """Compile every kernel variant the ops launch for these batch sizes over block tables of
    `width` scores (None: every TopK split) on `device` (None: the current CUDA device, if
    any: TopK's picks are the splits whose clusters it holds), so that a graph capture
    compiles nothing. Under TVM-FFI a module still loads at its first launch: run each op once
    eagerly at every batch size before capturing it (the module docstring)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    _kernels(shape_key(shape), pdl).warm(batches, width, device=device)


def check_args(op: str, **args) -> None:
    """args: name=(tensor, dtype, shape), ANY in a shape for a free dim; raise ValueError
    naming graphstep.<op> and the argument. All tensors on one device, contiguous. (The
    dispatcher has already refused what is not a tensor.) The messages are built only on a
    failure: this runs on every eager call."""
    device = None
    for name, (tensor, dtype, dims) in args.items():
        shape = tensor.shape
        ok = tensor.dtype == dtype and len(shape) == len(dims)
        if ok:
            for d, n in zip(dims, shape):  # a plain loop: a generator costs ~0.5 us an argument
                if d is not ANY and d != n:
                    ok = False
                    break
        if not ok:
            expect = "[" + ", ".join("*" if d is ANY else str(d) for d in dims) + "]"
            raise ValueError(f"graphstep.{op}: {name} must be {dtype} {expect}, got {tensor.dtype} {list(shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"graphstep.{op}: {name} must be contiguous")
        # a view at an offset (the allocator's own blocks are aligned); fake tensors have one too
        if tensor.storage_offset() * tensor.element_size() % 16:
            raise ValueError(
                f"graphstep.{op}: {name} must be 16-byte aligned, got a view {tensor.storage_offset()} elements in"
            )
        if device is None:
            device = tensor.device
        elif tensor.device != device:
            raise ValueError(f"graphstep.{op}: {name} is on {tensor.device}, the other arguments on {device}")


def _batch(op: str, tensor: Tensor) -> int:
    """B, the rows of a token-indexed argument: a launch of none would be an empty grid."""
    if tensor.dim() == 0:
        raise ValueError(f"graphstep.{op}: the token-indexed arguments have a batch dim [B, ...], got a 0-d tensor")
    if tensor.shape[0] == 0:
        raise ValueError(f"graphstep.{op}: the batch is empty (no launch of 0 tokens)")
    return tensor.shape[0]


def _at_least(op: str, name: str, tensor: Tensor, rows: int) -> None:
    if tensor.shape[0] < rows:
        raise ValueError(f"graphstep.{op}: {name} holds {tensor.shape[0]} rows, the batch is {rows}")


def _rope_table(op: str, cos: Tensor, sin: Tensor) -> None:
    """A RoPE table needs a row 0: a kernel reads it for a length past the table (and records it)."""
    if min(cos.shape[0], sin.shape[0]) < 1:
        raise ValueError(
            f"graphstep.{op}: the RoPE tables need at least one row, got {cos.shape[0]} and {sin.shape[0]}"
        )


# -- q_a RMSNorm ---------------------------------------------------------------------


def _query_norm_check(qkv, gamma_q, shape):
    m = rank_shape(shape).model
    _batch("query_norm", qkv)
    check_args("query_norm", qkv=(qkv, BF16, (ANY, m.packed_width)), gamma_q=(gamma_q, BF16, (m.q_lora_rank,)))


@_op("query_norm", mutates_args=())
def query_norm(qkv: Tensor, gamma_q: Tensor, shape: str, pdl: bool = True) -> Tensor:
    """QueryNorm: the q_a RMSNorm (eps rms_eps) of each token.

    Arguments:
        qkv: (B, packed_width = 2304), torch.bfloat16. Each new token's packed projection
            row: q_a 1536 | kv_a 512 | k_pe 64 | idx_k 128 | idx_w 64 columns.
        gamma_q: (q_lora_rank = 1536,), torch.bfloat16. The RMSNorm weight.
    Returns:
        q_c: (B, 1536), torch.bfloat16.
    """
    _query_norm_check(qkv, gamma_q, shape)
    kernels = _launcher("query_norm", shape, pdl, qkv.device).bind(SimpleNamespace(gamma_q=gamma_q))
    q_c = qkv.new_empty(qkv.shape[0], gamma_q.shape[0])
    kernels.query_norm(qkv, q_c, qkv.shape[0])
    return q_c


@query_norm.register_fake
def _(qkv, gamma_q, shape, pdl=True):
    _query_norm_check(qkv, gamma_q, shape)
    return qkv.new_empty(qkv.shape[0], gamma_q.shape[0])


# -- MlaQuery ------------------------------------------------------------------------


def _mla_query_check(
    qkv,
    context_lens,
    slot_mapping,
    gamma_q,
    gamma_kv,
    w_qb,
    w_uk_t,
    rope_cos,
    rope_sin,
    q_rows,
    mla_cache,
    error,
    shape,
    budget_ns,
):
    s = rank_shape(shape)
    m, b = s.model, _batch("mla_query", qkv)
    cache_dtype, row = (BF16, m.query_row) if s.topology.mla_cache == "bf16" else (U8, s.mla_token_bytes)
    check_args(
        "mla_query",
        qkv=(qkv, BF16, (ANY, m.packed_width)),
        context_lens=(context_lens, I32, (b,)),
        slot_mapping=(slot_mapping, I32, (b,)),
        gamma_q=(gamma_q, BF16, (m.q_lora_rank,)),
        gamma_kv=(gamma_kv, BF16, (m.kv_lora_rank,)),
        w_qb=(w_qb, BF16, (s.heads * m.qk_head_dim, m.q_lora_rank)),
        w_uk_t=(w_uk_t, BF16, (s.heads, m.kv_lora_rank, m.qk_nope_dim)),
        rope_cos=(rope_cos, FP32, (ANY, m.qk_rope_dim // 2)),
        rope_sin=(rope_sin, FP32, (ANY, m.qk_rope_dim // 2)),
        q_rows=(q_rows, U8, (ANY, s.q_heads, m.query_row * s.q_bytes)),
        mla_cache=(mla_cache, cache_dtype, (ANY, m.page_size, row)),
        error=_error_arg(error),
    )
    _rope_table("mla_query", rope_cos, rope_sin)
    _at_least("mla_query", "q_rows", q_rows, b)
    check_budget(budget_ns)


@_op("mla_query", mutates_args=("q_rows", "mla_cache", "error"))
def mla_query(
    qkv: Tensor,
    context_lens: Tensor,
    slot_mapping: Tensor,
    gamma_q: Tensor,
    gamma_kv: Tensor,
    w_qb: Tensor,
    w_uk_t: Tensor,
    rope_cos: Tensor,
    rope_sin: Tensor,
    q_rows: Tensor,
    mla_cache: Tensor,
    error: Tensor,
    shape: str,
    poll: bool = False,
    budget_ns: int = DEFAULT_BUDGET_NS,
    pdl: bool = True,
) -> Tensor:
    """MlaQuery: q_a RMSNorm, Q_B, W_UK absorption and RoPE of this rank's heads into the
    query rows; the new tokens' kv_a RMSNorm + k_pe RoPE rows into the MLA cache.

    Arguments (H = heads per rank, Q = q_heads, the query rows' head stride):
        qkv: (B, 2304), torch.bfloat16. The packed projection rows (see query_norm).
        context_lens: (B,), torch.int32. Tokens of each sequence over all ranks, the new one
            included (its RoPE position is context_lens - 1).
        slot_mapping: (B,), torch.int32. The new token's MLA cache slot, -1: write nothing.
        gamma_q: (1536,), gamma_kv: (512,), torch.bfloat16. The q_a and kv_a RMSNorm weights.
        w_qb: (H x 192, 1536), torch.bfloat16, (out, in): per head 128 nope then 64 rope.
        w_uk_t: (H, 512, 128), torch.bfloat16. W_UK with the nope dim contiguous
            (LayerWeights.w_uk.transpose(1, 2).contiguous()).
        rope_cos, rope_sin: (positions, 32), torch.float32, interleaved pairs; rows past
            every context_lens - 1.
        q_rows: (>= B, Q, 576 x q_bytes), torch.uint8, written in place: this rank's head
            rows of each token (the DCP mailbox; see the module docstring).
        mla_cache: the MLA cache (module docstring), written in place at slot_mapping.
        error: (4,), torch.int32, written in place (launch.ErrorWord): (flag, lowest missing
            chunk) when a poll gave up, then the range guards' int64 record of a slot outside
            mla_cache or a length outside [1, rope rows]; ErrorWord.new's values when armed.
        poll: then wait until every DCP rank's rows landed in q_rows (budget_ns each).
    Returns:
        q_c: (B, 1536), torch.bfloat16. The q_a RMSNorm (as query_norm's).
    """
    _mla_query_check(
        qkv,
        context_lens,
        slot_mapping,
        gamma_q,
        gamma_kv,
        w_qb,
        w_uk_t,
        rope_cos,
        rope_sin,
        q_rows,
        mla_cache,
        error,
        shape,
        budget_ns,
    )
    weights = SimpleNamespace(gamma_q=gamma_q, gamma_kv=gamma_kv, w_qb=w_qb, rope_cos=rope_cos, rope_sin=rope_sin)
    kernels = _launcher("mla_query", shape, pdl, qkv.device).bind(weights, w_uk_t)
    s, batch = kernels.shape, qkv.shape[0]
    q_c = qkv.new_empty(batch, s.model.q_lora_rank)
    workspace = qkv.new_empty(batch, s.heads, s.model.qk_head_dim, dtype=FP32)
    kernels.mla_query(
        qkv,
        context_lens,
        slot_mapping,
        q_c,
        q_c,
        workspace,
        q_rows,
        mla_cache,
        ErrorWord(error),
        batch,
        True,
        poll,
        budget_ns,
    )
    return q_c


@mla_query.register_fake
def _(
    qkv,
    context_lens,
    slot_mapping,
    gamma_q,
    gamma_kv,
    w_qb,
    w_uk_t,
    rope_cos,
    rope_sin,
    q_rows,
    mla_cache,
    error,
    shape,
    poll=False,
    budget_ns=DEFAULT_BUDGET_NS,
    pdl=True,
):
    _mla_query_check(
        qkv,
        context_lens,
        slot_mapping,
        gamma_q,
        gamma_kv,
        w_qb,
        w_uk_t,
        rope_cos,
        rope_sin,
        q_rows,
        mla_cache,
        error,
        shape,
        budget_ns,
    )
    return qkv.new_empty(qkv.shape[0], gamma_q.shape[0])


# -- QueryWait (DCP) -----------------------------------------------------------------


def _query_wait_check(q_rows, error, batch, shape, budget_ns):
    s = rank_shape(shape)
    check_args(
        "query_wait", q_rows=(q_rows, U8, (ANY, s.q_heads, s.model.query_row * s.q_bytes)), error=_error_arg(error)
    )
    if batch < 1:
        raise ValueError(f"graphstep.query_wait: batch must be >= 1, got {batch}")
    check_budget(budget_ns)
    _at_least("query_wait", "q_rows", q_rows, batch)


@_op("query_wait", mutates_args=("q_rows", "error"))
def query_wait(
    q_rows: Tensor, error: Tensor, batch: int, shape: str, budget_ns: int = DEFAULT_BUDGET_NS, pdl: bool = True
) -> None:
    """QueryWait (DCP): wait until every rank's query rows of the first `batch` tokens landed
    in the mailbox, recording a chunk that never did (within budget_ns) in `error`.

    Arguments:
        q_rows: (>= batch, Q, 576 x q_bytes), torch.uint8. The mailbox (module docstring);
            declared mutated so that torch keeps the wait between its writers and readers.
        error: (4,), torch.int32, written in place (see mla_query).
    """
    _query_wait_check(q_rows, error, batch, shape, budget_ns)
    _launcher("query_wait", shape, pdl, q_rows.device).query_wait(q_rows, ErrorWord(error), batch, budget_ns)


@query_wait.register_fake
def _(q_rows, error, batch, shape, budget_ns=DEFAULT_BUDGET_NS, pdl=True):
    _query_wait_check(q_rows, error, batch, shape, budget_ns)


# -- the indexer ---------------------------------------------------------------------


def _index_key_check(
    qkv, context_lens, slot_mapping, norm_weight, norm_bias, rope_cos, rope_sin, index_cache, shape, error
):
    m = rank_shape(shape).model
    b = _batch("index_key", qkv)
    check_args(
        "index_key",
        qkv=(qkv, BF16, (ANY, m.packed_width)),
        context_lens=(context_lens, I32, (b,)),
        slot_mapping=(slot_mapping, I32, (b,)),
        index_norm_weight=(norm_weight, BF16, (m.index_dim,)),
        index_norm_bias=(norm_bias, BF16, (m.index_dim,)),
        index_rope_cos=(rope_cos, FP32, (ANY, m.index_rope_dim // 2)),
        index_rope_sin=(rope_sin, FP32, (ANY, m.index_rope_dim // 2)),
        index_cache=(index_cache, U8, (ANY, m.page_size * m.index_token_bytes)),
        error=_error_arg(error),
    )
    _rope_table("index_key", rope_cos, rope_sin)


@_op("index_key", mutates_args=("index_cache", "error"))
def index_key(
    qkv: Tensor,
    context_lens: Tensor,
    slot_mapping: Tensor,
    index_norm_weight: Tensor,
    index_norm_bias: Tensor,
    index_rope_cos: Tensor,
    index_rope_sin: Tensor,
    index_cache: Tensor,
    error: Tensor,
    shape: str,
    pdl: bool = True,
) -> None:
    """IndexKey: the new tokens' indexer keys (LayerNorm, NeoX RoPE, Hadamard rotation if the
    model has it, e4m3 with one scale) into the indexer cache at their slots.

    Arguments:
        qkv: (B, 2304), torch.bfloat16. The packed rows; the key is the idx_k columns.
        context_lens: (B,), torch.int32; slot_mapping: (B,), torch.int32 (-1: write nothing).
        index_norm_weight, index_norm_bias: (128,), torch.bfloat16. The key's LayerNorm.
        index_rope_cos, index_rope_sin: (positions, 32), torch.float32.
        index_cache: (pages, 64 x 132), torch.uint8, written in place (module docstring).
        error: (4,), torch.int32, written in place: records a slot outside index_cache (nothing
            written) or a length outside [1, rope rows] (module docstring).
    """
    _index_key_check(
        qkv,
        context_lens,
        slot_mapping,
        index_norm_weight,
        index_norm_bias,
        index_rope_cos,
        index_rope_sin,
        index_cache,
        shape,
        error,
    )
    weights = SimpleNamespace(
        index_norm_weight=index_norm_weight,
        index_norm_bias=index_norm_bias,
        index_rope_cos=index_rope_cos,
        index_rope_sin=index_rope_sin,
    )
    _launcher("index_key", shape, pdl, qkv.device).bind(weights).index_key(
        qkv, context_lens, slot_mapping, index_cache, qkv.shape[0], ErrorWord(error)
    )


@index_key.register_fake
def _(
    qkv,
    context_lens,
    slot_mapping,
    index_norm_weight,
    index_norm_bias,
    index_rope_cos,
    index_rope_sin,
    index_cache,
    error,
    shape,
    pdl=True,
):
    _index_key_check(
        qkv,
        context_lens,
        slot_mapping,
        index_norm_weight,
        index_norm_bias,
        index_rope_cos,
        index_rope_sin,
        index_cache,
        shape,
        error,
    )


def _index_query_check(q_c, qkv, context_lens, wq_b_index, rope_cos, rope_sin, shape, error):
    m = rank_shape(shape).model
    b = _batch("index_query", q_c)
    check_args(
        "index_query",
        q_c=(q_c, BF16, (ANY, m.q_lora_rank)),
        qkv=(qkv, BF16, (b, m.packed_width)),
        context_lens=(context_lens, I32, (b,)),
        wq_b_index=(wq_b_index, BF16, (m.index_heads * m.index_dim, m.q_lora_rank)),
        index_rope_cos=(rope_cos, FP32, (ANY, m.index_rope_dim // 2)),
        index_rope_sin=(rope_sin, FP32, (ANY, m.index_rope_dim // 2)),
        error=_error_arg(error),
    )
    _rope_table("index_query", rope_cos, rope_sin)


def _index_query_outputs(q_c, shape):
    m = rank_shape(shape).model
    b = q_c.shape[0]
    return q_c.new_empty(b, m.index_heads, m.index_dim, dtype=U8), q_c.new_empty(b, m.index_heads, dtype=FP32)


@_op("index_query", mutates_args=("error",))
def index_query(
    q_c: Tensor,
    qkv: Tensor,
    context_lens: Tensor,
    wq_b_index: Tensor,
    index_rope_cos: Tensor,
    index_rope_sin: Tensor,
    error: Tensor,
    shape: str,
    pdl: bool = True,
) -> tuple[Tensor, Tensor]:
    """IndexQuery: the indexer's wq_b, NeoX RoPE, rotation, e4m3 quantization and folded head
    weights in one kernel.

    Arguments:
        q_c: (B, 1536), torch.bfloat16. query_norm's output.
        qkv: (B, 2304), torch.bfloat16. The packed rows (the idx_w head weights).
        context_lens: (B,), torch.int32.
        wq_b_index: (64 x 128, 1536), torch.bfloat16, (out, in).
        index_rope_cos, index_rope_sin: (positions, 32), torch.float32.
        error: (4,), torch.int32, written in place: records a length outside [1, rope rows].
    Returns:
        q: (B, 64, 128), torch.uint8. e4m3 bytes of each indexer head's query.
        head_w: (B, 64), torch.float32. Each head's weight with the query's scale folded in.
    """
    _index_query_check(q_c, qkv, context_lens, wq_b_index, index_rope_cos, index_rope_sin, shape, error)
    weights = SimpleNamespace(wq_b_index=wq_b_index, index_rope_cos=index_rope_cos, index_rope_sin=index_rope_sin)
    q, head_w = _index_query_outputs(q_c, shape)
    _launcher("index_query", shape, pdl, q_c.device).bind(weights).index_query(
        q_c, qkv, context_lens, q, head_w, q_c.shape[0], ErrorWord(error)
    )
    return q, head_w


@index_query.register_fake
def _(q_c, qkv, context_lens, wq_b_index, index_rope_cos, index_rope_sin, error, shape, pdl=True):
    _index_query_check(q_c, qkv, context_lens, wq_b_index, index_rope_cos, index_rope_sin, shape, error)
    return _index_query_outputs(q_c, shape)


def _dsa_index_check(q, head_w, index_cache, block_tables, context_lens, pages_per_cta, shape, error):
    m = rank_shape(shape).model
    b = _batch("dsa_index", q)
    check_args(
        "dsa_index",
        q=(q, U8, (ANY, m.index_heads, m.index_dim)),
        head_w=(head_w, FP32, (b, m.index_heads)),
        index_cache=(index_cache, U8, (ANY, m.page_size * m.index_token_bytes)),
        block_tables=(block_tables, I32, (b, ANY)),
        context_lens=(context_lens, I32, (b,)),
        error=_error_arg(error),
    )
    if pages_per_cta is not None and pages_per_cta < 1:
        raise ValueError(f"graphstep.dsa_index: pages_per_cta must be >= 1 or None, got {pages_per_cta}")


@_op("dsa_index", mutates_args=("error",))
def dsa_index(
    q: Tensor,
    head_w: Tensor,
    index_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    error: Tensor,
    shape: str,
    pages_per_cta: int | None = None,
    pdl: bool = True,
) -> Tensor:
    """DsaIndex: every cached key of each sequence scored, sum over heads of
    head_w x relu(q . k x scale).

    Arguments (W = block_tables.shape[1] x 64, the local positions a table holds):
        q, head_w: index_query's outputs, (B, 64, 128) torch.uint8 and (B, 64) torch.float32.
        index_cache: (pages, 64 x 132), torch.uint8 (module docstring).
        block_tables: (B, pages per sequence), torch.int32. Local index i is at page
            block_tables[b, i // 64].
        context_lens: (B,), torch.int32. Global lengths; this DCP rank holds positions
            p % dcp == rank at local index p // dcp.
        pages_per_cta: the run of pages each CTA streams (None: the host's choice).
        error: (4,), torch.int32, written in place: records a page of the used part outside
            index_cache (its keys score -inf).
    Returns:
        scores: (B, W), torch.float32. -inf past each sequence's local length.
    """
    _dsa_index_check(q, head_w, index_cache, block_tables, context_lens, pages_per_cta, shape, error)
    m = rank_shape(shape).model
    scores = head_w.new_empty(q.shape[0], block_tables.shape[1] * m.page_size)
    _launcher("dsa_index", shape, pdl, q.device).dsa_index(
        q, head_w, index_cache, block_tables, context_lens, scores, q.shape[0], pages_per_cta, ErrorWord(error)
    )
    return scores


@dsa_index.register_fake
def _(q, head_w, index_cache, block_tables, context_lens, error, shape, pages_per_cta=None, pdl=True):
    _dsa_index_check(q, head_w, index_cache, block_tables, context_lens, pages_per_cta, shape, error)
    return head_w.new_empty(q.shape[0], block_tables.shape[1] * rank_shape(shape).model.page_size)


def _check_pool_pages(op: str, pool_pages) -> None:
    if pool_pages is not None and (isinstance(pool_pages, bool) or not 1 <= pool_pages <= INT32_MAX):
        raise ValueError(f"graphstep.{op}: pool_pages must be None or in [1, {INT32_MAX}], got {pool_pages!r}")


def _top_k_check(scores, block_tables, context_lens, shape, error, pool_pages):
    _check_pool_pages("top_k", pool_pages)
    m = rank_shape(shape).model
    b = _batch("top_k", scores)
    check_args(
        "top_k",
        scores=(scores, FP32, (ANY, block_tables.shape[-1] * m.page_size)),
        block_tables=(block_tables, I32, (b, ANY)),
        context_lens=(context_lens, I32, (b,)),
        error=_error_arg(error),
    )


def _top_k_outputs(scores, shape):
    s = rank_shape(shape)
    k, b = s.model.index_topk, scores.shape[0]
    return scores.new_empty(b, k, dtype=I32), scores.new_empty(b, k if s.topology.dcp > 1 else 0)


@_op("top_k", mutates_args=("error",))
def top_k(
    scores: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    error: Tensor,
    shape: str,
    pdl: bool = True,
    pool_pages: int | None = None,
) -> tuple[Tensor, Tensor]:
    """TopK: the index_topk best scores of each row, in ascending position (ties: the lower
    position first; -0.0 as +0.0).

    Arguments:
        scores: (B, block_tables.shape[1] x 64), torch.float32. dsa_index's output.
        block_tables: (B, pages per sequence), torch.int32; context_lens: (B,), torch.int32.
        error: (4,), torch.int32, written in place; pool_pages: the indexer cache's pages, or None
            (no bound but >= 0): a kept position on a page outside [0, pool_pages) gets
            slot -1, recorded in error.
    Returns (k = index_topk = 2048):
        out: (B, k), torch.int32. Without DCP the cache slots of the best; under DCP this
            rank's candidates as global positions (local x dcp + rank); -1 padded.
        out_scores: under DCP (B, k), torch.float32, the candidates' scores (-inf padded);
            without DCP (B, 0).
    """
    _top_k_check(scores, block_tables, context_lens, shape, error, pool_pages)
    out, out_scores = _top_k_outputs(scores, shape)
    # without DCP the kernel never writes out_scores: any fp32 CUDA pointer does
    unused = out_scores if out_scores.numel() else scores
    _launcher("top_k", shape, pdl, scores.device).top_k(
        scores,
        block_tables,
        context_lens,
        out,
        unused,
        scores.shape[0],
        error=ErrorWord(error),
        pool_pages=INT32_MAX if pool_pages is None else pool_pages,
    )
    return out, out_scores


@top_k.register_fake
def _(scores, block_tables, context_lens, error, shape, pdl=True, pool_pages=None):
    _top_k_check(scores, block_tables, context_lens, shape, error, pool_pages)
    return _top_k_outputs(scores, shape)


def _dcp_merge_check(own_positions, own_scores, peer_positions, peer_scores, block_tables, shape, error, pool_pages):
    _check_pool_pages("dcp_merge", pool_pages)
    s = rank_shape(shape)
    k, dcp, b = s.model.index_topk, s.topology.dcp, _batch("dcp_merge", own_positions)
    if dcp == 1:
        raise ValueError("graphstep.dcp_merge: needs a shape with Topology.dcp > 1")
    check_args(
        "dcp_merge",
        own_positions=(own_positions, I32, (ANY, k)),
        own_scores=(own_scores, FP32, (b, k)),
        peer_positions=(peer_positions, I32, (b, dcp, k)),
        peer_scores=(peer_scores, FP32, (b, dcp, k)),
        block_tables=(block_tables, I32, (b, ANY)),
        error=_error_arg(error),
    )


@_op("dcp_merge", mutates_args=("error",))
def dcp_merge(
    own_positions: Tensor,
    own_scores: Tensor,
    peer_positions: Tensor,
    peer_scores: Tensor,
    block_tables: Tensor,
    error: Tensor,
    shape: str,
    pdl: bool = True,
    pool_pages: int | None = None,
) -> Tensor:
    """DcpMerge (DCP): every rank's top-k candidates -> this rank's share of the global top-k.

    Arguments (k = index_topk, D = dcp):
        own_positions, own_scores: (B, k), torch.int32 / torch.float32. This rank's
            candidates (top_k's outputs under DCP).
        peer_positions, peer_scores: (B, D, k), torch.int32 / torch.float32. Every rank's
            candidates (global positions, descending scores, -1 / -inf padded); this
            rank's row is not read.
        block_tables: (B, pages per sequence), torch.int32.
        error, pool_pages: as top_k's (a kept candidate past the block table or on a page
            outside [0, pool_pages) gets slot -1, recorded in error).
    Returns:
        slots: (B, k), torch.int32. This rank's cache slots among the global top-k,
            compacted to the front, -1 padded.
    """
    _dcp_merge_check(own_positions, own_scores, peer_positions, peer_scores, block_tables, shape, error, pool_pages)
    slots = torch.empty_like(own_positions)
    _launcher("dcp_merge", shape, pdl, own_positions.device).dcp_merge(
        own_positions,
        own_scores,
        peer_positions,
        peer_scores,
        block_tables,
        slots,
        own_positions.shape[0],
        ErrorWord(error),
        INT32_MAX if pool_pages is None else pool_pages,
    )
    return slots


@dcp_merge.register_fake
def _(own_positions, own_scores, peer_positions, peer_scores, block_tables, error, shape, pdl=True, pool_pages=None):
    _dcp_merge_check(own_positions, own_scores, peer_positions, peer_scores, block_tables, shape, error, pool_pages)
    return torch.empty_like(own_positions)


# -- SparseCore ----------------------------------------------------------------------


def _sparse_core_check(q_rows, slots, mla_cache, shape, slots_per_cta, error):
    s = rank_shape(shape)
    m, b = s.model, _batch("sparse_core", slots)
    cache_dtype, row = (BF16, m.query_row) if s.topology.mla_cache == "bf16" else (U8, s.mla_token_bytes)
    check_args(
        "sparse_core",
        q_rows=(q_rows, U8, (ANY, s.q_heads, m.query_row * s.q_bytes)),
        slots=(slots, I32, (ANY, m.index_topk)),
        mla_cache=(mla_cache, cache_dtype, (ANY, m.page_size, row)),
        error=_error_arg(error),
    )
    _at_least("sparse_core", "q_rows", q_rows, b)
    if slots_per_cta is not None and (slots_per_cta < 16 or slots_per_cta % 16 or m.index_topk % slots_per_cta):
        raise ValueError(
            f"graphstep.sparse_core: slots_per_cta must be a multiple of 16 dividing {m.index_topk}, "
            f"got {slots_per_cta}"
        )


def _sparse_core_outputs(slots, shape):
    s = rank_shape(shape)
    b = slots.shape[0]
    return slots.new_empty(b, s.gathered, s.model.kv_lora_rank, dtype=FP32), slots.new_empty(b, s.gathered, dtype=FP32)


@_op("sparse_core", mutates_args=("error",))
def sparse_core(
    q_rows: Tensor,
    slots: Tensor,
    mla_cache: Tensor,
    error: Tensor,
    shape: str,
    slots_per_cta: int | None = None,
    pdl: bool = True,
) -> tuple[Tensor, Tensor]:
    """SparseCore: sparse MLA decode of each token's query rows over the MLA cache rows at
    its slots (split over CTAs, merged in the kernel); q_rows and the cache are only read.

    Arguments (G = gathered head rows = dcp x heads per rank):
        q_rows: (>= B, Q, 576 x q_bytes), torch.uint8. The query rows (module docstring);
            rows G .. Q of a token are not read.
        slots: (B, index_topk), torch.int32, 16-byte aligned rows. Cache slots, -1: none.
        mla_cache: the MLA cache (module docstring).
        slots_per_cta: the slots each CTA attends (None: the plan's choice for B).
        error: (4,), torch.int32, written in place: records a slot outside mla_cache (read as -1).
    Returns:
        out: (B, G, 512), torch.float32. The attention per head row in the latent space
            (before W_UV); 0 for a token with no slot.
        lse: (B, G), torch.float32. The natural-log sum of exp of the scaled scores; -inf
            for a token with no slot.
    """
    _sparse_core_check(q_rows, slots, mla_cache, shape, slots_per_cta, error)
    return _run_sparse_core("sparse_core", q_rows, slots, mla_cache, shape, slots_per_cta, pdl, None, error)


@sparse_core.register_fake
def _(q_rows, slots, mla_cache, error, shape, slots_per_cta=None, pdl=True):
    _sparse_core_check(q_rows, slots, mla_cache, shape, slots_per_cta, error)
    return _sparse_core_outputs(slots, shape)


def _run_sparse_core(op, q_rows, slots, mla_cache, shape, slots_per_cta, pdl, q_out, error):
    from .kernels.sparse_core import partial_rows

    kernels = _launcher(op, shape, pdl, slots.device)
    batch, s = slots.shape[0], kernels.shape
    spc = slots_per_cta or kernels.sparse_core_plan(batch)
    rows = partial_rows(batch, s.q_heads, s.model.index_topk, spc)  # none for one split per token
    partial_o = slots.new_empty(rows, s.q_heads, s.model.kv_lora_rank, dtype=FP32)
    partial_ml = slots.new_empty(rows, s.q_heads, 2, dtype=FP32)
    out, lse = _sparse_core_outputs(slots, shape)
    kernels.sparse_core(q_rows, slots, mla_cache, partial_o, partial_ml, out, lse, batch, spc, q_out, ErrorWord(error))
    return out, lse


def _published_rows(q_rows, slots, shape):
    s = rank_shape(shape)
    return q_rows.new_empty(slots.shape[0], s.gathered, q_rows.shape[-1])


@_op("sparse_core_publish", mutates_args=("q_rows", "error"))
def sparse_core_publish(
    q_rows: Tensor,
    slots: Tensor,
    mla_cache: Tensor,
    error: Tensor,
    shape: str,
    slots_per_cta: int | None = None,
    pdl: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """SparseCore as the step launches it, the mailbox's last reader: sparse_core's outputs,
    and the rows it read, copied out and re-armed (0xFF) in the mailbox for the next step
    once every CTA that reads them is done (no copy or fill launch after it).

    Arguments: as sparse_core's; q_rows (the mailbox) is written in place: rows 0 .. G of
        the first B tokens re-armed.
    Returns:
        out, lse: as sparse_core's.
        rows: (B, G, 576 x q_bytes), torch.uint8. The query rows read, in the mailbox's format.
    """
    _sparse_core_check(q_rows, slots, mla_cache, shape, slots_per_cta, error)
    rows = _published_rows(q_rows, slots, shape)
    out, lse = _run_sparse_core("sparse_core_publish", q_rows, slots, mla_cache, shape, slots_per_cta, pdl, rows, error)
    return out, lse, rows


@sparse_core_publish.register_fake
def _(q_rows, slots, mla_cache, error, shape, slots_per_cta=None, pdl=True):
    _sparse_core_check(q_rows, slots, mla_cache, shape, slots_per_cta, error)
    return *_sparse_core_outputs(slots, shape), _published_rows(q_rows, slots, shape)
