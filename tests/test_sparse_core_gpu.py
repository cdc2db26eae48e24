"""SparseCore (sparse MLA decode over the selected slots) on an sm_90 GPU against the
reference, in both cache formats and both query formats; outputs poisoned first."""

import pytest
import torch

from conftest import rel_err
from graphstep import formats, reference as ref
from graphstep.launch import Kernels
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState

pytestmark = pytest.mark.gpu
CASES = {
    "deepseek-tp8-bf16": ("deepseek-v3.2", Topology(tp=8), 2e-3),
    # e4m3 keys are rounded to bf16 for the score MMA: a looser bound
    "kimi-dcp2-fp8": ("kimi-k3.1", Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8"), 1e-2),
}


@pytest.mark.parametrize("case", CASES)
def test_sparse_core_matches_the_reference(case):
    model, topology, tolerance = CASES[case]
    state = LayerState(RankShape(preset(model), topology), max_batch=6, max_context=4096,
                       seed=int(torch.randint(0, 2**31, ())), device="cuda")
    s, m = state.shape, state.shape.model
    kernels = Kernels(s, state.weights)
    batch, k = 6, m.index_topk
    rows = torch.randn(batch, s.gathered, m.query_row, device="cuda") * 0.3
    mailbox = formats.arm(torch.empty(batch, s.q_heads, m.query_row * s.q_bytes, dtype=torch.uint8, device="cuda"))
    mailbox[:, : s.gathered] = formats.encode_q_rows(rows, topology.q_format).view(batch, s.gathered, -1)
    total = state.caches.mla_cache.view(-1, state.caches.mla_cache.shape[-1]).shape[0]
    slots = torch.stack([torch.randperm(total, device="cuda")[:k] for _ in range(batch)]).int()
    slots[1, 100:] = -1  # a short selection
    slots[2, ::3] = -1  # holes
    slots[3] = -1  # nothing selected: out 0, lse -inf
    slots[4, 128:256] = -1  # a whole split empty
    out = torch.full((batch, s.gathered, m.kv_lora_rank), float("nan"), device="cuda")
    lse = torch.full((batch, s.gathered), float("nan"), device="cuda")
    partial_o, partial_ml = kernels.sparse_core_buffers(batch, "cuda")
    kernels.sparse_core(mailbox, slots, state.caches.mla_cache, partial_o, partial_ml, out, lse, batch)
    torch.cuda.synchronize()
    expect_out, expect_lse = ref.sparse_attention(state, state.caches, formats.decode_q_rows(mailbox[:, : s.gathered],
                                                                                             topology.q_format), slots)
    assert torch.isfinite(out).all(), "every output element written"
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()
    live = [0, 1, 2, 4, 5]
    assert rel_err(out[live], expect_out[live]) < tolerance
    assert (lse[live] - expect_lse[live]).abs().max() < tolerance * 10
