"""The torch reference against float64 math of the same formulas, written independently."""

import math

import pytest
import torch

from conftest import hadamard_matrix, rel_err, yarn_inv_freq
from graphstep import formats
from graphstep import reference as ref
from graphstep.shapes import RankShape, Topology
from graphstep.state import LayerState, local_lens


@pytest.fixture
def state(small):
    return LayerState(small, max_batch=4, max_context=300, seed=1)


def test_state_is_random_and_well_formed(state):
    w, c = state.weights, state.caches
    for t in (w.w_qb, w.w_uk, w.wq_b_index, w.gamma_q, c.mla_cache):
        assert t.float().std() > 0 and not torch.isnan(t.float()).any()
    assert w.w_qb.shape == (4 * 192, 1536) and w.w_uk.shape == (4, 128, 512)
    assert c.index_cache.shape == (4 * state.pages_per_seq + 1, 64 * 132)
    assert sorted(c.block_tables.flatten().tolist()) == list(range(c.block_tables.numel()))
    assert state.trash_page == c.block_tables.numel()  # the spare page no table refers to
    assert (c.mailbox == formats.SENTINEL_BYTE).all()


def test_query_norm_against_float64(state):
    inputs = state.inputs(3, seed=2)
    x = inputs.qkv[:, :1536].double()
    expect = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 1536 + 1e-6) * state.weights.gamma_q.double()
    assert rel_err(ref.query_norm(state, inputs), expect) < 4e-3
    assert rel_err(ref.query_norm(state, inputs, acc=torch.float64), expect) < 4e-3


def test_rope_matches_complex_rotation():
    x = torch.randn(5, 64, dtype=torch.float64)
    cos, sin = formats.rope_table(100, 64, 10000.0)
    pos = torch.tensor([0, 1, 17, 50, 99])
    angle = pos[:, None].double() * 10000.0 ** (-torch.arange(0, 64, 2).double() / 64)
    rot = torch.polar(torch.ones_like(angle), angle)
    inter = torch.view_as_real(torch.view_as_complex(x.view(5, 32, 2)) * rot).flatten(1)
    assert rel_err(formats.rope_interleaved(x, cos[pos].double(), sin[pos].double()), inter) < 1e-6
    neox = torch.complex(x[:, :32], x[:, 32:]) * rot
    assert (
        rel_err(formats.rope_neox(x, cos[pos].double(), sin[pos].double()), torch.cat([neox.real, neox.imag], 1)) < 1e-6
    )


def test_mla_query_against_float64(state):
    inputs = state.inputs(3, seed=3)
    q_c = ref.query_norm(state, inputs)
    got = ref.mla_query(state, inputs, q_c)
    w = state.weights
    for b in range(3):
        pos = int(inputs.positions[b])
        for h in range(4):
            q = q_c[b].double() @ w.w_qb[h * 192 : (h + 1) * 192].double().T
            latent = q[:128] @ w.w_uk[h].double()
            angle = pos * yarn_inv_freq(state.shape.model, 64)
            rope = torch.view_as_real(
                torch.view_as_complex(q[128:].view(32, 2).contiguous()) * torch.polar(torch.ones_like(angle), angle)
            ).flatten()
            assert rel_err(got[b, h], torch.cat([latent, rope])) < 1e-5


def test_kv_insert_writes_exactly_the_new_slots(state):
    inputs = state.inputs(4, seed=4)
    inputs.slot_mapping[1] = -1  # a pad row
    caches = state.clone_caches()
    before = caches.mla_cache.clone()
    ref.kv_insert(state, inputs, caches)
    changed = (caches.mla_cache != before).any(-1).flatten().nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(inputs.slot_mapping[inputs.slot_mapping >= 0].tolist())
    # the row written out in float64: kv_a's RMSNorm, then k_pe rotated by complex pairs
    kv_a, k_pe = inputs.qkv[:, 1536:2048].double(), inputs.qkv[:, 2048:2112].double()
    latent = kv_a / torch.sqrt((kv_a * kv_a).sum(-1, keepdim=True) / 512 + 1e-6) * state.weights.gamma_kv.double()
    for b in (0, 2, 3):
        slot = int(inputs.slot_mapping[b])
        angle = int(inputs.positions[b]) * yarn_inv_freq(state.shape.model, 64)
        rope = torch.view_as_real(
            torch.view_as_complex(k_pe[b].view(32, 2).contiguous()) * torch.polar(torch.ones_like(angle), angle)
        ).flatten()
        assert rel_err(caches.mla_cache.view(-1, 576)[slot].double(), torch.cat([latent[b], rope])) < 4e-3


