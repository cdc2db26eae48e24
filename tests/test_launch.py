"""The host side of every kernel launch, on the CPU: each `Kernels` method passes exactly
the arguments its kernel was compiled for (count, pointer dtype and alignment, scalar
types), so a launcher that drifts from its kernel fails here, not first on a GPU."""

from dataclasses import replace

import pytest
import torch
from graphstep.kernels import catalog, top_k

from conftest import launch_on_cpu
from graphstep import launch
from graphstep.launch import DEFAULT_BUDGET_NS, ErrorWord, Kernels
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState


def _signature(value):
    if hasattr(value, "memspace"):  # a CuTe pointer
        return ("pointer", value.dtype, value.memspace, value._assumed_align)
    return (type(value).__name__,)


class Launch:
    """Stands in for a compiled kernel: checks a call against the placeholders."""

    calls: list = []
    ops: list = []

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
        Launch.ops.append(self.op)


@pytest.fixture
def cpu_launches(monkeypatch):
    launch_on_cpu(monkeypatch, Launch)
    Launch.calls = []
    Launch.ops = []
    return Launch.calls


TOPOLOGIES = [Topology(tp=8), Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8")]


def _launch_every_kernel(kernels: Kernels, state: LayerState, b: int, poll: bool) -> list[str]:
    """Every launcher once for `b` tokens with its own variant choices (QueryWait and
    DcpMerge under DCP); returns the kernels it launched, in order. poll: the fork_poll
    mode's variants (MlaQuery's under DCP, SparseCore's on one rank)."""
    s, m, dcp = state.shape, state.shape.model, state.shape.topology.dcp
    inputs = state.inputs(b)
    c = state.caches
    f32 = lambda *shape: torch.zeros(*shape)  # noqa: E731
    i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32)  # noqa: E731
    qc = torch.zeros(b, m.q_lora_rank, dtype=torch.bfloat16)
    error = ErrorWord(torch.zeros(4, dtype=torch.int32))
    q8 = torch.zeros(b, m.index_heads, m.index_dim, dtype=torch.uint8)
    scores = f32(b, state.pages_per_seq * m.page_size)
    partial_o, partial_ml = kernels.sparse_core_buffers(b, "cpu")

    kernels.query_norm(inputs.qkv, qc, b)
    kernels.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        qc,
        qc.clone(),
        f32(b, s.heads, 192),
        c.mailbox,
        c.mla_cache,
        error,
        b,
        store_qc=True,
        poll=poll and dcp > 1,
    )
    kernels.index_key(inputs.qkv, inputs.context_lens, inputs.slot_mapping, c.index_cache, b)
    kernels.key_and_query_norm(inputs.qkv, qc, inputs.context_lens, inputs.slot_mapping, c.index_cache, b)
    kernels.index_query(qc, inputs.qkv, inputs.context_lens, q8, f32(b, m.index_heads), b)
    kernels.dsa_index(q8, f32(b, m.index_heads), c.index_cache, inputs.block_tables, inputs.context_lens, scores, b)
    kernels.top_k(scores, inputs.block_tables, inputs.context_lens, i32(b, m.index_topk), f32(b, m.index_topk), b)
    kernels.sparse_core(
        c.mailbox,
        i32(b, m.index_topk),
        c.mla_cache,
        partial_o,
        partial_ml,
        f32(b, s.gathered, m.kv_lora_rank),
        f32(b, s.gathered),
        b,
        q_out=torch.zeros(b, s.gathered, c.mailbox.shape[-1], dtype=torch.uint8),
        poll_budget_ns=DEFAULT_BUDGET_NS if poll and dcp == 1 and kernels.sparse_core_polls(b) else None,
    )
    launched = [
        "QueryNorm",
        "MlaQuery",
        "IndexKey",
        "KeyAndNorm",
        "IndexQuery",
        "DsaIndex",
        "ClusterTopK",
        "SparseCore",
    ]
    if dcp > 1:
        kernels.query_wait(c.mailbox, error, b)
        kernels.dcp_merge(
            i32(b, m.index_topk),
            f32(b, m.index_topk),
            i32(b, dcp, m.index_topk),
            f32(b, dcp, m.index_topk),
            inputs.block_tables,
            i32(b, m.index_topk),
            b,
        )
        launched += ["QueryWait", "DcpMerge"]
    return launched


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=["tp8", "dcp2-fp8"])
def test_every_launcher_matches_its_kernel(cpu_launches, topology):
    state = LayerState(RankShape(preset("deepseek-v3.2"), topology), max_batch=4, max_context=256, seed=1)
    launched = _launch_every_kernel(Kernels(state.shape, state.weights), state, 4, poll=topology.dcp > 1)
    assert cpu_launches == launched


