"""The query-stage kernels on an sm_90 GPU against the torch reference and the order model.
Fresh random inputs every run; outputs are poisoned before each launch."""

import pytest
import torch

from conftest import rel_err
from graphstep import formats, order
from graphstep import reference as ref
from graphstep.launch import ErrorWord, Kernels, MailboxTimeout
from graphstep.shapes import RankShape, Topology, preset, tiled_from
from graphstep.state import LayerState

pytestmark = pytest.mark.gpu
POISON = -1  # 0xFFFF bf16 words: a NaN no kernel writes


def _state(topology, max_batch=128, max_context=4096, seed=None):
    shape = RankShape(preset("deepseek-v3.2"), topology)
    seed = torch.randint(0, 2**31, ()).item() if seed is None else seed
    return LayerState(shape, max_batch=max_batch, max_context=max_context, seed=seed, device="cuda")


@pytest.fixture(scope="module")
def tp8():
    state = _state(Topology(tp=8))
    kernels = Kernels(state.shape, state.weights)
    kernels.warm()
    return state, kernels


def _buffers(state, batch):
    s = state.shape
    return dict(
        qc=torch.full((batch, 1536), POISON, dtype=torch.int16, device="cuda").view(torch.bfloat16),
        qc_private=torch.full((batch, 1536), POISON, dtype=torch.int16, device="cuda").view(torch.bfloat16),
        workspace=torch.full((batch, s.heads, 192), float("nan"), device="cuda"),
        q_rows=formats.arm(torch.empty(batch, s.q_heads, 576 * s.q_bytes, dtype=torch.uint8, device="cuda")),
    )


def _mla_query(kernels, inputs, buf, mla_cache, error, batch, store_qc=False, poll=False, **options):
    """MlaQuery over `inputs` into `_buffers`' tensors (poll: then wait for the peers' rows;
    options: the launcher's others, such as budget_ns)."""
    kernels.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        buf["qc"],
        buf["qc_private"],
        buf["workspace"],
        buf["q_rows"],
        mla_cache,
        error,
        batch,
        store_qc=store_qc,
        poll=poll,
        **options,
    )


def _batches(heads):
    edge = tiled_from(heads)
    return sorted({1, edge - 1, edge, 37, 128})


@pytest.mark.parametrize("batch", _batches(16))
def test_query_norm_equals_order_model(tp8, batch):
    state, kernels = tp8
    inputs = state.inputs(batch)
    qc = _buffers(state, batch)["qc"]
    kernels.query_norm(inputs.qkv, qc, batch)
    torch.cuda.synchronize()
    expect = order.query_norm(inputs.qkv[:, :1536].contiguous(), state.weights.gamma_q, 1e-6, state.shape.heads)
    assert torch.equal(qc, expect)


@pytest.mark.parametrize("batch", _batches(16))
def test_mla_query_qc_is_bit_identical_and_rows_match_reference(tp8, batch):
    state, kernels = tp8
    inputs = state.inputs(batch)
    caches = state.clone_caches()
    buf = _buffers(state, batch)
    norm_qc = _buffers(state, batch)["qc"]
    kernels.query_norm(inputs.qkv, norm_qc, batch)
    error = ErrorWord.new("cuda")
    _mla_query(kernels, inputs, buf, caches.mla_cache, error, batch, store_qc=True)
    torch.cuda.synchronize()
    assert torch.equal(buf["qc"], norm_qc), "MlaQuery's q_c must be bit-identical to QueryNorm's"
    assert (buf["qc_private"].view(torch.int16) == POISON).all(), "store_qc writes the indexer's q_c only"
    q_c = ref.query_norm(state, inputs)
    expect = ref.mla_query(state, inputs, q_c)
    got = formats.decode_q_rows(buf["q_rows"], "bf16")[:, : state.shape.heads]
    assert torch.isfinite(got).all()
    assert rel_err(got[..., :512], expect[..., :512]) < 1e-2
    assert rel_err(got[..., 512:], expect[..., 512:]) < 1e-2
    error.check(state.shape.gathered, state.shape.mailbox_row_chunks)


