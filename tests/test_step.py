"""DecodeStep on the CPU: construction, validation, padding, and the torch backend's
eager step against the reference."""

import dataclasses

import pytest
import torch

from conftest import SMALL, hadamard_matrix, rel_err, yarn_inv_freq
from graphstep import formats
from graphstep import reference as ref
from graphstep.shapes import RankShape, Topology
from graphstep.step import DecodeStep


def _step(topology=Topology(tp=4), sizes=(1, 4, 8), **kw):
    return DecodeStep(
        RankShape(SMALL, topology), capture_sizes=sizes, backend="torch", device="cpu", max_context=200, **kw
    )


def test_padding_picks_the_next_captured_size():
    step = _step(sizes=(8, 1, 4, 4))
    assert step.sizes == [1, 4, 8]
    assert [step.padded(b) for b in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    with pytest.raises(ValueError, match=r"batch 9 exceeds the largest captured size 8 \(captured: \[1, 4, 8\]\)"):
        step.padded(9)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        step.padded(0)


def test_load_pads_the_rows_past_the_batch_after_a_full_batch_filled_them():
    step = _step()
    full, short = step.state.inputs(4, seed=1), step.state.inputs(3, seed=2)
    b = step.buffers
    assert step.load(full) == 4
    assert torch.equal(b.qkv[:4], full.qkv) and torch.equal(b.block_tables[:4], full.block_tables)
    assert step.load(short) == 4  # row 3 held the full batch's token: padded again
    assert torch.equal(b.qkv[:3], short.qkv) and (b.qkv[3] == 0).all()
    assert b.context_lens[3] == 1 and b.slot_mapping[3] == -1
    assert (b.block_tables[3] == step.state.trash_page).all()
    assert torch.equal(b.slot_mapping[:3], short.slot_mapping)


def test_outputs_view_the_buffers_the_step_holds_now():
    """outputs() keeps its views per batch, in a new StepOutputs each call; a buffer replaced
    since gets fresh views."""
    step = _step()
    first, again = step.outputs(3), step.outputs(3)
    assert first is not again and first.out is again.out and first.out.shape[0] == 3
    step.buffers.out = torch.full_like(step.buffers.out, 5)
    fresh = step.outputs(3)
    assert fresh.out is not first.out and (fresh.out == 5).all()
    assert fresh.out.data_ptr() == step.buffers.out.data_ptr()


def test_load_reuses_its_copies_only_while_the_buffers_are_the_same_tensors():
    """load() keeps its destination views and padding per batch; a buffer replaced since (a new
    tensor) gets fresh ones, so no load writes into a tensor the step no longer reads."""
    step = _step()
    first, second = step.state.inputs(3, seed=3), step.state.inputs(3, seed=4)
    step.load(first)
    plan = step._load_plan(3, 4)
    assert step._load_plan(3, 4)[0][0] is plan[0][0]  # reused
    old = step.buffers.qkv
    step.buffers.qkv = torch.full_like(old, 7)
    step.load(second)
    assert torch.equal(step.buffers.qkv[:3], second.qkv) and (step.buffers.qkv[3] == 0).all()
    assert torch.equal(old[:3], first.qkv), "the replaced buffer is not written"
    assert step.load(step.state.inputs(4, seed=5)) == 4 and step.load(step.state.inputs(1, seed=6)) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(backend="triton"), "backend 'triton'"),
        (dict(capture_sizes=()), "at least one"),
        (dict(capture_sizes=(0, 4)), "capture size must be a positive int"),
        (dict(policy="1:fork_poll", topology=Topology(tp=1, wide=True)), "'fork_poll'"),
        (dict(policy="2:bogus"), "'2:bogus'"),
        (dict(backend="cute"), "sm_90"),
        (dict(max_context=163841), "max_context 163841: more than small's max_seq_len 163840"),
    ],
)
def test_construction_errors(kwargs, message):
    topology = kwargs.pop("topology", Topology(tp=4))
    args = dict(capture_sizes=(1, 4), backend="torch", device="cpu", max_context=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        DecodeStep(RankShape(SMALL, topology), **args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(capture_sizes=4), r"capture_sizes must be a list of batch sizes, e.g. \[1, 4\], got 4"),
        (dict(capture_sizes=None), r"capture_sizes must be a list of batch sizes, e.g. \[1, 4\], got None"),
        (dict(capture_sizes=torch.tensor(4)), r"capture_sizes must be a list of batch sizes, .* got tensor"),
        (dict(policy=3), "policy must be a mode or a 'rows:mode,...' table"),
    ],
)
def test_construction_type_errors(kwargs, message):
    args = dict(capture_sizes=(1, 4), backend="torch", device="cpu", max_context=100)
    args.update(kwargs)
    with pytest.raises(TypeError, match=message):
        DecodeStep(RankShape(SMALL, Topology(tp=4)), **args)