class CpuTvmFfiKernels(launch.TvmFfiKernels):
    """TvmFfiKernels over CPU tensors (data_ptr() without the CUDA check) and a stream handle 7."""

    def _ptr(self, tensor, align=16):
        assert tensor.data_ptr() % align == 0
        return tensor.data_ptr()

    def _stream(self):
        return 7


class FfiLaunch:
    """Stands in for a kernel compiled with TVM-FFI: each pointer an int, each Int32 / Int64
    an int, each Float32 a float (the parameters test_ops checks the kernels declare)."""

    calls: list = []

    def __init__(self, variant):
        self.variant = variant

    def __call__(self, *args):
        *args, stream = args
        name = type(self.variant.op).__name__
        assert stream == 7 and len(args) == len(self.variant.args), (name, len(args))
        for i, (got, want) in enumerate(zip(args, self.variant.args)):
            kind = float if type(want).__name__ == "Float32" else int
            assert type(got) is kind, (name, i, type(got), type(want))
        FfiLaunch.calls.append(name)


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=["tp8", "dcp2-fp8"])
def test_every_tvm_ffi_launcher_passes_plain_values(monkeypatch, topology):
    monkeypatch.setattr(launch, "compile_tvm_ffi", FfiLaunch)
    FfiLaunch.calls = []
    state = LayerState(RankShape(preset("deepseek-v3.2"), topology), max_batch=4, max_context=256, seed=1)
    kernels = CpuTvmFfiKernels(state.shape, state.weights)
    launched = _launch_every_kernel(kernels, state, 4, poll=topology.dcp > 1)
    assert FfiLaunch.calls == launched
    _launch_every_kernel(kernels, state, 4, poll=topology.dcp > 1)
    assert len(kernels._by_variant) == len(set(launched))  # each variant compiled once


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=["tp8", "dcp2-fp8"])
def test_the_launchers_build_only_catalog_variants_and_warm_compiles_them(cpu_launches, topology):
    """Every op a launcher builds for batches 1..64 is one of the variants `graphstep ptx`
    writes (kernels/catalog.py variants), by configuration; and for a step's capture sizes,
    Kernels.warm compiles exactly the variants its launches use."""
    state = LayerState(RankShape(preset("deepseek-v3.2"), topology), max_batch=64, max_context=256, seed=1)
    kernels = Kernels(state.shape, state.weights)
    launched = {}
    for b in range(1, 65):
        Launch.ops.clear()
        for poll in (False, True):
            _launch_every_kernel(kernels, state, b, poll)
        launched[b] = {catalog._config(op) for op in Launch.ops}
    listed = [catalog._config(variant.op) for variant in catalog.variants(state.shape)]
    assert len(set(listed)) == len(listed)
    assert set().union(*launched.values()) <= set(listed)
    sizes, width = (1, 4, 16, 48), state.pages_per_seq * state.shape.model.page_size
    warmed = {catalog._config(variant.op) for variant in kernels.variants(sizes, width)}
    assert warmed == set().union(*(launched[b] for b in sizes))
    # sizes that never take the deep DsaIndex ring (or some TopK split) do not compile it
    large = (16, 48)
    warmed = {catalog._config(variant.op) for variant in kernels.variants(large, width)}
    assert warmed == set().union(*(launched[b] for b in large))


@pytest.mark.parametrize(
    "field, value, supported",
    [
        ("page_size", 32, 64),
        ("index_heads", 32, 64),
        ("index_dim", 64, 128),
        ("index_rope_dim", 32, 64),
        ("kv_lora_rank", 256, 512),
        ("qk_rope_dim", 32, 64),
        ("qk_nope_dim", 64, 128),
    ],
)
def test_kernels_reject_a_shape_they_are_not_written_for(field, value, supported):
    shape = RankShape(replace(preset("deepseek-v3.2"), **{field: value}), Topology(tp=8))
    state = LayerState(shape, max_batch=1, max_context=128, seed=1)  # the torch backend takes it
    with pytest.raises(ValueError, match=rf"ModelShape\.{field} = {value} is not supported by kernels/\w+\.py "):
        Kernels(shape, state.weights)
    with pytest.raises(ValueError, match=rf"\(supported: \({supported},\)\)"):
        Kernels(shape, state.weights)
    with pytest.raises(ValueError, match=rf"ModelShape\.{field} = {value}"):
        catalog.variants(shape)  # and `graphstep ptx`


