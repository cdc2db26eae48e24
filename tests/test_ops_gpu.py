"""graphstep.ops on an sm_90 GPU: each op bit for bit against its launcher (graphstep.launch,
itself tested against the reference), a step of ops against reference_step, and the same
step under torch.compile(fullgraph=True) and inside a user's own CUDA graph."""

import pytest
import torch

from conftest import rel_err
from graphstep import formats, ops, order
from graphstep import reference as ref
from graphstep.launch import ErrorWord, Kernels, MailboxTimeout, TvmFfiKernels
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState

pytestmark = pytest.mark.gpu
G = torch.ops.graphstep
BATCH = 5


def _seed():
    return int(torch.randint(0, 2**31, ()))


class Setup:
    """A state, its launcher, the ops' shape key and MLA weight arguments."""

    def __init__(self, topology: Topology, max_batch: int = 16):
        shape = RankShape(preset("deepseek-v3.2"), topology)
        self.state = LayerState(shape, max_batch=max_batch, max_context=2048, seed=_seed(), device="cuda")
        self.kernels = Kernels(shape, self.state.weights)
        self.key = ops.shape_key(shape)
        w = self.state.weights
        self.mla_weights = (w.gamma_q, w.gamma_kv, w.w_qb, self.kernels.w_uk_t, w.rope_cos, w.rope_sin)
        width = self.state.pages_per_seq * shape.model.page_size
        ops.warm(shape, range(1, max_batch + 1), width)
        self.kernels.warm(range(1, max_batch + 1), width)


@pytest.fixture(scope="module")
def tp8():
    return Setup(Topology(tp=8))


@pytest.fixture(scope="module")
def dcp2():
    return Setup(Topology(tp=8, dcp=2, rank=1))


def _error():
    return ErrorWord.new("cuda")


def test_the_ops_launch_through_tvm_ffi(tp8):
    """The issue's eager path: apache-tvm-ffi (the ffi extra) installed on this machine."""
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed: the ops use CuTe DSL's own path")
    assert isinstance(ops._kernels(tp8.key, True), TvmFfiKernels)


def test_query_norm_and_index_query_equal_their_launchers(tp8):
    state, kernels, w = tp8.state, tp8.kernels, tp8.state.weights
    inputs = state.inputs(BATCH, seed=_seed())
    q_c = G.query_norm(inputs.qkv, w.gamma_q, tp8.key)
    expect = torch.full_like(q_c, float("nan"))  # poisoned: every element must be written
    kernels.query_norm(inputs.qkv, expect, BATCH)
    assert torch.equal(q_c, expect)
    q, head_w = G.index_query(
        q_c, inputs.qkv, inputs.context_lens, w.wq_b_index, w.index_rope_cos, w.index_rope_sin, _error().word, tp8.key
    )
    expect_q, expect_w = torch.full_like(q, 0xFF), torch.full_like(head_w, float("nan"))  # 0xFF: e4m3 NaN
    kernels.index_query(q_c, inputs.qkv, inputs.context_lens, expect_q, expect_w, BATCH)
    assert torch.equal(q, expect_q) and torch.equal(head_w, expect_w)