STREAMED = {  # MlaQuery's streamed project (kernels/mla_query.py), forced on at every head count
    "tp1": Topology(tp=1),
    "tp8": Topology(tp=8),
    "tp1-fp8": Topology(tp=1, q_format="fp8", mla_cache="fp8"),
}


@pytest.mark.parametrize("case", list(STREAMED))
@pytest.mark.parametrize("batch", [1, 3, 16, 17, 40, 64])
def test_mla_query_streamed_project(monkeypatch, case, batch):
    """The streamed project (Q_B through IndexQuery's TMA rings) writes every element of q
    within fp32 rounding of the register kernel's and of the reference, and MlaQuery's rows
    and KV insert match the reference as the register kernel's do."""
    from graphstep.kernels import mla_query

    state = _state(STREAMED[case], max_batch=64)
    kernels = Kernels(state.shape, state.weights)
    inputs = state.inputs(batch)
    fp8 = state.shape.topology.mla_cache == "fp8"
    outputs = {}
    for streamed in (False, True):
        monkeypatch.setattr(mla_query, "STREAM_FROM_HEADS", 1 if streamed else None)
        assert bool(kernels.mla_query_tokens(batch)) == streamed
        caches = state.clone_caches()
        caches.mla_cache.view(torch.uint8).fill_(0xFF)  # NaN in both formats: nothing MlaQuery writes
        buf = _buffers(state, batch)
        error = ErrorWord.new("cuda")
        _mla_query(kernels, inputs, buf, caches.mla_cache, error, batch)
        torch.cuda.synchronize()
        error.check(state.shape.gathered, state.shape.mailbox_row_chunks)
        row_bytes = 656 if fp8 else 1152
        new_rows = caches.mla_cache.view(torch.uint8).view(-1, row_bytes)[inputs.slot_mapping.long()]
        outputs[streamed] = (buf["workspace"], buf["q_rows"], new_rows, buf["qc_private"])
    ws, q_rows, new_rows, q_c_kernel = outputs[True]
    assert torch.isfinite(ws).all(), "every element of q is written"
    # q from the q_c the kernel read (the reference's norm may round a q_c element the other way)
    want = (q_c_kernel.double() @ state.weights.w_qb.double().T).view(batch, state.shape.heads, 192)
    assert rel_err(ws, want) < 1e-5
    assert rel_err(ws, outputs[False][0]) < 1e-5
    q_c = ref.query_norm(state, inputs)
    fmt = state.shape.topology.q_format
    got = formats.decode_q_rows(q_rows, fmt)[:, : state.shape.heads]
    expect = ref.mla_query(state, inputs, q_c)
    assert rel_err(got, expect.clamp(-448, 448) if fmt == "fp8" else expect) < (0.05 if fmt == "fp8" else 1e-2)
    assert torch.equal(new_rows, outputs[False][2]), "the KV insert is the register kernel's code"
    rows = formats.unpack_mla_fp8(new_rows, 512) if fp8 else new_rows.view(torch.bfloat16).float()
    assert rel_err(rows, ref.kv_row(state, inputs)) < (0.05 if fp8 else 1e-2)


@pytest.mark.parametrize("case", list(STREAMED))
@pytest.mark.parametrize("batch", [1, 17, 64, 70])
def test_mla_query_staged_absorb_is_bit_identical(monkeypatch, case, batch):
    """The absorb with its tiles' q_nope staged in shared memory (mla_query.ABSORB_STAGED)
    writes exactly the plain absorb's query rows: the same bf16 words into the same MMAs."""
    from graphstep.kernels import catalog, mla_query

    state = _state(STREAMED[case], max_batch=70)
    kernels = Kernels(state.shape, state.weights)
    inputs = state.inputs(batch)
    rows = {}
    for staged in (False, True):
        monkeypatch.setattr(mla_query, "ABSORB_STAGED", staged)
        variant = catalog.build(state.shape, "mla_query", tiled=kernels.tiled(batch), poll=False)
        assert variant.name.endswith("_staged") == staged  # the launch below compiles this variant
        buf = _buffers(state, batch)
        error = ErrorWord.new("cuda")
        _mla_query(kernels, inputs, buf, state.clone_caches().mla_cache, error, batch)
        torch.cuda.synchronize()
        error.check(state.shape.gathered, state.shape.mailbox_row_chunks)
        rows[staged] = buf["q_rows"][:batch, : state.shape.heads]
    chunks = rows[True].reshape(batch, state.shape.heads, -1, 16)
    assert not (chunks == 0xFF).all(dim=-1).any(), "every 16-byte chunk of every row is written"
    assert torch.equal(rows[True], rows[False])