def test_every_kernel_declares_the_sizes_it_supports():
    from graphstep.shapes import ModelShape

    assert set(catalog.KERNELS) == set(catalog._BUILDERS)
    for name, module in catalog.KERNELS.items():
        # CandidateSync touches only flags: no ModelShape size is built into it
        assert module.SUPPORTED or name == "candidate_sync", name
        for field, supported in module.SUPPORTED.items():
            assert field in ModelShape.__dataclass_fields__, (name, field)
            assert isinstance(supported, tuple) and supported, (name, field)
    for model in ("deepseek-v3.2", "kimi-k3.1"):
        for topology in TOPOLOGIES:
            catalog.check(RankShape(preset(model), topology))


def test_launch_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        launch.ptr(torch.zeros(4))


def test_sparse_core_plan_fills_the_gpu_and_its_buffers_hold_every_batch():
    from graphstep.kernels import sparse_core

    for q_heads in (16, 32, 64, 128):
        rows, least = sparse_core.heads_per_cta(q_heads), sparse_core.min_slots(q_heads)
        for cache in ("bf16", "fp8"):
            half = sparse_core.PLAN_HALF_WAVE_TOKENS[(rows, cache)]
            for batch in (1, 2, 3, 4, 16, 64, 200):
                slots = sparse_core.plan(batch, q_heads, 2048, cache)
                ctas = sparse_core.partial_ctas(batch, q_heads, 2048, slots)
                assert ctas == batch * q_heads // rows * (2048 // slots)
                wave = sparse_core.WAVE // 2 if batch <= half else sparse_core.WAVE
                # the most slots that still make `wave` CTAs (or the least a CTA takes), no more
                assert 2048 % slots == 0 and (ctas >= wave or slots == least), (q_heads, cache, batch, slots, ctas)
                assert slots == 2048 or ctas < 2 * wave, (q_heads, cache, batch, slots, ctas)
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=4, max_context=256, seed=1)
    kernels = Kernels(state.shape, state.weights)
    partial_o, partial_ml = kernels.sparse_core_buffers(64, "cpu")
    k = state.shape.model.index_topk
    assert partial_o.shape[0] == partial_ml.shape[0] == max(b * k // kernels.sparse_core_plan(b) for b in range(1, 65))
    with pytest.raises(ValueError, match="partials hold"):
        kernels.sparse_core(*[None] * 3, partial_o[:10], partial_ml[:10], None, None, 64)


def test_sparse_core_plan_takes_half_a_wave_up_to_its_batch_per_cache(monkeypatch):
    """PLAN_HALF_WAVE_TOKENS halves the CTAs a plan aims at (twice the slots each) up to its
    batch, for its (rows per CTA, cache) only; the buffers follow the plan."""
    from graphstep.kernels import sparse_core

    # as measured (bench/RESULTS.md session 32: call A's sweep, the TP 8 step in calls C / C2)
    every = [(rows, cache) for rows in (16, 32, 64) for cache in ("bf16", "fp8")]
    measured = {(16, "bf16"): 16, (16, "fp8"): 4, (64, "fp8"): 4}
    assert sparse_core.PLAN_HALF_WAVE_TOKENS == {**dict.fromkeys(every, 0), **measured}
    half = dict.fromkeys(sparse_core.PLAN_HALF_WAVE_TOKENS, 0)
    monkeypatch.setattr(sparse_core, "PLAN_HALF_WAVE_TOKENS", half)
    whole = {b: sparse_core.plan(b, 16, 2048, "bf16") for b in (1, 2, 4, 5, 16)}
    assert whole == {1: 32, 2: 32, 4: 64, 5: 64, 16: 256}
    monkeypatch.setitem(half, (16, "bf16"), 4)
    assert {b: sparse_core.plan(b, 16, 2048, "bf16") for b in whole} == {1: 32, 2: 64, 4: 128, 5: 64, 16: 256}
    assert {b: sparse_core.plan(b, 16, 2048, "fp8") for b in whole} == whole  # the other cache's as before
    assert sparse_core.plan(4, 128, 2048, "bf16") == 128  # and 64-row CTAs' (2 groups: 128 CTAs)
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=4, max_context=256, seed=1)
    kernels = Kernels(state.shape, state.weights)
    assert kernels.sparse_core_plan(2) == 64 and kernels.sparse_core_polls(2)
    partial_o, _ = kernels.sparse_core_buffers(4, "cpu")
    assert partial_o.shape[0] == max(b * 2048 // kernels.sparse_core_plan(b) for b in range(1, 5)) == 3 * 32


def _top_k_setup(topology, context: int, batch: int):
    """A small state's kernels, and TopK's arguments for `batch` rows of `context` scores
    (only the block table's width matters to the launcher)."""
    state = LayerState(RankShape(preset("deepseek-v3.2"), topology), max_batch=4, max_context=256, seed=1)
    m = state.shape.model
    tables = torch.zeros(batch, context // m.page_size, dtype=torch.int32)
    args = (
        torch.zeros(batch, context),
        tables,
        torch.full((batch,), context, dtype=torch.int32),
        torch.zeros(batch, m.index_topk, dtype=torch.int32),
        torch.zeros(batch, m.index_topk),
    )
    return Kernels(state.shape, state.weights), args


@pytest.mark.parametrize("topology", [Topology(tp=8), Topology(tp=8, dcp=2, rank=1)], ids=["tp8", "dcp2"])
@pytest.mark.parametrize(
    "context, batch, expect",
    [
        (64, 1, "c4x512x4"),
        (4096, 4, "c4x512x4"),
        (8192, 64, "c4x512x4"),
        (32768, 1, "c8x512x8"),
        (32768, 8, "c8x512x8"),
        (32768, 16, "c4x512x16"),
        (32768, 32, "c4x512x16"),
        (32768, 64, "c2x1024x16"),
        (131072, 1, "c16x512x16"),
        (131072, 4, "c16x512x16"),
        (131072, 5, "c8x512x32_masks"),
        (131072, 12, "c8x512x32_masks"),
        (131072, 16, "c4x1024x32_masks"),
        (131072, 24, "c4x1024x32_masks"),
        (131072, 25, "c8x512x32_masks"),
        (131072, 32, "c8x512x32_masks"),
        (131072, 33, "c2x1024x64"),
        (131072, 48, "c2x1024x64"),
        (131072, 64, "c2x1024x64"),
        (262144, 2, "c16x1024x16"),  # wider than PICKS: the smallest split that holds the row
        (262208, 1, "one-cta"),  # wider than every split
    ],
)
def test_top_k_launches_the_split_the_host_picks(cpu_launches, topology, context, batch, expect):
    """The launcher picks the measured PICKS split for the width and batch: a ClusterTopK
    of that split (its compiled signature, its k / dcp / rank) or TopK (rows wider than
    every split)."""
    kernels, args = _top_k_setup(topology, context, batch)
    split = kernels.top_k_split(context, batch)
    assert (split.name if split else "one-cta") == expect
    kernels.top_k(*args, batch)
    (op,) = Launch.ops
    assert (op.k, op.dcp, op.rank) == (2048, topology.dcp, topology.rank)
    if split is None:
        assert type(op) is top_k.TopK
        assert context > max(s.capacity for s in top_k.SPLITS)
    else:
        assert split in top_k.SPLITS and split.capacity >= context
        assert type(op) is top_k.ClusterTopK
        assert (op.ctas, op.threads, op.loads, op.stashed) == (split.ctas, split.threads, split.loads, split.stashed)
        assert op.entries == top_k.list_entries(split)


@pytest.mark.parametrize("split", [*top_k.SPLITS, None], ids=lambda s: s.name if s else "one-cta")
def test_top_k_launches_any_split_that_holds_the_row(cpu_launches, split):
    kernels, args = _top_k_setup(Topology(tp=8), 8192, 4)
    kernels.top_k(*args, 4, split=split)
    assert cpu_launches == ["TopK" if split is None else "ClusterTopK"]
    if split is not None:
        op = Launch.ops[0]
        assert (op.ctas, op.threads, op.loads, op.stashed) == (split.ctas, split.threads, split.loads, split.stashed)
        assert op.entries == top_k.list_entries(split)


def test_top_k_refuses_a_split_too_small_for_the_row(cpu_launches):
    kernels, args = _top_k_setup(Topology(tp=8), 32768, 1)
    small = min(top_k.SPLITS, key=lambda s: s.capacity)
    with pytest.raises(ValueError, match="holds rows of up to"):
        kernels.top_k(*args, 1, split=small)
    with pytest.raises(ValueError, match="split must be"):
        kernels.top_k(*args, 1, split="fast")
    assert cpu_launches == []


def test_an_unlisted_split_runs_without_a_list():
    """listed=False: the same split (CTAs, threads, loads, stash) with no candidate list, so
    its rounds 1-2 and compaction take the bit-mask path (list_entries 0) under its own name."""
    listed, masks = top_k.Split(4, 1024, 8, 4), top_k.Split(4, 1024, 8, 4, listed=False)
    assert 0 < top_k.list_entries(listed) < 128 * listed.loads  # a partial list: it can overflow
    assert top_k.list_entries(masks) == 0
    assert (masks.capacity, masks.held, masks.per_cta) == (listed.capacity, listed.held, listed.per_cta)
    assert (listed.name, masks.name) == ("c4x1024x32", "c4x1024x32_masks")
    assert masks in top_k.SPLITS and listed in top_k.SPLITS


def test_split_for_covers_every_width():
    assert top_k.split_for(64, 1) is not None
    for width in (64, 2048, 4096, 8192, 8256, 32768, 32832, 65536, 131072):
        for batch in (1, 4, 16, 32, 64, 256):
            split = top_k.split_for(width, batch)
            assert split in top_k.SPLITS and split.capacity >= width, (width, batch)
    widest = max(s.capacity for s in top_k.SPLITS)
    assert top_k.split_for(widest, 1) == top_k.SPLITS[-1]
    assert top_k.split_for(widest + 64, 1) is None
    assert len({s.name for s in top_k.SPLITS}) == len(top_k.SPLITS)


def test_a_split_whose_cluster_does_not_fit_gives_way():
    """On a part whose GPCs hold fewer SMs (fits: a cluster of at most 8 or 4 CTAs), the pick
    gives way to the width's pick for the next larger batch that fits, then to any split that
    holds the row, then to the one-CTA kernel (None); with every cluster fitting, the picks."""
    at_most = {n: (lambda split, n=n: split.ctas <= n) for n in (4, 8, 16)}
    for width in (2048, 8192, 32768, 65536, 131072, 196608, 262144):
        for batch in (1, 4, 12, 16, 32, 64):
            assert top_k.split_for(width, batch, at_most[16]) == top_k.split_for(width, batch)
            for n in (4, 8):
                split = top_k.split_for(width, batch, at_most[n])
                assert split is None or (split.ctas <= n and split.capacity >= width), (width, batch, n)
    assert top_k.split_for(131072, 1) == top_k.Split(16, 512, 4)
    assert top_k.split_for(131072, 1, at_most[8]) == top_k.Split(8, 512, 8, 4, listed=False)  # B <= 12's pick
    assert top_k.split_for(131072, 1, at_most[4]) == top_k.Split(4, 1024, 8, 4, listed=False)  # B <= 24's
    assert top_k.split_for(32768, 1, at_most[4]) == top_k.Split(4, 512, 4)
    assert top_k.split_for(262144, 1) == top_k.Split(16, 1024, 4) and top_k.split_for(262144, 1, at_most[8]) is None
    assert top_k.split_for(32768, 64, lambda split: False) is None
    assert [s.per_sm for s in (top_k.Split(16, 1024, 2), top_k.Split(16, 512, 4))] == [1, 2]


def test_the_launcher_picks_and_warms_splits_the_device_can_hold(monkeypatch):
    """Kernels asks launch.cluster_fits of the launch's device (a CUDA one: off CUDA every split
    fits) for the pick, and its variants for warm-up are the same picks."""
    asked = []

    def fits(device, ctas, per_sm):
        asked.append((str(device), ctas, per_sm))
        return ctas <= 8

    monkeypatch.setattr(launch, "cluster_fits", fits)
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    kernels = Kernels(shape, None)
    narrow = top_k.Split(8, 512, 8, 4, listed=False)
    assert kernels.top_k_split(131072, 2) == top_k.Split(16, 512, 4) and not asked  # no device: the tuned picks
    assert kernels.top_k_split(131072, 2, "cpu") == top_k.Split(16, 512, 4) and not asked
    assert kernels.top_k_split(131072, 2, "cuda:0") == narrow and ("cuda:0", 16, 2) in asked
    names = {v.name for v in kernels.variants((1, 2, 4), 131072, device="cuda:0") if v.name.startswith("top_k")}
    assert names == {f"top_k_{narrow.name}"}, names
    names = {v.name for v in kernels.variants((1, 2, 4), 131072) if v.name.startswith("top_k")}
    assert names == {"top_k_c16x512x16"}, names
    asked.clear()
    assert (
        kernels.top_k_split(131072, 2, "cuda:0") == narrow and not asked
    )  # the pick is kept per (width, batch, device)
    kernels._probe_clusters("cpu")
    assert not asked
    kernels._probe_clusters("cuda:0")  # warm's: every split asked before any capture
    assert asked == [("cuda:0", s.ctas, s.per_sm) for s in top_k.SPLITS]


def test_cluster_fits_off_cuda_asks_no_driver():
    assert launch.cluster_fits("cpu", 16, 1) and launch.cluster_fits(None, 32, 1)


def _dsa_index_args(batch: int, context: int) -> tuple:
    """A TP 8 launcher and DsaIndex's tensor arguments for `batch` tokens at `context`."""
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=batch, max_context=context, seed=1)
    inputs = state.inputs(batch)
    args = (
        torch.zeros(batch, 64, 128, dtype=torch.uint8),
        torch.zeros(batch, 64),
        state.caches.index_cache,
        inputs.block_tables,
        inputs.context_lens,
        torch.zeros(batch, state.pages_per_seq * 64),
    )
    return Kernels(state.shape, state.weights), args


def test_dsa_index_takes_any_positive_run(cpu_launches):
    """Any run >= 1 launches (longer runs reuse the ring); 0 and negatives are refused."""
    kernels, args = _dsa_index_args(2, 4096)
    args = (*args, 2)
    for run in (0, -4):
        with pytest.raises(ValueError, match="pages_per_cta must be >= 1"):
            kernels.dsa_index(*args, pages_per_cta=run)
    for run in (1, 5, 32, 64):
        kernels.dsa_index(*args, pages_per_cta=run)
    kernels.dsa_index(*args)
    assert cpu_launches == ["DsaIndex"] * 5


def test_dsa_index_launches_the_ring_the_host_picks(cpu_launches):
    """ring_for: the deep ring (every page of an 8-page run in flight) where the run is longer
    than the default ring and the grid fits one wave of 2 deep CTAs per SM; the launcher
    passes that choice (or the caller's) to the compiled variant, and refuses other depths."""
    from graphstep.kernels import dsa_index

    deep, default = dsa_index.DEEP_STAGES, dsa_index.STAGES
    # 32K (512 pages a sequence): B = 3 / 4 run 8 pages (192 / 256 CTAs)
    assert [dsa_index.pages_per_cta(b, 512) for b in (1, 2, 3, 4, 5, 16)] == [2, 4, 8, 8, 16, 16]
    assert [dsa_index.ring_for(b, 512, dsa_index.pages_per_cta(b, 512)) for b in (1, 2, 3, 4, 5, 16)] == [
        default,
        default,
        deep,
        deep,
        default,
        default,
    ]
    assert dsa_index.ring_for(2, 2048, 8) == default  # 128K B = 2: 512 CTAs, two deep waves
    assert dsa_index.ring_for(1, 512, 5) == deep and dsa_index.ring_for(1, 512, 9) == default
    kernels, args = _dsa_index_args(4, 32768)
    kernels.dsa_index(*args, 4)
    kernels.dsa_index(*args, 1)
    kernels.dsa_index(*args, 1, ring=deep)
    with pytest.raises(ValueError, match="ring must be one of"):
        kernels.dsa_index(*args, 1, ring=6)
    assert [op.stages for op in Launch.ops] == [deep, default, deep]


def test_sparse_core_checks_its_publish_buffer(cpu_launches):
    """q_out (the step's copy of the rows read) must be uint8 [>= batch, gathered, row bytes]."""
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=4, max_context=256, seed=1)
    s, m, c = state.shape, state.shape.model, state.caches
    kernels = Kernels(s, state.weights)
    partial_o, partial_ml = kernels.sparse_core_buffers(4, "cpu")
    row = c.mailbox.shape[-1]
    args = (c.mailbox, torch.zeros(4, m.index_topk, dtype=torch.int32), c.mla_cache, partial_o, partial_ml)
    outs = (torch.zeros(4, s.gathered, m.kv_lora_rank), torch.zeros(4, s.gathered), 4)
    for bad in (
        torch.zeros(3, s.gathered, row, dtype=torch.uint8),  # fewer rows than the batch
        torch.zeros(4, s.q_heads + 16, row, dtype=torch.uint8),  # not `gathered` rows per token
        torch.zeros(4, s.gathered, row // 2, dtype=torch.uint8),  # not the mailbox's row bytes
        torch.zeros(4, s.gathered, row // 2, dtype=torch.bfloat16),  # not bytes
    ):
        with pytest.raises(ValueError, match="q_out must be uint8"):
            kernels.sparse_core(*args, *outs, q_out=bad)
    kernels.sparse_core(*args, *outs, q_out=torch.zeros(5, s.gathered, row, dtype=torch.uint8))
    assert cpu_launches == ["SparseCore"]


def test_sparse_core_polls_only_where_its_spinning_ctas_leave_sms_to_the_publisher(cpu_launches):
    """fork_poll's polling launch: each partial CTA may hold an SM while it spins, so the
    launcher polls only where the plan's grid has at most POLL_MAX_CTAS CTAs on the 132 SMs it is
    tuned on (every default capture size but 24, 40, 48 and 56 tokens) and refuses a polling launch past that, at the
    plan's slots_per_cta or one given."""
    from graphstep.kernels import sparse_core

    from graphstep.step import DEFAULT_CAPTURE_SIZES

    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=64, max_context=256, seed=1)
    s, m, c = state.shape, state.shape.model, state.caches
    kernels = Kernels(s, state.weights)
    polls = {b: kernels.sparse_core_polls(b) for b in DEFAULT_CAPTURE_SIZES}
    assert [b for b, ok in polls.items() if not ok] == [24, 40, 48, 56]
    for b in DEFAULT_CAPTURE_SIZES:
        spc = kernels.sparse_core_plan(b)
        ctas = sparse_core.partial_ctas(b, s.q_heads, m.index_topk, spc)
        assert ctas == b * (m.index_topk // spc) and polls[b] == (ctas <= 128)
        assert polls[b] == sparse_core.may_poll(b, s.q_heads, m.index_topk, spc)
        splits = m.index_topk // spc
        assert sparse_core.partial_rows(b, s.q_heads, m.index_topk, spc) == (b * splits if splits > 1 else 0)
    assert sparse_core.partial_rows(4, s.q_heads, m.index_topk, 256) == 4 * 8  # at a given split
    assert sparse_core.partial_rows(4, s.q_heads, m.index_topk, m.index_topk) == 0  # one split: none
    partial_o, partial_ml = kernels.sparse_core_buffers(64, "cpu")

    def launch(b, **kw):
        slots = torch.zeros(b, m.index_topk, dtype=torch.int32)
        outs = (torch.zeros(b, s.gathered, m.kv_lora_rank), torch.zeros(b, s.gathered))
        kernels.sparse_core(c.mailbox, slots, c.mla_cache, partial_o, partial_ml, *outs, b, **kw)

    launch(16, poll_budget_ns=DEFAULT_BUDGET_NS)
    launch(4, poll_budget_ns=DEFAULT_BUDGET_NS, slots_per_cta=2048)  # one split: 4 CTAs
    for b, kw in ((24, {}), (56, {}), (3, {"slots_per_cta": 32})):  # 192, 224, 192 CTAs
        with pytest.raises(ValueError, match="polling launch of"):
            launch(b, poll_budget_ns=DEFAULT_BUDGET_NS, **kw)
    assert cpu_launches == ["SparseCore"] * 2


@pytest.mark.parametrize("sms, polling", [(132, None), (114, [1, 2, 4, 8, 16]), (78, [1, 2, 4, 8, 16]), (60, [])])
def test_a_device_with_fewer_sms_polls_only_where_its_spinning_ctas_leave_it_sms(monkeypatch, sms, polling):
    """An sm_90 part with fewer SMs (H100 PCIe 114, H20 78): a polling launch keeps POLL_FREE_SMS
    of the device's own SMs free, so TP 8 bf16's 128-CTA launches (B = 32, 64) join the side
    stream first there; 132 polls as the tuned default (every size but 24 .. 56)."""
    import types

    from graphstep.kernels import sparse_core

    from graphstep.launch import sm_count
    from graphstep.step import DEFAULT_CAPTURE_SIZES

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=sms)
    )
    cuda = torch.device("cuda", 0)
    assert sm_count(cuda) == sms and sm_count("cpu") == sm_count(None) == sparse_core.SMS == 132
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=8)), max_batch=64, max_context=256, seed=1)
    kernels = Kernels(state.shape, state.weights)
    default = [b for b in DEFAULT_CAPTURE_SIZES if kernels.sparse_core_polls(b)]
    polls = [b for b in DEFAULT_CAPTURE_SIZES if kernels.sparse_core_polls(b, device=cuda)]
    assert polls == (polling if polling is not None else default) and set(polls) <= set(default)
    for b in DEFAULT_CAPTURE_SIZES:
        ctas = sparse_core.partial_ctas(b, 16, 2048, kernels.sparse_core_plan(b))
        assert (b in polls) == (ctas <= min(sparse_core.POLL_MAX_CTAS, sms - sparse_core.POLL_FREE_SMS))