def test_capture_sizes_take_numpy_and_torch_integers():
    import numpy as np

    assert _step(sizes=np.array([4, 1])).sizes == [1, 4]
    assert _step(sizes=torch.tensor([2, 8])).sizes == [2, 8]
    assert all(type(size) is int for size in _step(sizes=np.array([4, 1])).sizes)


def test_outputs_and_plan_refuse_what_they_cannot_mean():
    """outputs(batch) past the largest captured size would silently give fewer rows; plan()
    with a bare string would read it as modes 'f', 'o', ..."""
    step = _step(sizes=(1, 4))
    assert step.outputs(4).out.shape[0] == 4
    with pytest.raises(ValueError, match="batch 10 exceeds the largest captured size 4"):
        step.outputs(10)
    with pytest.raises(ValueError, match="batch must be a positive int, got -1"):
        step.outputs(-1)
    with pytest.raises(TypeError, match=r"modes must be a tuple of mode names, e.g. \('fork',\)"):
        step.plan("fork")


def test_qkv_of_the_wrong_rank_or_type_is_named():
    step = _step()
    inputs = step.state.inputs(2)
    one_row = dataclasses.replace(inputs, qkv=inputs.qkv[0])
    with pytest.raises(ValueError, match=r"inputs.qkv must have shape \[B, \d+\], got \[\d+\]"):
        step.step(one_row, eager=True)
    with pytest.raises(TypeError, match="inputs.qkv must be a torch.Tensor, got list"):
        step.step(dataclasses.replace(inputs, qkv=inputs.qkv.tolist()), eager=True)


def test_modes_follow_the_policy_table():
    """A size the table does not name takes the topology's default (TP 4: fork_poll); a table
    naming no captured size is refused (it would change nothing)."""
    step = _step(policy="1:serial,8:fork")
    assert step.modes == {1: "serial", 4: "fork_poll", 8: "fork"}
    with pytest.raises(ValueError, match=r"overlap policy '3:serial': no entry names a captured size"):
        _step(policy="3:serial")


def test_step_before_capture_and_capture_on_cpu_fail_clearly():
    step = _step()
    inputs = step.state.inputs(2)
    with pytest.raises(RuntimeError, match="before capture"):
        step.step(inputs)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        step.capture()


def test_bad_inputs_name_what_was_expected():
    step = _step()
    good = step.state.inputs(2)

    def with_(**change):
        fields = dict(
            qkv=good.qkv, context_lens=good.context_lens, slot_mapping=good.slot_mapping, block_tables=good.block_tables
        )
        fields.update(change)
        return type(good)(**fields)

    cases = [
        (with_(qkv=good.qkv.float()), "inputs.qkv must be torch.bfloat16"),
        (with_(qkv=good.qkv[:, :100]), r"inputs.qkv must have shape \[2, 2248\], got \[2, 100\]"),
        (with_(context_lens=good.context_lens.long()), "inputs.context_lens must be torch.int32"),
        (with_(slot_mapping=good.slot_mapping[:1]), r"inputs.slot_mapping must have shape \[2\]"),
        (with_(qkv=torch.empty(2, 4496, dtype=torch.bfloat16)[:, ::2]), "contiguous"),
        (with_(context_lens=torch.tensor([0, 3], dtype=torch.int32)), r"\[1, 200\]"),
        (with_(context_lens=torch.tensor([5, 201], dtype=torch.int32)), r"\[1, 200\]"),
    ]
    for inputs, message in cases:
        with pytest.raises(ValueError, match=message):
            step.step(inputs, eager=True)
    big = step.state  # a batch above the largest size
    with pytest.raises(ValueError, match="exceeds the largest captured size 8"):
        DecodeStep(
            RankShape(SMALL, Topology(tp=4)), capture_sizes=(1, 8), backend="torch", device="cpu", max_context=200
        ).step(_inputs_of(big, 9), eager=True)
    with pytest.raises(TypeError, match="StepInputs"):
        step.step({"qkv": good.qkv}, eager=True)