def test_kv_insert_past_2_gib_of_cache():
    """A 32K-context, 64-sequence bf16 MLA cache is 2.4 GB: the highest slots' byte
    offsets do not fit in 32 bits (the step crashed at B = 64 before they were 64-bit)."""
    state = _state(Topology(tp=8), max_batch=64, max_context=32768)
    kernels = Kernels(state.shape, state.weights)
    rows = state.caches.mla_cache.view(-1, 576)
    assert rows.shape[0] * 1152 > 2**31
    inputs = state.inputs(4, context_lens=32768)
    inputs.slot_mapping.copy_(torch.arange(rows.shape[0] - 4, rows.shape[0], device="cuda"))
    slots = inputs.slot_mapping.long()
    rows[slots] = torch.full((4, 576), POISON, dtype=torch.int16, device="cuda").view(torch.bfloat16)
    buf = _buffers(state, 4)
    _mla_query(kernels, inputs, buf, state.caches.mla_cache, ErrorWord.new("cuda"), 4)
    torch.cuda.synchronize()
    assert (rows[slots].view(torch.int16) != POISON).all()
    assert rel_err(rows[slots].float(), ref.kv_row(state, inputs)) < 1e-2


def test_kv_insert_writes_exactly_the_new_slots(tp8):
    state, kernels = tp8
    batch = 24
    inputs = state.inputs(batch)
    inputs.slot_mapping[5] = -1  # a pad row writes nothing
    caches = state.clone_caches()
    caches.mla_cache.view(torch.int16).fill_(POISON)
    before = caches.mla_cache.clone()
    buf = _buffers(state, batch)
    _mla_query(kernels, inputs, buf, caches.mla_cache, ErrorWord.new("cuda"), batch)
    torch.cuda.synchronize()
    assert (buf["qc"].view(torch.int16) == POISON).all(), "without store_qc the indexer's q_c is untouched"
    rows = caches.mla_cache.view(-1, 576)
    changed = (rows.view(torch.int16) != before.view(-1, 576).view(torch.int16)).any(-1).nonzero().flatten()
    slots = inputs.slot_mapping[inputs.slot_mapping >= 0].long()
    assert sorted(changed.tolist()) == sorted(slots.tolist())
    assert (rows[slots].view(torch.int16) != POISON).all(), "every element of a new row is written"
    expect = ref.kv_row(state, inputs)[inputs.slot_mapping >= 0]
    assert rel_err(rows[slots].float(), expect) < 1e-2


def test_fp8_query_rows_and_cache(tp8):
    state = _state(Topology(tp=8, q_format="fp8", mla_cache="fp8"), max_batch=16)
    kernels = Kernels(state.shape, state.weights)
    batch = 16
    inputs = state.inputs(batch)
    caches = state.clone_caches()
    caches.mla_cache.fill_(0xFF)  # e4m3 NaN, a NaN fp32 scale, bf16 NaN: nothing MlaQuery writes
    before = caches.mla_cache.clone()
    buf = _buffers(state, batch)
    _mla_query(kernels, inputs, buf, caches.mla_cache, ErrorWord.new("cuda"), batch)
    torch.cuda.synchronize()
    expect = ref.mla_query(state, inputs, ref.query_norm(state, inputs))
    got = formats.decode_q_rows(buf["q_rows"], "fp8")[:, :16]
    assert rel_err(got, expect.clamp(-448, 448)) < 0.05  # e4m3: 3 mantissa bits
    flat, slots = caches.mla_cache.view(-1, 656), inputs.slot_mapping.long()
    changed = (flat != before.view(-1, 656)).any(-1).nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(slots.tolist()), "exactly the new slots are written"
    written = flat[slots]
    assert not (written[:, :512] == 0xFF).any(), "every e4m3 byte of a new row"
    assert not (written[:, 512:528].contiguous().view(torch.int32) == -1).any(), "every scale"
    assert not (written[:, 528:].contiguous().view(torch.int16) == -1).any(), "every rope element"
    rows = formats.unpack_mla_fp8(written, 512)
    assert rel_err(rows, ref.kv_row(state, inputs)) < 0.05
    scales = written[:, 512:528].contiguous().view(torch.float32)
    assert (torch.frexp(scales).mantissa == 0.5).all(), "DeepSeek-V3.2's ue8m0 scales: powers of two"