def test_mla_query_streamed_project_policy(monkeypatch):
    """stream_tokens: off while STREAM_FROM_HEADS is None; from that many heads, the smallest
    token count holding the batch; the register kernel above 64 tokens or below the heads."""
    from graphstep.kernels import mla_query

    monkeypatch.setattr(mla_query, "STREAM_FROM_HEADS", None)
    assert {mla_query.stream_tokens(b, 128) for b in range(1, 130)} == {0}
    monkeypatch.setattr(mla_query, "STREAM_FROM_HEADS", 64)
    assert [mla_query.stream_tokens(b, 128) for b in (1, 16, 17, 32, 33, 64, 65)] == [16, 16, 32, 32, 64, 64, 0]
    assert mla_query.stream_tokens(4, 16) == 0 and mla_query.stream_tokens(4, 64) == 16
    with pytest.raises(ValueError, match="tokens in"):
        mla_query.MlaQuery(128, 0, 128, 128, 2304, False, False, False, False, tokens=8)


def test_mla_query_streams_at_tp1_by_default():
    """The default (STREAM_FROM_HEADS = 128, measured in sessions 26 and 28): TP 1's 128 heads
    stream Q_B at every batch up to 64; TP 8's 16 heads and batches above 64 keep the register kernel."""
    from graphstep.kernels import mla_query

    assert mla_query.STREAM_FROM_HEADS == 128
    assert [mla_query.stream_tokens(b, 128) for b in (1, 4, 16, 17, 64, 65)] == [16, 16, 16, 32, 64, 0]
    assert {mla_query.stream_tokens(b, 16) for b in range(1, 130)} == {0}


