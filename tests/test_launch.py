"""The host side of every kernel launch, on the CPU: each `Kernels` method passes exactly
the arguments its kernel was compiled for (count, pointer dtype and alignment, scalar
types), so a launcher that drifts from its kernel fails here, not first on a GPU."""

import pytest
import torch

from graphstep import launch
from graphstep.kernels import catalog
from graphstep.kernels.primitives import gmem_ptr
from graphstep.launch import ErrorWord, Kernels
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState


def _signature(value):
    if hasattr(value, "memspace"):  # a CuTe pointer
        return ("pointer", value.dtype, value.memspace, value._assumed_align)
    return (type(value).__name__,)


class Launch:
    """Stands in for a compiled kernel: checks a call against the placeholders."""

    calls: list = []

    def __init__(self, op, placeholders):
        self.op, self.placeholders = op, placeholders

    def __call__(self, *args):
        *args, stream = args
        assert stream == "stream"
        name = type(self.op).__name__
        assert len(args) == len(self.placeholders), (name, len(args), len(self.placeholders))
        for i, (got, want) in enumerate(zip(args, self.placeholders)):
            assert _signature(got) == _signature(want), (name, i, _signature(got), _signature(want))
        Launch.calls.append(name)


@pytest.fixture
def cpu_launches(monkeypatch):
    def cpu_ptr(tensor, align=16):  # launch.ptr without its CUDA check
        return gmem_ptr(launch._cutlass_dtype(tensor.dtype), tensor.data_ptr(), align)

    monkeypatch.setattr(launch, "ptr", cpu_ptr)
    monkeypatch.setattr(launch, "current_stream", lambda: "stream")
    monkeypatch.setattr(catalog, "compile_op", lambda op, args, arch=None, dump_dir=None: Launch(op, args))
    Launch.calls = []
    return Launch.calls


@pytest.mark.parametrize("topology", [Topology(tp=8), Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8")],
                         ids=["tp8", "dcp2-fp8"])
def test_every_launcher_matches_its_kernel(cpu_launches, topology):
    state = LayerState(RankShape(preset("deepseek-v3.2"), topology), max_batch=4, max_context=256, seed=1)
    s, m, b = state.shape, state.shape.model, 4
    kernels = Kernels(s, state.weights)
    inputs = state.inputs(b)
    c = state.caches
    f32 = lambda *shape: torch.zeros(*shape)  # noqa: E731
    i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32)  # noqa: E731
    qc = torch.zeros(b, m.q_lora_rank, dtype=torch.bfloat16)
    error = ErrorWord(torch.zeros(2, dtype=torch.int32))
    q8 = torch.zeros(b, m.index_heads, m.index_dim, dtype=torch.uint8)
    scores = f32(b, state.pages_per_seq * m.page_size)
    partial_o, partial_ml = kernels.sparse_core_buffers(b, "cpu")

    kernels.query_norm(inputs.qkv, qc, b)
    kernels.mla_query(inputs.qkv, inputs.context_lens, inputs.slot_mapping, qc, qc.clone(), f32(b, s.heads, 192),
                      c.mailbox, c.mla_cache, error, b, store_qc=True, poll=topology.dcp > 1)
    kernels.index_key(inputs.qkv, inputs.context_lens, inputs.slot_mapping, c.index_cache, b)
    kernels.index_query(qc, inputs.qkv, inputs.context_lens, q8, f32(b, m.index_heads), b)
    kernels.dsa_index(q8, f32(b, m.index_heads), c.index_cache, inputs.block_tables, inputs.context_lens, scores, b)
    kernels.top_k(scores, inputs.block_tables, inputs.context_lens, i32(b, m.index_topk), f32(b, m.index_topk), b)
    kernels.sparse_core(c.mailbox, i32(b, m.index_topk), c.mla_cache, partial_o, partial_ml,
                        f32(b, s.gathered, m.kv_lora_rank), f32(b, s.gathered), b)
    launched = ["QueryNorm", "MlaQuery", "IndexKey", "IndexQuery", "DsaIndex", "TopK", "SparseCore"]
    if topology.dcp > 1:
        kernels.query_wait(c.mailbox, error, b)
        kernels.dcp_merge(i32(b, m.index_topk), f32(b, m.index_topk), i32(b, topology.dcp, m.index_topk),
                          f32(b, topology.dcp, m.index_topk), inputs.block_tables, i32(b, m.index_topk), b)
        launched += ["QueryWait", "DcpMerge"]
    assert cpu_launches == launched


def test_launch_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        launch.ptr(torch.zeros(4))


def test_sparse_core_plan_fills_the_gpu_and_its_buffers_hold_every_batch():
    from graphstep.kernels import sparse_core

    for q_heads in (16, 32, 64, 128):
        for batch in (1, 2, 3, 4, 16, 64, 200):
            slots = sparse_core.plan(batch, q_heads, 2048)
            ctas = batch * q_heads // sparse_core.heads_per_cta(q_heads) * (2048 // slots)
            assert 2048 % slots == 0 and (ctas >= sparse_core.WAVE or slots == 32), (q_heads, batch, slots, ctas)
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=4, max_context=256, seed=1)
    kernels = Kernels(state.shape, state.weights)
    partial_o, partial_ml = kernels.sparse_core_buffers(64, "cpu")
    k = state.shape.model.index_topk
    assert partial_o.shape[0] == partial_ml.shape[0] == max(b * k // kernels.sparse_core_plan(b) for b in range(1, 65))
    with pytest.raises(ValueError, match="partials hold"):
        kernels.sparse_core(*[None] * 3, partial_o[:10], partial_ml[:10], None, None, 64)