def _overlap(got, expect) -> float:
    """Fraction of the reference's selected slots that the step selected too."""
    hits = sum(len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(got, expect))
    return hits / max(1, int((expect >= 0).sum()))


def _inputs_of(state, batch):
    qkv = torch.randn(batch, 2248).bfloat16()
    lens = torch.full((batch,), 10, dtype=torch.int32)
    tables = torch.zeros(batch, state.pages_per_seq, dtype=torch.int32)
    return type(state.inputs(1))(qkv, lens, torch.zeros(batch, dtype=torch.int32), tables)


def _rope(x, pos, inv_freq, interleaved):
    """RoPE written out from its definition (float64), not through graphstep.formats."""
    half = x.shape[-1] // 2
    angle = pos.double()[:, None] * inv_freq[None]
    cos, sin = angle.cos(), angle.sin()
    a, b = (x[:, 0::2], x[:, 1::2]) if interleaved else (x[:, :half], x[:, half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.stack([ra, rb], dim=-1).flatten(1) if interleaved else torch.cat([ra, rb], dim=1)


def _within_bf16(got, expect):
    """Each element within one bf16 rounding (2^-8 relative) of the float64 value."""
    got, expect = got.double(), expect.double()
    return bool(((got - expect).abs() <= expect.abs() * 2**-8 + 1e-6).all())


def _independent_checks(step, inputs, got, before):
    """q_c and the new cache rows computed here from their definitions in float64, and every
    other cache row untouched: none of it through the reference functions the torch backend calls."""
    m, w = step.shape.model, step.state.weights
    qkv, pos = inputs.qkv.double(), inputs.context_lens.long() - 1
    cols = m.packed_columns
    q_a = qkv[:, slice(*cols["q_a"])]
    q_c = q_a / (q_a.square().mean(1, keepdim=True) + m.rms_eps).sqrt() * w.gamma_q.double()
    assert _within_bf16(got.q_c, q_c)
    kv = qkv[:, slice(*cols["kv_a"])]
    kv = kv / (kv.square().mean(1, keepdim=True) + m.rms_eps).sqrt() * w.gamma_kv.double()
    row = torch.cat([kv, _rope(qkv[:, slice(*cols["k_pe"])], pos, yarn_inv_freq(m, m.qk_rope_dim), True)], dim=1)
    k = qkv[:, slice(*cols["idx_k"])]
    k = (k - k.mean(1, keepdim=True)) / (k.var(1, unbiased=False, keepdim=True) + m.index_norm_eps).sqrt()
    k = k * w.index_norm_weight.double() + w.index_norm_bias.double()
    index_freq = yarn_inv_freq(m, m.index_rope_dim)
    k = torch.cat([_rope(k[:, : m.index_rope_dim], pos, index_freq, False), k[:, m.index_rope_dim :]], dim=1)
    k = k @ hadamard_matrix(m.index_dim).T  # the indexer's rotation (on in SMALL, as in DeepSeek-V3.2)
    mla = step.caches.mla_cache.view(-1, m.query_row)
    index = step.caches.index_cache
    page_keys = m.page_size * m.index_dim
    written = set()
    for b, slot in enumerate(inputs.slot_mapping.tolist()):
        if slot < 0:
            continue
        written.add(slot)
        assert _within_bf16(mla[slot], row[b]), b
        page, offset = divmod(slot, m.page_size)
        key = index[page, offset * m.index_dim : (offset + 1) * m.index_dim].view(torch.float8_e4m3fn).double()
        scale = index[page, page_keys + 4 * offset : page_keys + 4 * offset + 4].view(torch.float32).double()
        assert ((key * scale - k[b]).abs() <= k[b].abs() / 16 + scale * 2**-9).all(), b  # e4m3: 3 mantissa bits
    assert written
    spare = step.state.trash_page
    others = torch.ones(mla.shape[0], dtype=torch.bool)
    others[sorted(written)] = False
    others[spare * m.page_size :] = False  # the pad rows' writes
    assert torch.equal(mla[others], before.mla_cache.view(-1, m.query_row)[others])
    keys_now = step.caches.index_cache[:spare, :page_keys].view(spare, m.page_size, m.index_dim)
    keys_before = before.index_cache[:spare, :page_keys].view(spare, m.page_size, m.index_dim)
    mask = others[: spare * m.page_size].view(spare, m.page_size)
    assert torch.equal(keys_now[mask], keys_before[mask])


@pytest.mark.parametrize("mode", ["serial", "fork"])
def test_torch_backend_eager_step_equals_the_reference(mode):
    step = _step(policy=mode)
    inputs = step.state.inputs(3, seed=5)  # pads to 4
    expect_caches = step.state.clone_caches()
    before = step.state.clone_caches()
    expect = ref.reference_step(step.state, inputs, expect_caches)
    got = step.step(inputs, eager=True)
    _independent_checks(step, inputs, got, before)
    # the torch stages project in bf16 (as cuBLAS serves them), the reference in fp32:
    # the selections agree up to near-ties (one swapped slot moves out by a few percent), the
    # query rows to bf16 rounding
    assert _overlap(got.slots, expect.slots) > 0.97
    assert rel_err(got.q_rows, expect.q_rows) < 1e-2
    assert rel_err(got.out, expect.out) < 4e-2 and rel_err(got.lse, expect.lse) < 1e-2
    # the caches took the same writes, and the pad row wrote only into the spare page
    trash = step.state.trash_page
    assert torch.equal(step.caches.mla_cache[:trash], expect_caches.mla_cache[:trash])
    assert torch.equal(step.caches.index_cache[:trash], expect_caches.index_cache[:trash])
    assert (step.caches.mailbox == formats.SENTINEL_BYTE).all(), "the step re-arms the mailbox"


def test_torch_backend_dcp_step_equals_the_reference():
    step = _step(Topology(tp=4, dcp=2, rank=1), sizes=(2, 4))
    inputs = step.state.inputs(3, seed=6)
    peers = step.state.peer_inputs(inputs, seed=7)
    expect = ref.reference_step(step.state, inputs, step.state.clone_caches(), peers)
    before = step.state.clone_caches()
    got = step.step(inputs, peers, eager=True)
    _independent_checks(step, inputs, got, before)
    assert _overlap(got.slots, expect.slots) > 0.97
    # the peer's rows (rank 0's 4 heads), copied into the mailbox in bf16: compared with the peers' own values
    assert torch.equal(got.q_rows[:, :4], peers.rows[:, :4].bfloat16())
    assert rel_err(got.q_rows, expect.q_rows) < 1e-2
    assert rel_err(got.out, expect.out) < 4e-2
    with pytest.raises(ValueError, match="peers"):
        step.step(inputs, eager=True)


def test_the_cute_stages_compile_the_sparse_cores_polling_variants_only_for_fork_poll(monkeypatch):
    """CuteStages.warm asks the launcher for the polling variants (fork_poll's sparse core on
    one rank; MlaQuery's under DCP, in every mode) only where a captured mode can launch them,
    so a step that never polls compiles none."""
    from graphstep.launch import DEFAULT_BUDGET_NS
    from graphstep.stages import CuteStages

    asked = []
    for topology, modes, polls in (
        (Topology(tp=4), ("fork",), (False,)),
        (Topology(tp=4), ("fork", "serial"), (False,)),
        (Topology(tp=4), ("fork_poll",), (False, True)),
        (Topology(tp=4, dcp=2, rank=1), ("fork",), (False, True)),
    ):
        shape = RankShape(dataclasses.replace(SMALL, index_heads=64), topology)  # the kernels' indexer geometry
        step = DecodeStep(shape, capture_sizes=(4,), backend="torch", device="cpu", max_context=200)
        stages = CuteStages(step.state, step.buffers, step.error, DEFAULT_BUDGET_NS)
        monkeypatch.setattr(stages.kernels, "warm", lambda sizes, width, p, group, device: asked.append(p))
        stages.warm((4,), modes)
        assert asked[-1] == polls, (topology, modes)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_a_state_refuses_a_seed_outside_torch_generators_range(seed):
    """As the CLI's --seed does: [0, 2^63), an int."""
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\^63\)"):
        _step(seed=seed)


def test_fractional_context_lengths_are_refused_not_truncated():
    step = _step()
    with pytest.raises(ValueError, match=r"context_lens must be ints, got \[1.5, 2.7\]"):
        step.state.inputs(2, context_lens=[1.5, 2.7])
    assert step.state.inputs(2, context_lens=[1, 2]).context_lens.tolist() == [1, 2]