def test_index_key_and_mla_query_write_what_their_launchers_write(tp8):
    state, kernels, w = tp8.state, tp8.kernels, tp8.state.weights
    inputs = state.inputs(BATCH, seed=_seed())
    mine, theirs = state.clone_caches(), state.clone_caches()
    G.index_key(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        w.index_norm_weight,
        w.index_norm_bias,
        w.index_rope_cos,
        w.index_rope_sin,
        mine.index_cache,
        _error().word,
        tp8.key,
    )
    kernels.index_key(inputs.qkv, inputs.context_lens, inputs.slot_mapping, theirs.index_cache, BATCH)
    error = _error()
    q_c = G.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        *tp8.mla_weights,
        mine.mailbox,
        mine.mla_cache,
        error.word,
        tp8.key,
    )
    expect_qc = torch.empty_like(q_c)
    workspace = torch.empty(BATCH, state.shape.heads, 192, device="cuda")
    theirs_error = _error()
    kernels.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        expect_qc,
        expect_qc,
        workspace,
        theirs.mailbox,
        theirs.mla_cache,
        theirs_error,
        BATCH,
        store_qc=True,
        poll=False,
    )
    torch.cuda.synchronize()
    assert torch.equal(q_c, expect_qc)
    for name in ("index_cache", "mla_cache", "mailbox"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    assert not torch.equal(mine.mla_cache, state.caches.mla_cache)  # the op wrote the new tokens
    assert error.word.tolist() == ErrorWord.new("cuda").word.tolist()


def test_dsa_index_top_k_and_sparse_core_equal_their_launchers(tp8):
    state, kernels, k = tp8.state, tp8.kernels, 2048
    inputs = state.inputs(BATCH, seed=_seed())
    caches = state.caches
    q = torch.randint(0, 120, (BATCH, 64, 128), dtype=torch.uint8, device="cuda")  # finite e4m3
    head_w = torch.randn(BATCH, 64, device="cuda")
    error = _error()
    scores = G.dsa_index(q, head_w, caches.index_cache, inputs.block_tables, inputs.context_lens, error.word, tp8.key)
    expect = torch.empty_like(scores)
    kernels.dsa_index(q, head_w, caches.index_cache, inputs.block_tables, inputs.context_lens, expect, BATCH)
    assert torch.equal(scores, expect)
    slots, none = G.top_k(scores, inputs.block_tables, inputs.context_lens, error.word, tp8.key)
    assert none.shape == (BATCH, 0)
    expect_slots = torch.full_like(slots, -7)
    kernels.top_k(scores, inputs.block_tables, inputs.context_lens, expect_slots, scores, BATCH)
    assert torch.equal(slots, expect_slots)
    rows = formats.encode_q_rows(torch.randn(BATCH, 16, 576, device="cuda"), "bf16").view(BATCH, 16, -1)
    for spc in (None, 256, k):
        out, lse = G.sparse_core(rows, slots, caches.mla_cache, error.word, tp8.key, slots_per_cta=spc)
        partial_o, partial_ml = kernels.sparse_core_buffers(BATCH, "cuda")
        expect_out, expect_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        kernels.sparse_core(rows, slots, caches.mla_cache, partial_o, partial_ml, expect_out, expect_lse, BATCH, spc)
        assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse), spc
    # the step's variant: the rows read come back, the mailbox is re-armed
    mailbox, theirs = rows.clone(), rows.clone()
    out, lse, published = G.sparse_core_publish(mailbox, slots, caches.mla_cache, error.word, tp8.key)
    expect_out, expect_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    expect_rows = torch.full_like(published, 0xA5)
    kernels.sparse_core(
        theirs, slots, caches.mla_cache, partial_o, partial_ml, expect_out, expect_lse, BATCH, q_out=expect_rows
    )
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
    assert torch.equal(published, rows) and torch.equal(published, expect_rows)
    assert torch.equal(mailbox, theirs) and bool((mailbox == formats.SENTINEL_BYTE).all())
    assert error.word.tolist() == ErrorWord.new("cuda").word.tolist()  # nothing out of range


def test_dcp_top_k_merge_and_wait(dcp2):
    state, kernels, k = dcp2.state, dcp2.kernels, 2048
    inputs = state.inputs(BATCH, seed=_seed())
    scores = torch.randn(BATCH, state.pages_per_seq * 64, device="cuda")
    caches, error = state.clone_caches(), _error()
    positions, own_scores = G.top_k(scores, inputs.block_tables, inputs.context_lens, error.word, dcp2.key)
    expect_p, expect_s = torch.empty_like(positions), torch.empty_like(own_scores)
    kernels.top_k(scores, inputs.block_tables, inputs.context_lens, expect_p, expect_s, BATCH)
    assert torch.equal(positions, expect_p) and torch.equal(own_scores, expect_s)
    peers = state.peer_inputs(inputs, seed=_seed())
    slots = G.dcp_merge(positions, own_scores, peers.positions, peers.scores, inputs.block_tables, error.word, dcp2.key)
    expect = torch.empty_like(slots)
    kernels.dcp_merge(positions, own_scores, peers.positions, peers.scores, inputs.block_tables, expect, BATCH)
    assert torch.equal(slots, expect)
    assert (slots >= 0).sum() > 0 and slots.shape == (BATCH, k)
    # QueryWait: returns once both ranks' rows are in; records a chunk that never lands
    ref.publish(state, caches, peers.rows[:, : state.shape.heads], rank=0)
    G.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        *dcp2.mla_weights,
        caches.mailbox,
        caches.mla_cache,
        error.word,
        dcp2.key,
    )
    G.query_wait(caches.mailbox, error.word, BATCH, dcp2.key)
    torch.cuda.synchronize()
    assert error.word.tolist() == ErrorWord.new("cuda").word.tolist()
    caches.mailbox[2, 3, 16:32] = formats.SENTINEL_BYTE  # rank 0's token 2, row 3, chunk 1 never lands
    G.query_wait(caches.mailbox, error.word, BATCH, dcp2.key, budget_ns=20_000_000)
    with pytest.raises(MailboxTimeout, match="token 2, head row 3, chunk 1"):
        error.check(state.shape.gathered, state.shape.mailbox_row_chunks)


