"""graphstep.ops on the CPU: every kernel registered as torch.ops.graphstep.*, its schema,
its fake implementation's outputs (meta tensors, FakeTensorMode, torch.compile's tracing),
and bad arguments refused with the op and argument named."""

import pytest
import torch
from graphstep.kernels import catalog
from torch._subclasses.fake_tensor import FakeTensorMode

from graphstep import ops
from graphstep.launch import TvmFfiKernels, compile_tvm_ffi
from graphstep.shapes import ModelShape, RankShape, Topology, preset

OPS = (
    "query_norm",
    "mla_query",
    "query_wait",
    "index_key",
    "index_query",
    "dsa_index",
    "top_k",
    "dcp_merge",
    "sparse_core",
    "sparse_core_publish",
)
MUTATED = {
    "mla_query": {"q_rows", "mla_cache", "error"},
    "query_wait": {"q_rows", "error"},
    "index_key": {"index_cache", "error"},
    "index_query": {"error"},  # the range guards' record
    "dsa_index": {"error"},
    "top_k": {"error"},
    "dcp_merge": {"error"},
    "sparse_core": {"error"},
    "sparse_core_publish": {"q_rows", "error"},
}
SHAPES = {
    "tp8": RankShape(preset("deepseek-v3.2"), Topology(tp=8)),
    "kimi-dcp2-fp8": RankShape(preset("kimi-k3.1"), Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8")),
}
B, PAGES, TABLE = 5, 40, 6  # batch, cache pages, pages per block table


def _args(shape: RankShape, device="meta") -> dict:
    """Well-formed arguments of every op for B tokens: {op: (args, kwargs)}."""
    m, topo, k = shape.model, shape.topology, shape.model.index_topk
    t = lambda *dims, dtype=torch.bfloat16: torch.empty(*dims, dtype=dtype, device=device)
    i32, f32, u8 = torch.int32, torch.float32, torch.uint8
    key = ops.shape_key(shape)
    qkv, lens, slots = t(B, m.packed_width), t(B, dtype=i32), t(B, dtype=i32)
    q_rows = t(B + 3, shape.q_heads, m.query_row * shape.q_bytes, dtype=u8)
    mla_cache = t(PAGES, 64, 576) if topo.mla_cache == "bf16" else t(PAGES, 64, 656, dtype=u8)
    index_cache, tables, error = t(PAGES, 64 * 132, dtype=u8), t(B, TABLE, dtype=i32), t(4, dtype=i32)
    rope, index_rope = t(100, m.qk_rope_dim // 2, dtype=f32), t(100, m.index_rope_dim // 2, dtype=f32)
    mla_weights = (
        t(1536),
        t(512),
        t(shape.heads * 192, 1536),
        t(shape.heads, 512, 128),
        rope,
        rope,
    )
    return {
        "query_norm": ((qkv, t(1536), key), {}),
        "mla_query": ((qkv, lens, slots, *mla_weights, q_rows, mla_cache, error, key), {}),
        "query_wait": ((q_rows, error, B, key), {}),
        "index_key": ((qkv, lens, slots, t(128), t(128), index_rope, index_rope, index_cache, error, key), {}),
        "index_query": ((t(B, 1536), qkv, lens, t(64 * 128, 1536), index_rope, index_rope, error, key), {}),
        "dsa_index": ((t(B, 64, 128, dtype=u8), t(B, 64, dtype=f32), index_cache, tables, lens, error, key), {}),
        "top_k": ((t(B, TABLE * 64, dtype=f32), tables, lens, error, key), {}),
        "dcp_merge": (
            (
                t(B, k, dtype=i32),
                t(B, k, dtype=f32),
                t(B, topo.dcp, k, dtype=i32),
                t(B, topo.dcp, k, dtype=f32),
                tables,
                error,
                key,
            ),
            {},
        ),
        "sparse_core": ((q_rows, t(B, k, dtype=i32), mla_cache, error, key), {}),
        "sparse_core_publish": ((q_rows, t(B, k, dtype=i32), mla_cache, error, key), {"slots_per_cta": 256}),
    }


def _expected(shape: RankShape) -> dict:
    """Each op's outputs as (shape, dtype)."""
    m, k, g = shape.model, shape.model.index_topk, shape.gathered
    dcp_scores = k if shape.topology.dcp > 1 else 0
    return {
        "query_norm": [((B, 1536), torch.bfloat16)],
        "mla_query": [((B, 1536), torch.bfloat16)],
        "query_wait": [],
        "index_key": [],
        "index_query": [((B, 64, 128), torch.uint8), ((B, 64), torch.float32)],
        "dsa_index": [((B, TABLE * 64), torch.float32)],
        "top_k": [((B, k), torch.int32), ((B, dcp_scores), torch.float32)],
        "dcp_merge": [((B, k), torch.int32)],
        "sparse_core": [((B, g, m.kv_lora_rank), torch.float32), ((B, g), torch.float32)],
        "sparse_core_publish": [
            ((B, g, m.kv_lora_rank), torch.float32),
            ((B, g), torch.float32),
            ((B, g, m.query_row * shape.q_bytes), torch.uint8),
        ],
    }


def _outputs(result) -> list:
    if result is None:
        return []
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _ops_for(shape):
    return [op for op in OPS if shape.topology.dcp > 1 or op not in ("dcp_merge",)]


def test_every_kernel_is_an_op_with_its_mutations_declared():
    for name in OPS:
        schema = getattr(torch.ops.graphstep, name).default._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == MUTATED.get(name, set()), name
        assert [a.name for a in schema.arguments if a.name in ("shape", "pdl")] == ["shape", "pdl"], name


@pytest.mark.parametrize("name", list(SHAPES))
def test_fake_outputs_on_meta_tensors(name):
    shape = SHAPES[name]
    args, expected = _args(shape), _expected(shape)
    for op in _ops_for(shape):
        positional, keywords = args[op]
        got = _outputs(getattr(torch.ops.graphstep, op)(*positional, **keywords))
        assert [(tuple(t.shape), t.dtype) for t in got] == expected[op], op
        assert all(t.device.type == "meta" for t in got)


def test_fake_outputs_under_fake_tensor_mode_on_a_cuda_device():
    shape = SHAPES["kimi-dcp2-fp8"]
    with FakeTensorMode():
        args = _args(shape, device="cuda")
        for op in _ops_for(shape):
            positional, keywords = args[op]
            got = _outputs(getattr(torch.ops.graphstep, op)(*positional, **keywords))
            assert [(tuple(t.shape), t.dtype) for t in got] == _expected(shape)[op], op
            assert all(t.device == torch.device("cuda", 0) for t in got)


@pytest.mark.parametrize("op", OPS)
def test_opcheck_schema_and_fake_tensor(op):
    shape = SHAPES["kimi-dcp2-fp8"]
    positional, keywords = _args(shape)[op]
    torch.library.opcheck(
        getattr(torch.ops.graphstep, op).default, positional, keywords, test_utils=("test_schema", "test_faketensor")
    )


def test_a_chain_of_ops_traces_whole_under_torch_compile():
    shape = SHAPES["tp8"]
    a, key = _args(shape), ops.shape_key(shape)  # a constant of the traced function

    def indexer(qkv, lens, slots, norm_w, norm_b, rope_cos, rope_sin, cache, gamma, wq_b, tables, error):
        torch.ops.graphstep.index_key(qkv, lens, slots, norm_w, norm_b, rope_cos, rope_sin, cache, error, key)
        q_c = torch.ops.graphstep.query_norm(qkv, gamma, key)
        q, w = torch.ops.graphstep.index_query(q_c, qkv, lens, wq_b, rope_cos, rope_sin, error, key)
        scores = torch.ops.graphstep.dsa_index(q, w, cache, tables, lens, error, key)
        return torch.ops.graphstep.top_k(scores, tables, lens, error, key)[0]

    qkv, lens, slots, norm_w, norm_b, rope_cos, rope_sin, cache, error, _ = a["index_key"][0]
    gamma, wq_b, tables = a["query_norm"][0][1], a["index_query"][0][3], a["top_k"][0][1]
    compiled = torch.compile(indexer, fullgraph=True, backend="aot_eager")
    out = compiled(qkv, lens, slots, norm_w, norm_b, rope_cos, rope_sin, cache, gamma, wq_b, tables, error)
    assert (tuple(out.shape), out.dtype) == ((B, 2048), torch.int32)


def test_shape_key_round_trips_presets_and_custom_models():
    custom = ModelShape(name="custom", heads=32, rope_scaling=None, index_rotation=False, fp8_scale_format="fp32")
    for shape in (*SHAPES.values(), RankShape(custom, Topology(tp=2, dcp=4, rank=3, split=True))):
        assert ops.rank_shape(ops.shape_key(shape)) == shape
    with pytest.raises(ValueError, match="shape_key"):
        ops.rank_shape("deepseek-v3.2")
    with pytest.raises(ValueError, match="Topology.rank"):
        ops.rank_shape(ops.shape_key(SHAPES["tp8"]).replace('"rank":0', '"rank":5'))


def _call(op, shape=SHAPES["tp8"], **changes):
    """op with the named positional arguments replaced (by index)."""
    positional, keywords = _args(shape)[op]
    positional = list(positional)
    for index, value in changes.items():
        positional[int(index[1:])] = value
    return getattr(torch.ops.graphstep, op)(*positional, **keywords)


def _meta(*dims, dtype=torch.bfloat16):
    return torch.empty(*dims, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    "op, changes, message",
    [
        (
            "query_norm",
            {"a0": _meta(B, 2304, dtype=torch.float16)},
            r"query_norm: qkv must be torch.bfloat16 \[\*, 2304\]",
        ),
        ("query_norm", {"a1": _meta(1024)}, r"gamma_q must be torch.bfloat16 \[1536\], got .* \[1024\]"),
        ("query_norm", {"a0": _meta(2304, B).t()}, "qkv must be contiguous"),
        (
            "query_norm",
            {"a0": _meta(B * 2304 + 4)[4:].view(B, 2304)},
            "qkv must be 16-byte aligned, got a view 4 elements in",
        ),
        (
            "query_norm",
            {"a1": torch.empty(1536, dtype=torch.bfloat16)},
            "gamma_q is on cpu, the other arguments on meta",
        ),
        ("mla_query", {"a6": _meta(16, 128, 512)}, r"w_uk_t must be torch.bfloat16 \[16, 512, 128\]"),
        ("mla_query", {"a9": _meta(B - 1, 16, 1152, dtype=torch.uint8)}, "q_rows holds 4 rows, the batch is 5"),
        (
            "mla_query",
            {"a10": _meta(PAGES, 64, 656, dtype=torch.uint8)},
            r"mla_cache must be torch.bfloat16 \[\*, 64, 576\]",
        ),
        ("mla_query", {"a1": _meta(B + 1, dtype=torch.int32)}, r"context_lens must be torch.int32 \[5\]"),
        ("query_wait", {"a2": 0}, "batch must be >= 1"),
        (
            "index_key",
            {"a7": _meta(PAGES, 64 * 128, dtype=torch.uint8)},
            r"index_cache must be torch.uint8 \[\*, 8448\]",
        ),
        ("index_query", {"a1": _meta(B + 1, 2304)}, r"qkv must be torch.bfloat16 \[5, 2304\]"),
        ("dsa_index", {"a3": _meta(B, TABLE, dtype=torch.int64)}, r"block_tables must be torch.int32 \[5, \*\]"),
        ("top_k", {"a0": _meta(B, 100, dtype=torch.float32)}, r"scores must be torch.float32 \[\*, 384\]"),
        ("dcp_merge", {}, "needs a shape with Topology.dcp > 1"),
        ("sparse_core", {"a1": _meta(B, 1024, dtype=torch.int32)}, r"slots must be torch.int32 \[\*, 2048\]"),
        ("query_norm", {"a2": "tp8"}, "shape must be graphstep.ops.shape_key"),
        ("query_norm", {"a0": _meta(0, 2304)}, "query_norm: the batch is empty"),
        ("sparse_core", {"a1": _meta(0, 2048, dtype=torch.int32)}, "sparse_core: the batch is empty"),
        ("mla_query", {"a7": _meta(0, 32, dtype=torch.float32)}, "mla_query: the RoPE tables need at least one row"),
        ("index_key", {"a6": _meta(0, 32, dtype=torch.float32)}, "index_key: the RoPE tables need at least one row"),
        ("index_query", {"a4": _meta(0, 32, dtype=torch.float32)}, "index_query: the RoPE tables need at least"),
    ],
)
def test_bad_arguments_are_refused_naming_the_op_and_argument(op, changes, message):
    with pytest.raises(ValueError, match=message):
        _call(op, **changes)


def test_arguments_of_the_wrong_kind_are_refused():
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'wq_b_index'"):
        _call("index_query", a3=[1.0])  # the schema's types, by the dispatcher
    with pytest.raises(ValueError, match="dsa_index: the token-indexed arguments have a batch dim"):
        _call("dsa_index", a0=torch.tensor(1, dtype=torch.uint8, device="meta"))


def test_bad_tuning_arguments_are_refused():
    positional, _ = _args(SHAPES["tp8"])["sparse_core"]
    for bad in (48, 8, 0):  # 48 does not divide 2048; 8 does but is not a multiple of 16
        with pytest.raises(ValueError, match=f"slots_per_cta must be a multiple of 16 dividing 2048, got {bad}"):
            torch.ops.graphstep.sparse_core(*positional, slots_per_cta=bad)
    positional, _ = _args(SHAPES["tp8"])["dsa_index"]
    with pytest.raises(ValueError, match="pages_per_cta must be >= 1"):
        torch.ops.graphstep.dsa_index(*positional, pages_per_cta=0)
    positional, _ = _args(SHAPES["tp8"])["top_k"]
    for bad in (0, -5, 2**31):  # a negative bound wrapped in the kernels' unsigned compare: nothing refused
        with pytest.raises(ValueError, match=rf"top_k: pool_pages must be None or in \[1, 2147483647\], got {bad}"):
            torch.ops.graphstep.top_k(*positional, pool_pages=bad)
    positional, _ = _args(SHAPES["kimi-dcp2-fp8"])["dcp_merge"]
    with pytest.raises(ValueError, match="dcp_merge: pool_pages must be None or in"):
        torch.ops.graphstep.dcp_merge(*positional, pool_pages=-1)


def test_the_real_implementations_refuse_cpu_tensors():
    shape = SHAPES["tp8"]
    qkv = torch.zeros(B, shape.model.packed_width, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="query_norm: the kernels run on CUDA tensors, got tensors on cpu"):
        torch.ops.graphstep.query_norm(qkv, torch.ones(1536, dtype=torch.bfloat16), ops.shape_key(shape))


def test_every_kernel_compiles_with_the_tvm_ffi_abi():
    pytest.importorskip("tvm_ffi")
    shape = SHAPES["kimi-dcp2-fp8"]
    kernels = {}
    for variant in catalog.variants(shape, batches=(1, 64), norms=(True,), widths=(4096,), polls=(True,), group=True):
        kernels.setdefault(type(variant.op).__name__, variant)
    assert len(kernels) == len(catalog.KERNELS)  # one variant of each kernel (TopK: a cluster split)
    for name, variant in kernels.items():
        compiled = compile_tvm_ffi(variant, arch="sm_90a")
        assert type(compiled).__name__.startswith("TVMFFIJitCompiledFunction"), name


def test_every_kernel_takes_under_tvm_ffi_what_tvm_ffi_kernels_passes():
    """Data pointers (TvmFfiKernels passes data_ptr() ints), int and float scalars (Python
    values) and a stream (its handle) last: no tensor parameter, whose DLPack form a data
    pointer is not."""
    pytest.importorskip("tvm_ffi")
    import inspect

    from cutlass.cute._tvm_ffi_args_spec_converter import _tvm_ffi_args_spec_converter
    from cutlass.cute.runtime import make_fake_stream

    shape = SHAPES["kimi-dcp2-fp8"]
    seen = set()
    for variant in catalog.variants(shape, batches=(1, 64), widths=(4096,), group=True):
        signature = inspect.signature(variant.op.__call__)
        params, _, _ = _tvm_ffi_args_spec_converter(variant.name, signature, [*variant.args, make_fake_stream()], {})
        kinds = [type(p).__name__ if type(p).__name__ != "Var" else str(p.dtype) for p in params]
        assert kinds[-1] == "Stream" and set(kinds[:-1]) <= {"DataPointer", "int32", "int64", "float32"}, variant.name
        seen.add(type(variant.op).__name__)
    assert len(seen) == len(catalog.KERNELS)


def test_tvm_ffi_arguments_are_plain_values_and_cpu_tensors_are_refused():
    kernels = TvmFfiKernels(SHAPES["tp8"], None)
    assert (kernels._i32(7), kernels._i64(2**40), kernels._f32(1e-6)) == (7, 2**40, 1e-6)
    with pytest.raises(ValueError, match="kernel arguments must be CUDA tensors"):
        kernels._ptr(torch.zeros(4))


def test_warm_compiles_for_the_device_the_ops_will_run_on(monkeypatch):
    """ops.warm passes its device (the current CUDA one by default) to the launcher's warm, whose
    TopK picks then are the splits that device's clusters fit (launch.cluster_fits); off CUDA
    none."""
    asked = []

    class Launcher:
        def warm(self, batches, width, device=None):
            asked.append((tuple(batches), width, device))

    monkeypatch.setattr(ops, "_kernels", lambda key, pdl: Launcher())
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ops.warm(shape, (1, 4), 4096)
    ops.warm(shape, (2,), None, device="cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    ops.warm(shape, (1,), 8192)
    assert asked == [((1, 4), 4096, None), ((2,), None, "cuda:1"), ((1,), 8192, torch.device("cuda", 3))]