@pytest.fixture(scope="module")
def dcp2():
    state = _state(Topology(tp=8, dcp=2, rank=1), max_batch=32)
    kernels = Kernels(state.shape, state.weights)
    kernels.warm()
    return state, kernels


def _publish_peers(state, q_rows, batch, skip=None):
    """Rank 0's rows (the peer) written as a remote publisher would, optionally leaving out
    one (token, row, chunk)."""
    peers = torch.randn(batch, state.shape.heads, 576, device="cuda")
    encoded = formats.encode_q_rows(peers, state.shape.topology.q_format).view(batch, state.shape.heads, -1)
    q_rows[:batch, : state.shape.heads] = encoded
    if skip is not None:
        token, row, chunk = skip
        q_rows[token, row, 16 * chunk : 16 * chunk + 16] = formats.SENTINEL_BYTE


@pytest.mark.parametrize("poll_in_mla", [False, True])
def test_publish_then_wait_returns(dcp2, poll_in_mla):
    state, kernels = dcp2
    batch = 19
    inputs = state.inputs(batch)
    buf = _buffers(state, batch)
    _publish_peers(state, buf["q_rows"], batch)
    error = ErrorWord.new("cuda")
    _mla_query(kernels, inputs, buf, state.clone_caches().mla_cache, error, batch, poll=poll_in_mla)
    if not poll_in_mla:
        kernels.query_wait(buf["q_rows"], error, batch)
    torch.cuda.synchronize()
    error.check(state.shape.gathered, state.shape.mailbox_row_chunks)
    assert formats.first_missing(buf["q_rows"], batch, state.shape.gathered) is None
    own = formats.decode_q_rows(buf["q_rows"][:, 16:32], "bf16")
    expect = ref.mla_query(state, inputs, ref.query_norm(state, inputs))
    assert rel_err(own, expect) < 1e-2


@pytest.mark.parametrize("poll_in_mla", [False, True])
def test_missing_publisher_is_reported_and_the_next_step_works(dcp2, poll_in_mla):
    state, kernels = dcp2
    batch = 7
    inputs = state.inputs(batch)
    buf = _buffers(state, batch)
    missing = (5, 11, 40)  # token 5, rank 0's head row 11, chunk 40
    _publish_peers(state, buf["q_rows"], batch, skip=missing)
    error = ErrorWord.new("cuda")
    mla_cache = state.clone_caches().mla_cache
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _mla_query(kernels, inputs, buf, mla_cache, error, batch, poll=poll_in_mla, budget_ns=20_000_000)
    if not poll_in_mla:
        kernels.query_wait(buf["q_rows"], error, batch, budget_ns=20_000_000)
    end.record()
    torch.cuda.synchronize()
    assert 20 <= start.elapsed_time(end) < 2 * 20 + 10  # gave up within 2x its 20 ms budget + launch slack
    with pytest.raises(MailboxTimeout) as timeout:
        error.check(state.shape.gathered, state.shape.mailbox_row_chunks)
    assert (timeout.value.token, timeout.value.row, timeout.value.chunk) == missing
    # the process is usable: publish the chunk and the next step passes
    _publish_peers(state, buf["q_rows"], batch)
    kernels.query_wait(buf["q_rows"], error, batch)
    torch.cuda.synchronize()
    error.check(state.shape.gathered, state.shape.mailbox_row_chunks)