def _step(setup, inputs, caches, error):
    """One dcp = 1 step of ops: IndexKey, MlaQuery, IndexQuery, DsaIndex, TopK, SparseCore."""
    w, key = setup.state.weights, setup.key
    lens, slot_mapping, tables = inputs.context_lens, inputs.slot_mapping, inputs.block_tables
    index_rope = (w.index_rope_cos, w.index_rope_sin)
    G.index_key(
        inputs.qkv, lens, slot_mapping, w.index_norm_weight, w.index_norm_bias, *index_rope, caches[0], error, key
    )
    q_c = G.mla_query(inputs.qkv, lens, slot_mapping, *setup.mla_weights, caches[2], caches[1], error, key)
    q, head_w = G.index_query(q_c, inputs.qkv, lens, w.wq_b_index, *index_rope, error, key)
    scores = G.dsa_index(q, head_w, caches[0], tables, lens, error, key)
    slots, _ = G.top_k(scores, tables, lens, error, key)
    out, lse = G.sparse_core(caches[2], slots, caches[1], error, key)
    return q_c, scores, slots, out, lse


def _caches(state):
    c = state.clone_caches()
    return c.index_cache, c.mla_cache, c.mailbox


def test_a_step_of_ops_matches_the_reference(tp8):
    state = tp8.state
    inputs = state.inputs(3, seed=_seed())
    expect = ref.reference_step(state, inputs, state.clone_caches())
    caches = _caches(state)
    q_c, scores, slots, out, lse = _step(tp8, inputs, caches, _error().word)
    torch.cuda.synchronize()
    assert rel_err(q_c.float(), expect.q_c.float()) < 1e-2
    # MlaQuery's q_c is QueryNorm's, bit for bit (the order model of the variant at this batch)
    q_a = inputs.qkv[:, :1536].contiguous()
    assert torch.equal(q_c, order.query_norm(q_a, state.weights.gamma_q, state.shape.model.rms_eps, state.shape.heads))
    assert rel_err(formats.decode_q_rows(caches[2][:3, :16], "bf16"), expect.q_rows) < 1e-2
    assert torch.equal(slots, ref.to_slots(ref.topk_indices(scores, 2048), inputs.block_tables, 64))
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(slots, expect.slots))
    assert overlap >= 0.95 * (expect.slots >= 0).sum()
    assert rel_err(out, expect.out) < 2e-2


def test_a_step_of_ops_under_torch_compile_fullgraph_equals_eager(tp8):
    state = tp8.state
    inputs = state.inputs(4, seed=_seed())
    eager_caches, compiled_caches = _caches(state), _caches(state)
    eager = _step(tp8, inputs, eager_caches, _error().word)
    compiled = torch.compile(lambda i, c, e: _step(tp8, i, c, e), fullgraph=True)
    got = compiled(inputs, compiled_caches, _error().word)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    assert all(torch.equal(a, b) for a, b in zip(compiled_caches, eager_caches))


def test_a_step_of_ops_in_a_users_cuda_graph_equals_eager(tp8):
    state, batch = tp8.state, 6
    first, second = state.inputs(batch, seed=_seed()), state.inputs(batch, seed=_seed())
    static = state.inputs(batch, seed=_seed())
    caches, error = _caches(state), _error().word
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(tp8, first, caches, error)  # warm-up outside capture, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(tp8, static, caches, error)
    for name in ("qkv", "context_lens", "slot_mapping", "block_tables"):
        getattr(static, name).copy_(getattr(second, name))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in captured]
    eager = _step(tp8, second, caches, error)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
    assert not torch.equal(replayed[3], _step(tp8, first, caches, error)[3])  # the replay read the new inputs