@pytest.mark.parametrize("batch, tokens", [(1, 16), (17, 32), (64, 64), (65, 0)])
def test_mla_query_launches_the_streamed_project_it_plans(cpu_launches, monkeypatch, batch, tokens):
    """The launcher runs the MlaQuery variant stream_tokens names (the compiled op's tokens),
    with the same arguments as the register kernel's."""
    from graphstep.kernels import mla_query

    monkeypatch.setattr(mla_query, "STREAM_FROM_HEADS", 1)
    state = LayerState(RankShape(preset("deepseek-v3.2"), Topology(tp=1)), max_batch=65, max_context=256, seed=3)
    kernels = Kernels(state.shape, state.weights)
    inputs = state.inputs(batch)
    qc = torch.zeros(batch, 1536, dtype=torch.bfloat16)
    kernels.mla_query(
        inputs.qkv,
        inputs.context_lens,
        inputs.slot_mapping,
        qc,
        qc.clone(),
        torch.zeros(batch, 128, 192),
        state.caches.mailbox,
        state.caches.mla_cache,
        ErrorWord(torch.zeros(4, dtype=torch.int32)),
        batch,
        store_qc=True,
        poll=False,
    )
    (op,) = Launch.ops
    assert op.tokens == kernels.mla_query_tokens(batch) == tokens