def test_new_token_slot_follows_block_table(state):
    inputs = state.inputs(4, context_lens=[1, 64, 65, 300])
    tables = inputs.block_tables
    expect = [int(tables[b, p // 64]) * 64 + p % 64 for b, p in enumerate([0, 63, 64, 299])]
    assert inputs.slot_mapping.tolist() == expect


def test_index_scores_against_explicit_loops(state):
    inputs = state.inputs(2, context_lens=[70, 5], seed=5)
    caches = state.clone_caches()
    ref.index_key_insert(state, inputs, caches)
    q_c = ref.query_norm(state, inputs)
    q_fp8, head_w = ref.index_query(state, inputs, q_c)
    scores = ref.index_scores(state, caches, inputs, q_fp8, head_w)
    keys, scales = formats.index_cache_views(caches.index_cache, 64, 128)
    for b, length in enumerate([70, 5]):
        for t in (0, length - 1, length // 2):
            page = int(inputs.block_tables[b, t // 64])
            k = keys[page, t % 64].view(formats.FP8).double()
            total = sum(
                float(head_w[b, h]) * max(0.0, float(q_fp8[b, h].view(formats.FP8).double() @ k)) for h in range(8)
            )
            assert math.isclose(float(scores[b, t]), total * float(scales[page, t % 64]), rel_tol=1e-5, abs_tol=1e-6)
        assert torch.isinf(scores[b, length:]).all() and torch.isfinite(scores[b, :length]).all()


def test_index_key_is_inserted_and_quantized(state):
    inputs = state.inputs(2, seed=6)
    caches = state.clone_caches()
    ref.index_key_insert(state, inputs, caches)
    keys, scales = formats.index_cache_views(caches.index_cache, 64, 128)
    k64 = inputs.qkv[:, 2112:2240].double()
    w = state.weights
    k64 = torch.nn.functional.layer_norm(k64, (128,), w.index_norm_weight.double(), w.index_norm_bias.double(), 1e-6)
    angle = inputs.positions.double()[:, None] * yarn_inv_freq(state.shape.model, 64)[None]
    first, second = k64[:, :32], k64[:, 32:64]
    rope = torch.cat([first * angle.cos() - second * angle.sin(), first * angle.sin() + second * angle.cos()], 1)
    rotated = torch.cat([rope, k64[:, 64:]], 1) @ hadamard_matrix(128).T
    for b in range(2):
        slot = int(inputs.slot_mapping[b])
        scale = float(scales[slot // 64, slot % 64])
        got = keys[slot // 64, slot % 64].view(formats.FP8).double() * scale
        assert rel_err(got, rotated[b]) < 0.07  # fp8 e4m3 keeps 3 mantissa bits
        # ue8m0: the power of two at or above amax / 448
        mantissa, exponent = math.frexp(float(rotated[b].abs().max()) / 448)
        assert scale == 2.0 ** (exponent - (mantissa == 0.5)), (scale, mantissa, exponent)


def test_topk_set_ties_order_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf")], [3.0, 1.0, 3.0, 2.0, 0.0, 3.0]])
    # the three 3.0s tie for two places: the lower indices win; output in index order
    assert ref.topk_indices(scores, 2).tolist() == [[1, 2], [0, 2]]
    assert ref.topk_indices(scores, 4).tolist() == [[1, 2, 3, 4], [0, 2, 3, 5]]
    assert ref.topk_indices(scores, 8).tolist() == [[0, 1, 2, 3, 4, -1, -1, -1], [0, 1, 2, 3, 4, 5, -1, -1]]


def test_topk_on_a_short_row_pads():
    got = ref.topk_indices(torch.tensor([[0.5, -2.0]]), 5)
    assert got.tolist() == [[0, 1, -1, -1, -1]] and got.dtype == torch.int32


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_merge_equals_single_rank_topk(dcp):
    g = torch.Generator().manual_seed(dcp)
    scores = torch.randn(3, 500, generator=g).round(decimals=1)  # many ties
    scores[1, 37:] = float("-inf")  # a short sequence
    k = 64
    expect = ref.topk_indices(scores, k)
    candidates = [ref.local_candidates(scores[:, r::dcp], k, dcp, r) for r in range(dcp)]
    assert torch.equal(ref.dcp_merge(candidates, k), expect)


def test_local_slots_are_this_ranks_selected_tokens_in_order():
    tables = torch.tensor([[5, 2, 9]], dtype=torch.int32)
    merged = torch.tensor([[7, 4, 130, 1, -1]], dtype=torch.int32)
    got = ref.local_slots(merged, tables, 64, dcp=2, rank=0)
    # positions 4 and 130 are rank 0's local tokens 2 and 65
    assert got.tolist() == [[5 * 64 + 2, 2 * 64 + 1, -1, -1, -1]]


def test_sparse_attention_against_explicit_softmax(state):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 3, 576, generator=g, dtype=torch.float64)
    slots = torch.tensor([[0, 70, 5, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    out, lse = ref.sparse_attention(state, state.caches, q, slots, acc=torch.float64)
    rows = state.caches.mla_cache.view(-1, 576).double()
    scale = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2  # YaRN's m^2 (factor 40, mscale 1)
    for h in range(3):
        logits = [float(q[0, h] @ rows[s]) * scale for s in (0, 70, 5)]
        m = max(logits)
        z = sum(math.exp(v - m) for v in logits)
        expect = sum(math.exp(v - m) / z * rows[s, :512] for v, s in zip(logits, (0, 70, 5)))
        assert rel_err(out[0, h], expect) < 1e-9
        assert math.isclose(float(lse[0, h]), m + math.log(z), rel_tol=1e-12)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


def test_reference_step_float32_against_float64(small):
    state = LayerState(small, max_batch=3, max_context=200, seed=9)
    inputs = state.inputs(3, seed=10)
    a = ref.reference_step(state, inputs, state.clone_caches())
    b = ref.reference_step(state, inputs, state.clone_caches(), acc=torch.float64)
    assert rel_err(a.q_rows, b.q_rows) < 1e-2
    same = (a.slots == b.slots).float().mean()
    assert same > 0.9  # float32 vs float64 scores may swap near-equal neighbours
    assert rel_err(a.out, b.out) < 2e-2


@pytest.mark.parametrize("q_format, mla_cache", [("bf16", "fp8"), ("fp8", "bf16")])
def test_dcp_step_formats_and_rearm(q_format, mla_cache):
    from conftest import SMALL

    shape = RankShape(SMALL, Topology(tp=4, dcp=2, rank=1, q_format=q_format, mla_cache=mla_cache))
    state = LayerState(shape, max_batch=2, max_context=300, seed=11)
    inputs = state.inputs(2, context_lens=[300, 3], seed=12)
    peers = state.peer_inputs(inputs, seed=13)
    caches = state.clone_caches()
    out = ref.reference_step(state, inputs, caches, peers)
    lens = local_lens(inputs.context_lens, 2, 1)
    assert (out.slots >= 0).sum(1).tolist()[1] == int(lens[1])
    assert ((out.slots >= 0).sum(1) <= 64).all()
    # rank 1's heads are its own; rank 0's came from the peers
    expect_peer = formats.decode_q_rows(formats.encode_q_rows(peers.rows[:, :4], q_format), q_format)
    assert torch.equal(out.q_rows[:, :4], expect_peer)
    assert torch.isfinite(out.out).all()
    assert (caches.mailbox == formats.SENTINEL_BYTE).all(), "the step re-arms the mailbox it read"


def test_dcp_step_needs_peers(small):
    shape = small.with_topology(dcp=2)
    state = LayerState(shape, max_batch=1, max_context=100)
    with pytest.raises(ValueError, match="peers"):
        ref.reference_step(state, state.inputs(1))


def test_bad_inputs_requests(state):
    with pytest.raises(ValueError, match="max_batch"):
        state.inputs(5)
    with pytest.raises(ValueError, match="context_lens"):
        state.inputs(2, context_lens=[1, 301])
    with pytest.raises(ValueError, match="2 lengths"):
        state.inputs(2, context_lens=[1, 2, 3])