def test_dcp_merge_refuses_candidates_it_cannot_read_by_16_byte_vectors(cpu_launches):
    """DcpMerge reads the candidate lists by 16-byte vectors: a list 4 bytes off, or a token
    stride that is not a multiple of 4 elements, is a ValueError before any launch (a
    misaligned vector load would fault and end the CUDA context)."""
    state = LayerState(RankShape(preset("kimi-k3.1"), TOPOLOGIES[1]), max_batch=2, max_context=256, seed=1)
    kernels, k = Kernels(state.shape, state.weights), state.shape.model.index_topk
    positions, scores = torch.zeros(2 * k + 1, dtype=torch.int32), torch.zeros(2 * k + 1)
    aligned = {"positions": positions[: 2 * k].view(2, k), "scores": scores[: 2 * k].view(2, k)}
    peers = (torch.zeros(2, 2, k, dtype=torch.int32), torch.zeros(2, 2, k))
    rest = (state.caches.block_tables, torch.zeros(2, k, dtype=torch.int32), 2)

    def merge(positions, scores, stride=2 * k):
        kernels.dcp_merge(positions, scores, *peers, *rest, peer_offsets=torch.tensor([0, k * 4]), token_stride=stride)

    merge(aligned["positions"], aligned["scores"])
    assert cpu_launches == ["DcpMerge"]
    with pytest.raises(ValueError, match="16-byte aligned"):
        merge(positions[1:].view(2, k), aligned["scores"])  # contiguous, 4 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        merge(aligned["positions"], scores[1:].view(2, k))
    with pytest.raises(ValueError, match="multiple of 4"):
        merge(aligned["positions"], aligned["scores"], stride=2 * k + 2)
    assert cpu_launches == ["DcpMerge"]
