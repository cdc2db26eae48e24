"""Every CuTe DSL kernel variant compiles for sm_90a without a GPU, and its PTX has what
the design needs: PDL in every kernel, 16-byte global accesses, no local memory, the
exact-order FP32 ops the order model assumes, tensor-core MMAs in MlaQuery."""

import ast
import os
import re
import struct
import subprocess
import warnings
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import pytest
from cutlass import Int32
from graphstep.kernels import catalog, guards, index_query, sparse_core, sparse_core_mma, sparse_core_wgmma, top_k
from graphstep.kernels import primitives as P

from graphstep.cli import main
from graphstep.graphs import short
from graphstep.shapes import RankShape, Topology, preset

SHAPES = {
    "tp8": RankShape(preset("deepseek-v3.2"), Topology(tp=8)),
    "kimi-dcp2-fp8": RankShape(preset("kimi-k3.1"), Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8")),
}


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    out = {}
    for shape_name, shape in SHAPES.items():
        folder = tmp_path_factory.mktemp(shape_name)
        for path in catalog.write_ptx(folder, "sm_90a", shape):
            out[(shape_name, path.name.split(".")[0])] = path.read_text()
    return out


def _entries(text):
    """PTX text of each kernel entry."""
    starts = [m.start() for m in re.finditer(r"\.entry ", text)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def test_every_variant_compiled(ptx):
    names = {name for _, name in ptx}
    assert {
        "query_norm_rows",
        "query_norm_tiled",
        "key_and_norm_rows",
        "key_and_norm_tiled",
        "mla_query_rows",
        "mla_query_tiled",
        "query_wait",
        "mla_query_tiled_poll",
    } <= names
    assert {"index_key", "index_query_16", "index_query_32", "index_query_64", "dsa_index", "top_k"} <= names
    assert "dsa_index_ring8" in names
    assert ("kimi-dcp2-fp8", "dcp_merge") in ptx and ("tp8", "dcp_merge") not in ptx
    assert {f"top_k_{split.name}" for split in top_k.SPLITS} <= names
    # + 6 SparseCore splits (32 .. 1024 slots per CTA), 3 IndexQuery sizes, 2 DsaIndex rings, every TopK split;
    # on one rank (tp8) each SparseCore split also polls (fork_poll)
    assert len(ptx) == (10 + 2 * 6 + 2 + 1) + (14 + 6 + 2 + 1) + 2 * len(top_k.SPLITS)


def _stages(variant: str, k: int, shape=None) -> list[str]:
    """The stage names a variant's kernels carry, in launch order (SparseCore's: of `shape`,
    whose split decides whether the combine is its own kernel or done in a cluster)."""
    if variant.startswith("mla_query_"):
        norm = "tiled" if "_tiled" in variant else "rows"
        return [f"query_norm_{norm}", "mla_query_project", "mla_query_absorb"]
    if variant.startswith("index_query_"):
        return ["index_query"]
    if variant.startswith("key_and_norm_"):
        return ["key_and_query_norm"]
    if variant.startswith("top_k_"):
        return ["top_k_cluster"]
    if variant.startswith("dsa_index_ring"):
        return ["dsa_index"]
    if variant.startswith("sparse_core_s"):
        slots = int(variant.split("_s")[-1].split("_")[0])
        clustered = catalog.build(shape, "sparse_core", slots=slots).op.clustered
        return ["sparse_core_partial"] + (["sparse_core_combine"] if slots < k and not clustered else [])
    return [variant]  # query_norm_rows / _tiled, index_key, dsa_index, top_k, dcp_merge, query_wait


@pytest.mark.parametrize(
    "kernel",
    [
        "query_norm",
        "mla_query",
        "index_key",
        "key_and_norm",
        "index_query",
        "dsa_index",
        "top_k",
        "sparse_core",
        "dcp_merge",
        "query_wait",
    ],
)
def test_every_kernel_is_named_after_its_stage(ptx, kernel):
    """What the graph table, Nsight Systems and ncu show: the PTX entry (the CUDA function)
    carries the @cute.kernel method's name."""
    found = False
    for (shape, variant), text in ptx.items():
        if variant.startswith(kernel):
            found = True
            names = [short(name) for name in re.findall(r"\.entry (\w+)\(", text)]
            expect = [f"cute:{stage}" for stage in _stages(variant, 2048, SHAPES[shape])]
            assert names == expect, (shape, variant, names)
    assert found


def test_kernels_import_nothing_from_graphstep():
    """Imports point down: graphstep uses the kernels, never the other way."""
    folder = Path(catalog.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] if node.level == 0 else []
            else:
                continue
            assert not any(m == "graphstep" or m.startswith("graphstep.") for m in modules), (path.name, modules)


# What a kernel may read from global memory before its griddepcontrol.wait: only what no
# kernel of the step writes (weights, and inputs the host copies in before the graph runs).
# Everything else a predecessor may still be writing.
POLL_READS = {"ld.volatile.global.v4.b32", "red.global.min.s32"}
TMA_COPY = "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
BEFORE_WAIT = {
    "query_norm": {"ld.global.nc.v4.b32"},  # gamma
    # gamma (its QueryNorm kernel), Q_B / W_UK slices into L2 (no data reaches the SM); the
    # streamed project (mla_query_*_sN) also Q_B's first ring by TMA and the tensor maps
    "mla_query": lambda name: (
        {"ld.global.nc.v4.b32", "cp.async.bulk.prefetch.L2.global"}
        | ({TMA_COPY, "prefetch.tensormap"} if re.search(r"_s\d+$", name) else set())
    ),
    "index_key": {"ld.global.nc.b32"},  # the LayerNorm weight and bias
    "key_and_norm": {"ld.global.nc.v4.b32", "ld.global.nc.b32"},  # QueryNorm's gamma, IndexKey's weights
    # the first ring of wq_b weights by TMA (q_c's after the wait:
    # test_index_query_streams_once_in_one_fused_kernel) and the tensor maps (kernel parameters)
    "index_query": {TMA_COPY, "prefetch.tensormap"},
    "dsa_index": {
        "ld.global.nc.s32",  # context_lens and a block-table entry (host-written inputs)
        "cp.async.bulk.prefetch.L2.global",
    },  # the first pages into L2
    # fork_poll on one rank: the query rows the side stream publishes (polled, a missing chunk
    # recorded), never what the kernel before it (TopK) writes
    "sparse_core_s": lambda name: POLL_READS if name.endswith("_poll") else set(),
    "dcp_merge": {"ld.global.nc.s64"},  # the ranks' candidate offsets (set up once)
}
_OPCODE = re.compile(r"^\s*\{?\s*(?:@!?%?\w+\s+)?([a-z][\w.:]*)", re.M)
_READS = re.compile(r"(ld|ldu|ldmatrix|cp\.async|cp\.reduce|prefetch|prefetchu|atom|red|tex|tld4|suld|multimem)(\.|$)")


def global_reads(ptx_text: str) -> list[str]:
    """Every instruction of `ptx_text` that may read memory other than kernel parameters and
    shared memory: ld/ldu in any form (global, generic, volatile, relaxed/acquire, .nc, any
    width or vector), cp.async copies and prefetches, atomics and reductions, textures."""
    found = []
    for opcode in _OPCODE.findall(ptx_text):
        if not _READS.match(opcode) or any(w in opcode for w in ("commit_group", "wait_group", "wait_all")):
            continue
        parts = opcode.split(".")
        if "param" in parts or ("shared" in opcode and "global" not in parts):
            continue
        found.append(opcode)
    return found


def test_the_before_wait_scan_sees_every_load_form():
    lines = [
        "ld.global.v2.u32 {%r1, %r2}, [%rd1];",
        "ld.volatile.global.b32 %r1, [%rd1];",
        "ld.global.u8 %rs1, [%rd1];",
        "ld.global.s8 %rs1, [%rd1];",
        "ld.global.u16 %rs1, [%rd1];",
        "ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];",
        "@%p1 ld.global.nc.s32 %r1, [%rd1];",
        "@!%p2 ld.global.L1::no_allocate.b32 %r1, [%rd1];",
        "@p ld.global.v4.f32 {%r1, %r2, %r3, %r4}, [%rd1];",
        "{ ld.volatile.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1]; }",
        "ld.u32 %r1, [%rd1];",
        "ld.relaxed.gpu.global.b32 %r1, [%rd1];",
        "ldu.global.u32 %r1, [%rd1];",
        "atom.global.add.u32 %r1, [%rd1], 1;",
        "cp.async.ca.shared.global [%r1], [%rd1], 4;",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1], 256, [%r2];",
    ]
    allowed = [
        "ld.param.u64 %rd1, [p0];",
        "ld.shared.v4.b32 {%r1, %r2, %r3, %r4}, [%r5];",
        "cp.async.commit_group;",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];",
        "cp.async.wait_group 1;",
        "mov.u32 %r1, %r2;",
        "st.shared.v4.b32 [%r1], {%r2, %r3, %r4, %r5};",
    ]
    text = "\n\t".join(["", *lines, *allowed])
    assert len(global_reads(text)) == len(lines)
    assert not global_reads("\n\t".join(["", *allowed]))


def test_every_kernel_waits_and_releases(ptx):
    check_waits_and_releases(ptx)


def check_waits_and_releases(ptx):
    """Every entry of every variant waits (griddepcontrol) and releases its dependents, and
    reads nothing before its (first) wait but what BEFORE_WAIT allows."""
    for (shape, name), text in ptx.items():
        entries = _entries(text)
        assert entries, (shape, name)
        allowed = next((forms for prefix, forms in BEFORE_WAIT.items() if name.startswith(prefix)), set())
        allowed = allowed(name) if callable(allowed) else allowed
        for entry in entries:
            assert "griddepcontrol.wait;" in entry, (shape, name)
            assert "griddepcontrol.launch_dependents;" in entry, (shape, name)
            # the wait comes before any load of data a predecessor wrote: every global read
            # before it (any ld form) is one of the kernel's allowed ones
            wait = entry.index("griddepcontrol.wait;")
            early = set(global_reads(entry[:wait]))
            assert early <= allowed, (shape, name, early - allowed)
            assert global_reads(entry[wait:]), (shape, name)  # and the scan does see its loads
            assert "sm_90a" in text


def test_wide_global_accesses_and_no_local_memory(ptx):
    check_wide_and_no_local(ptx)


def check_wide_and_no_local(ptx):
    """16-byte global loads (and 16-byte q_c / query-row stores) and no local memory."""
    for (shape, name), text in ptx.items():
        assert re.search(r"ld\.(volatile\.)?global(\.nc)?\.v4\.", text), (shape, name)
        assert ".local" not in text, (shape, name)
        if name.startswith(("query_norm", "key_and_norm", "mla_query")):  # whole 16-byte chunks of q_c, query rows
            assert "st.global.v4.b32" in text, (shape, name)


def test_query_norm_uses_the_order_models_ieee_ops(ptx):
    for variant in ("query_norm_rows", "query_norm_tiled", "mla_query_rows", "mla_query_tiled"):
        text = ptx[("tp8", variant)]
        for op in (
            "fma.rn.f32",
            "add.rn.f32",
            "mul.rn.f32",
            "div.rn.f32",
            "sqrt.rn.f32",
            "rcp.rn.f32",
            "shfl.sync.bfly.b32",
            "cvt.rn.bf16x2.f32",
        ):
            assert op in text, (variant, op)
    norm = ptx[("tp8", "query_norm_rows")] + ptx[("tp8", "query_norm_tiled")]
    assert "approx" not in norm
    # gamma is loaded before the wait (weights do not depend on the previous kernel)
    for variant in ("query_norm_rows", "query_norm_tiled"):
        text = ptx[("tp8", variant)]
        assert text.index("ld.global.nc.v4") < text.index("griddepcontrol.wait")


def test_key_and_norm_runs_both_parts_each_behind_its_own_wait(ptx):
    """One entry, two branches: QueryNorm's IEEE ops and IndexKey's e4m3 keys and guards,
    each part loading its weights before its wait and the step's inputs after it."""
    for tiled in ("rows", "tiled"):
        text = ptx[("tp8", f"key_and_norm_{tiled}")]
        (entry,) = _entries(text)
        assert entry.count("griddepcontrol.wait;") == 2 and entry.count("griddepcontrol.launch_dependents;") == 2
        for op in ("fma.rn.f32", "add.rn.f32", "mul.rn.f32", "cvt.rn.bf16x2.f32", "st.global.v4.b32"):
            assert op in entry, (tiled, op)  # QueryNorm's part
        part = ptx[("tp8", "index_key")]
        for op in ("cvt.rn.satfinite.e4m3x2.f32", "red.global.min.s64", "rsqrt.approx"):
            assert (op in part) and (op in entry), (tiled, op)  # IndexKey's part
        if tiled == "rows":
            assert "bar.sync" in entry  # the row variant's warp partials


def test_mla_query_streams_weights_on_tensor_cores(ptx):
    for (_shape, name), text in ptx.items():
        if name.startswith("mla_query") and not re.search(r"_s\d+$", name):
            assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 32, name
            assert text.count("cp.async.bulk.prefetch.L2.global") == 2, name
            entries = _entries(text)
            assert len(entries) == 3  # QueryNorm's kernel, project, absorb
            prefetching = [e for e in entries if "cp.async.bulk.prefetch.L2" in e]
            assert len(prefetching) == 2
            for entry in prefetching:
                assert entry.index("cp.async.bulk.prefetch.L2") < entry.index("griddepcontrol.wait")


STREAMED = {  # the shapes MlaQuery's streamed project (kernels/mla_query.py STREAM_FROM_HEADS) is compiled for
    "tp1": RankShape(preset("deepseek-v3.2"), Topology(tp=1)),
    "kimi-dcp2-fp8": SHAPES["kimi-dcp2-fp8"],
}


@pytest.fixture(scope="module")
def streamed_ptx(tmp_path_factory):
    """PTX of the variants a step launches with the streamed project on at any head count: every
    token count, both QueryNorm variants (and in a DCP group the remote, polling ones)."""
    from graphstep.kernels import mla_query

    saved, mla_query.STREAM_FROM_HEADS = mla_query.STREAM_FROM_HEADS, 1
    try:
        out = {}
        for shape_name, shape in STREAMED.items():
            group = shape.topology.dcp > 1
            for variant in catalog.variants(shape, batches=(1, 16, 17, 33, 64, 65), group=group):
                if variant.name.startswith("mla_query"):
                    folder = tmp_path_factory.mktemp(f"{shape_name}-{variant.name}")
                    catalog.compile_op(variant.op, variant.args, "sm_90a", str(folder))
                    (path,) = [p for p in folder.iterdir() if p.suffix == ".ptx"]
                    out[(shape_name, variant.name)] = path.read_text()
        return out
    finally:
        mla_query.STREAM_FROM_HEADS = saved


def test_mla_query_streamed_project_variants(streamed_ptx):
    """With the streamed project on, a step launches it at every batch up to 64 (the register
    kernel above: 65): a variant per token count, each PDL-chained, wide, with no local memory."""
    from graphstep.kernels import mla_query

    for shape_name in STREAMED:
        names = {name for shape, name in streamed_ptx if shape == shape_name}
        assert {n for n in names if n.endswith(("_s16", "_s32", "_s64"))} == {
            f"{n}_s{t}" for n in {re.sub(r"_s\d+$", "", n) for n in names} for t in mla_query.STREAM_TOKENS
        }, names
        assert any(not re.search(r"_s\d+$", n) for n in names), "batches above 64 keep the register kernel"
    check_waits_and_releases(streamed_ptx)
    check_wide_and_no_local(streamed_ptx)


@pytest.mark.parametrize("tokens", (16, 32, 64))
def test_mla_query_streamed_project_streams_q_b_once(streamed_ptx, tokens):
    """The streamed project is IndexQuery's GEMM core over Q_B (kernels/projection.py): each
    of its 12 stages per operand one TMA tensor copy, Q_B's first ring before the PDL wait and
    q_c's after it, no per-thread weight loads, and fp32 q stored as whole 16-byte words."""
    from graphstep.kernels import mla_query
    from graphstep.kernels import projection as J

    w_slots, q_slots = mla_query.STREAM_RINGS[tokens]
    for (shape_name, name), text in streamed_ptx.items():
        if not name.endswith(f"_s{tokens}"):
            continue
        entries = _entries(text)
        assert len(entries) == 3, name  # QueryNorm's kernel, the streamed project, absorb
        (entry,) = [e for e in entries if "mla_query_stream" in e.split("(")[0]]
        # two branches, each behind its own wait: the KV insert's CTAs, then the stream's
        assert entry.count("griddepcontrol.wait;") == 2, (shape_name, name)
        wait, stream = entry.rindex("griddepcontrol.wait;"), entry.index("mbarrier.init")
        assert entry.index("griddepcontrol.wait;") < entry.index("ld.global.nc.v4.b32") < stream < wait
        copies = _tensor_copies(entry)
        weights = [at for at, param in copies if param == 0]
        q_c = [at for at, param in copies if param == 1]
        assert len(weights) == len(q_c) == J.STAGES, (shape_name, name)
        assert sum(at < wait for at in weights) == w_slots and all(at > wait for at in q_c), (shape_name, name)
        assert entry.count("prefetch.tensormap") == 2 and "cp.async.bulk.prefetch.L2" not in entry
        assert set(global_reads(entry[stream:wait])) == {TMA_COPY}  # the stream reads only Q_B before its wait
        assert entry.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == J.STAGES * 4 * tokens // 8
        assert entry.count("st.global.v4.f32") == tokens // 16


def test_mla_query_staged_absorb_reads_each_token_once(monkeypatch, tmp_path):
    """mla_query.ABSORB_STAGED: the absorb stages a tile's q_nope in shared memory (two 16-byte
    stores a thread after four 16-byte fp32 loads, one more CTA barrier) and its MMAs read the
    8 token words a thread from there, where the plain absorb loads all 16 fp32 quads per MMA
    pass from the workspace; the same 16 MMAs."""
    from graphstep.kernels import mla_query

    counts = {}
    for staged in (False, True):
        monkeypatch.setattr(mla_query, "ABSORB_STAGED", staged)
        variant = catalog.build(STREAMED["tp1"], "mla_query", tiled=False, poll=False)
        assert variant.name == "mla_query_rows" + ("_staged" if staged else "")
        folder = tmp_path / str(staged)
        catalog.compile_op(variant.op, variant.args, "sm_90a", str(folder))
        (path,) = [p for p in folder.iterdir() if p.suffix == ".ptx"]
        (absorb,) = [e for e in _entries(path.read_text()) if "mla_query_absorb" in e.split("(")[0]]
        assert ".local" not in absorb
        counts[staged] = [absorb.count(op) for op in ("ld.global.v4.f32", "ld.shared.v4.b32", "st.shared.v4.b32")]
        counts[staged] += [absorb.count("bar.sync"), absorb.count("mma.sync.aligned.m16n8k16")]
    rope = 2  # the rope dims' fp32 quads of the publish, in both
    assert counts[False] == [16 + rope, 2, 0, 2, 16]
    assert counts[True] == [4 + rope, 2 + 8, 2, 3, 16]


def test_fp8_variants_convert_with_saturation(ptx):
    text = ptx[("kimi-dcp2-fp8", "mla_query_rows")]
    assert "cvt.rn.satfinite.e4m3x2.f32" in text
    assert "cvt.rn.satfinite.e4m3x2.f32" not in ptx[("tp8", "mla_query_rows")]
    # the fp8 MLA cache's scales in ue8m0: rounded up to a power of two on the bits
    assert "2139095040" in text and "2139095040" not in ptx[("tp8", "mla_query_rows")]


def test_every_mbarrier_wait_is_bounded(ptx):
    """primitives.mbar_wait: a first try, then a spin that reads the timer's high word and
    traps past guards.MBAR_WAIT_LIMIT_NS -- two tries, each branching on its own predicate,
    and one trap per wait, no other try."""
    waiting = 0
    for (shape, name), text in ptx.items():
        for entry in _entries(text):
            tries = entry.count("mbarrier.try_wait")
            assert tries == 2 * entry.count("trap;"), (shape, name)
            assert entry.count("%globaltimer_hi") == tries, (shape, name)
            assert entry.count("@p bra DONE;") == tries, (shape, name)
            waiting += tries > 0
    assert waiting >= 40  # DsaIndex, IndexQuery, TopK's clusters, SparseCore's rings


def test_a_stuck_wait_traps_after_the_limit(tmp_path):
    """The probe of tests/test_mbar_wait_gpu.py, compiled here: its wait's limit is
    guards.MBAR_WAIT_LIMIT_NS in units of 2**32 ns rounded up (60 s: 14, so it traps after
    60.1-64.4 s), compared signed against the advance of the timer's high word."""
    import cutlass.cute as cute
    import stuck_wait
    from cutlass.base_dsl.compiler import DumpDir

    assert guards.MBAR_WAIT_LIMIT_NS >= 4 * guards.MAX_BUDGET_NS
    stuck_wait.compile_probe(False, (cute.GPUArch("sm_90a"), cute.KeepPTX(), DumpDir(str(tmp_path))))
    (text,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    spin = text[text.index("mbarrier.try_wait") :]
    assert spin.count("mbarrier.try_wait") == 2 and "trap;" in spin
    assert guards.wait_limit_units() == 14 and guards.wait_limit_units() << 32 >= guards.MBAR_WAIT_LIMIT_NS
    # each try branches out on its own predicate; the spin's clock difference is signed
    assert spin.count("@p bra DONE;") == 2 and "selp" not in spin[: spin.index("DONE:")]
    assert "sub.s32 t1, t1, t0;" in spin and "setp.gt.s32 p, t1, 14;" in spin


def test_polling_is_volatile_and_bounded(ptx):
    for name in ("query_wait", "mla_query_rows_poll"):
        text = ptx[("kimi-dcp2-fp8", name)]
        assert "ld.volatile.global.v4.b32" in text and "%globaltimer" in text and "red.global.min.s32" in text
    assert "ld.volatile" not in ptx[("kimi-dcp2-fp8", "mla_query_rows")]
    # QueryWait lets its dependents launch only after its poll (never while it spins)
    text = ptx[("kimi-dcp2-fp8", "query_wait")]
    assert text.rindex("ld.volatile.global.v4.b32") < text.index("griddepcontrol.launch_dependents;")


def test_the_sparse_cores_poll_comes_before_its_pdl_wait(ptx):
    """fork_poll on one rank: each SparseCore split has a polling variant whose partial kernel
    spins on its query rows (volatile, bounded by the global timer, a missing chunk recorded)
    before griddepcontrol.wait -- the rows come from the side stream, not the kernel before --
    and is otherwise the same kernel; the default variants poll nothing. Under DCP the step
    polls in MlaQuery or QueryWait instead, so there is no polling SparseCore there."""
    polling = sorted(name for s, name in ptx if s == "tp8" and name.endswith("_poll") and "sparse_core" in name)
    assert len(polling) == 6
    for name in polling:

        def kernels(variant):
            entries = _entries(ptx[("tp8", variant)])
            partial = [e for e in entries if "sparse_core_partial" in e.split("(")[0]]
            return partial[0], [e for e in entries if e not in partial]

        (partial, rest), (plain, plain_rest) = kernels(name), kernels(name.removesuffix("_poll"))
        spin, wait = partial.index("ld.volatile.global.v4.b32"), partial.index("griddepcontrol.wait;")
        assert spin < wait and "%globaltimer" in partial
        # the acquire after the poll, before any read of the rows (or of the cache rows)
        assert partial.rindex("ld.volatile.global.v4.b32") < partial.index("fence.acq_rel.gpu;") < wait
        assert "red.global.min.s32" in partial
        assert "ld.volatile" not in plain and rest == plain_rest  # the combine, if any, unchanged
    assert not any(name.endswith("_poll") and "sparse_core" in name for s, name in ptx if s == "kimi-dcp2-fp8")


def test_a_sparse_core_poll_needs_rows_that_fit_or_fill_its_ctas():
    kimi = RankShape(preset("kimi-k3.1"), Topology(tp=8))  # 8 rows in a 16-row CTA: its 8 are polled
    assert catalog.build(kimi, "sparse_core", slots=64, poll=True).op.poll
    with pytest.raises(ValueError, match="neither fits nor fills"):
        sparse_core.SparseCore(64, 80, 2048, False, False, 0.1, 64, poll=True)


def test_ptx_command_writes_one_file_per_variant(tmp_path, capsys):
    assert main(["ptx", "--tp", "8", "--out", str(tmp_path), "--batch-size", "4"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    splits = sorted(f"top_k_{split.name}.sm_90a.ptx" for split in top_k.SPLITS)
    assert files == [  # every DsaIndex ring and TopK split: the choice depends on the context too
        "dsa_index.sm_90a.ptx",
        "dsa_index_ring8.sm_90a.ptx",
        "index_key.sm_90a.ptx",
        "index_query_16.sm_90a.ptx",
        "key_and_norm_rows.sm_90a.ptx",
        "mla_query_rows.sm_90a.ptx",
        "query_norm_rows.sm_90a.ptx",
        "sparse_core_s128.sm_90a.ptx",  # B = 4: half a wave (PLAN_HALF_WAVE_TOKENS)
        "sparse_core_s128_poll.sm_90a.ptx",
        "top_k.sm_90a.ptx",
        *splits,
    ]
    out = capsys.readouterr().out
    assert f"{10 + len(splits)} kernel variants" in out and all(str(tmp_path / name) in out for name in files)


def _disassembler():
    try:
        return catalog.nvdisasm()
    except FileNotFoundError:
        pytest.skip("no nvdisasm here (the dev extra's nvidia-cuda-nvdisasm provides one)")


def test_sass_listing_places_each_instruction_at_its_source_line(tmp_path):
    """`graphstep ptx --sass`: the listing of the cubin the DSL built names the kernel module's
    lines, and the line info changes no instruction (the listing is of the code a GPU runs)."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    disassembler = _disassembler()
    variant = catalog.build(SHAPES["tp8"], "top_k", split=top_k.SPLITS[0])
    paths = catalog.write_variant(variant, tmp_path, "sm_90a", disassembler)
    assert [p.name for p in paths] == [f"{variant.name}.sm_90a.ptx", f"{variant.name}.sm_90a.sass"]
    listing = paths[1].read_text()
    lines = set(re.findall(r'//## File "([^"]+)", line (\d+)', listing))
    assert any(path.endswith("kernels/top_k.py") for path, _ in lines), sorted(lines)[:5]
    assert re.search(r"/\*[0-9a-f]{4}\*/\s+BAR\.SYNC", listing)  # offsets as the sanitizer prints them
    # the same op compiled without line info: the same instructions (the DSL adds line info to
    # every compile when its environment asks, so then there is no build without it to compare)
    if any(
        os.environ.get(f"CUTE_DSL_{name}", "").strip() not in ("", "0", "False", "false")
        for name in ("LINEINFO", "DEBUG")
    ):
        pytest.skip("CUTE_DSL_LINEINFO / CUTE_DSL_DEBUG set: every build has line info")
    with_lines, without = tmp_path / "with", tmp_path / "without"
    for folder, options in (
        (with_lines, (cute.KeepCUBIN(), cute.GenerateLineInfo())),
        (without, (cute.KeepCUBIN(),)),
    ):
        folder.mkdir()
        cute.compile[(cute.GPUArch("sm_90a"), DumpDir(str(folder)), *options)](
            variant.op, *variant.args, make_fake_stream()
        )
    sections = []
    for folder in (with_lines, without):
        cubin = next(folder.glob("*.cubin")).read_bytes()
        sections.append({name: cubin[offset : offset + size] for name, _, offset, size, *_ in _elf_sections(cubin)})
    # the two builds differ (line tables in one only: neither took line info from the environment)
    assert ".debug_line" in sections[0] and ".debug_line" not in sections[1]
    texts = [{name: body for name, body in built.items() if name.startswith(".text.")} for built in sections]
    assert texts[0] and texts[0] == texts[1]


class _RoleBarrier:
    """Two warps meet at named barrier 1 from two role branches, SparseCore's pattern: warp 0
    stores 32 shared words, warp 1 reads them after the barrier. `named`: the barrier as
    primitives.named_sync issues it (non-aligned), else the aligned `bar.sync`."""

    def __init__(self, named: bool):
        self.named = named

    @cute.jit
    def __call__(self, out: cute.Pointer, stream: cuda.CUstream):
        self.kernel(out).launch(grid=[1, 1, 1], block=[64, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Pointer):
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tid // 32)
        words = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
        seen = Int32(0)
        if warp == 0:
            words[tid] = tid * 3 + 1
            self.barrier()
        else:
            seen = tid
            self.barrier()
        cute.make_tensor(out, cute.make_layout(64))[tid] = words[tid % 32] + seen

    def barrier(self):
        if self.named:
            P.named_sync(1, 64)
        else:
            cute.arch.inline_ptx("bar.sync 1, 64;")


def test_non_aligned_named_barriers_are_marked_in_the_cubin(tmp_path):
    """The two forms of a named barrier reached from two role branches assemble to the same
    barrier instruction (`BAR.SYNC.DEFER_BLOCKING 0x1, 0x40`, one a branch), and differ in the
    cubin's list of member-mask instructions (EIATTR 0x28): `barrier.sync`
    (primitives.named_sync) is listed, `bar.sync` is not. compute-sanitizer's
    synccheck reads that list: on an H100 (session 28, bench/probe_role_barrier.cu) the
    aligned form in role branches gave 4224 "Divergent thread(s) in block" errors and the
    non-aligned form none."""
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    disassembler = _disassembler()
    built = {}
    for named in (False, True):
        folder = tmp_path / ("named" if named else "aligned")
        folder.mkdir()
        out = P.gmem_ptr(Int32)
        cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), DumpDir(str(folder))](
            _RoleBarrier(named), out, make_fake_stream()
        )
        (path,) = folder.glob("*.cubin")
        cubin = path.read_bytes()
        listing = subprocess.run([disassembler, "-c", str(path)], check=True, capture_output=True, text=True).stdout
        ((kernel, bars),) = _named_barriers(listing).items()
        built[named] = bars, _coop_group_offsets(cubin).get(kernel, set())
    (aligned_bars, aligned_marked), (named_bars, named_marked) = built[False], built[True]
    assert len(aligned_bars) == len(named_bars) == 2  # one a role branch
    assert not aligned_bars & aligned_marked
    assert named_bars <= named_marked


def test_ptx_sass_without_nvdisasm_fails_before_compiling(tmp_path, monkeypatch, capsys):
    def missing():
        raise FileNotFoundError("nvdisasm was not found (somewhere)")

    def compile_op(*args, **kwargs):
        raise AssertionError("compiled although --sass cannot be honoured")

    monkeypatch.setattr(catalog, "nvdisasm", missing)
    monkeypatch.setattr(catalog, "compile_op", compile_op)
    assert main(["ptx", "--out", str(tmp_path), "--batch-size", "1", "--sass"]) == 2
    assert "graphstep ptx: nvdisasm was not found" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_nvdisasm_is_found_under_cuda_home(tmp_path, monkeypatch):
    tool = tmp_path / "bin" / "nvdisasm"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setattr(catalog.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert catalog.nvdisasm() == str(tool)


def test_ptx_of_one_batch_needs_its_norm_variant(tmp_path):
    with pytest.raises(ValueError, match="needs `tiled`"):
        catalog.write_ptx(tmp_path, "sm_90a", SHAPES["tp8"], batch=4)


def test_compile_cache_is_keyed_by_configuration_not_identity():
    from graphstep.kernels import mla_query

    def op():
        return mla_query.MlaQuery(16, 0, 16, 16, 2304, True, False, False, False)

    first = catalog.compile_op(op(), mla_query.compile_args(), "sm_90a")
    assert catalog.compile_op(op(), mla_query.compile_args(), "sm_90a") is first
    other = mla_query.MlaQuery(16, 0, 16, 16, 2304, False, False, False, False)
    assert catalog._key(other, "sm_90a") != catalog._key(op(), "sm_90a")


def test_indexer_kernels_use_the_tensor_cores(ptx):
    for shape in SHAPES:
        scorer = ptx[(shape, "dsa_index")]
        # a page: eight m64n64k16 wgmmas (64 keys x 64 heads x 128 dims), keys as A from
        # registers widened exactly from e4m3, queries as B from shared memory, FP32 accumulation
        assert scorer.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16") == 8
        assert scorer.count("wgmma.commit_group.sync.aligned") == 1 and "wgmma.wait_group.sync.aligned 0" in scorer
        assert "cvt.rn.f16x2.e4m3x2" in scorer and "fence.proxy.async.shared::cta" in scorer
        # pages stream by the bulk copy engine into an mbarrier-completed ring
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in scorer
        assert "mbarrier.arrive.expect_tx.shared::cta.b64" in scorer and "mbarrier.try_wait.parity" in scorer
        # every release of a ring stage comes after a proxy fence (without it the reused stage
        # was overwritten while its key words were still being read: kernels/dsa_index.py)
        lines = [line.strip() for line in scorer.splitlines() if line.strip() and not line.strip().startswith("//")]
        releases = [i for i, line in enumerate(lines) if line.startswith("mbarrier.arrive.shared::cta.b64")]
        assert releases, "the consumers release the stages"
        for i in releases:
            assert "fence.proxy.async.shared::cta;" in lines[max(0, i - 3) : i], lines[i - 3 : i + 1]
        assert "ld.global.v4.b32" in scorer  # the query rows
        # before the PDL wait: the length and a block-table entry (read-only loads), and an L2
        # prefetch of the first pages; every copy of cache bytes into the SM comes after it
        wait = scorer.index("griddepcontrol.wait")
        assert re.findall(r"ld\.global[.\w]*", scorer[:wait]) == ["ld.global.nc.s32"] * 2
        assert "cp.async.bulk.prefetch.L2.global" in scorer[:wait]
        assert "cp.async.bulk.shared" not in scorer[:wait] and "ld.shared" not in scorer[:wait]


def _tensor_copies(entry: str) -> list[tuple[int, int]]:
    """(position, kernel parameter of its tensor map) of each TMA tensor copy of a PTX entry:
    a copy names its map by a register that cvta.param takes from the parameter's address."""
    params = dict(re.findall(r"mov\.b64\s+(%rd\d+), \w+_param_(\d+);", entry))
    generic = {dst: params[src] for dst, src in re.findall(r"cvta\.param\.u64\s+(%rd\d+), (%rd\d+);", entry)}
    copies = re.finditer(
        r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier::\S+ \[[^]]+\], \[(%rd\d+),", entry
    )
    return [(m.start(), int(generic[m.group(1)])) for m in copies]


@pytest.mark.parametrize("tokens", index_query.TOKENS)
def test_index_query_streams_once_in_one_fused_kernel(ptx, tokens):
    from graphstep.kernels import projection as J

    text = ptx[("tp8", f"index_query_{tokens}")]
    (entry,) = _entries(text)  # projection, RoPE, e4m3 and head weights in one kernel
    wait = entry.index("griddepcontrol.wait;")
    # every stage of each operand is one TMA tensor copy (wq_b's map: parameter 0, q_c's: 1):
    # the weight ring's stages before the wait, every q_c stage after it; no per-thread copies
    copies, (w_slots, q_slots) = _tensor_copies(entry), index_query.RINGS[tokens]
    weights = [at for at, param in copies if param == 0]
    q_c = [at for at, param in copies if param == 1]
    assert len(weights) == len(q_c) == J.STAGES and len(copies) == 2 * J.STAGES
    assert sum(at < wait for at in weights) == w_slots and all(at > wait for at in q_c)
    assert "cp.async.cg" not in entry and "cp.async.bulk.shared" not in entry
    assert entry.count("prefetch.tensormap") == 2
    # one armed full barrier per fill (the operand's bytes: both rings armed at the start,
    # then each refill), released stage by stage after a proxy fence by every thread (in
    # each ring all but its last ring of stages, which are not refilled)
    armed = re.findall(r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);", entry)
    w_bytes, q_bytes = str(J.operand_bytes(J.ROWS)), str(J.operand_bytes(tokens))
    assert armed[: w_slots + q_slots] == [w_bytes] * w_slots + [q_bytes] * q_slots
    # (the preset rotates: the rotation's `ready` mbarrier, armed at the start with the peer's pushes)
    swap = str(tokens * J.ROWS * 4)
    assert armed[w_slots + q_slots] == swap
    assert sorted(armed) == sorted([w_bytes] * J.STAGES + [q_bytes] * J.STAGES + [swap])
    lines = [line.strip() for line in entry.splitlines() if line.strip() and not line.strip().startswith("//")]
    releases = [i for i, line in enumerate(lines) if line.startswith("mbarrier.arrive.shared::cta.b64")]
    assert len(releases) == 2 * J.STAGES - w_slots - q_slots
    for i in releases:  # no shared read between a release and the fence before it
        fence = max(j for j in range(i) if lines[j] == "fence.proxy.async.shared::cta;")
        assert i - fence <= 8 and not any("shared" in line for line in lines[fence + 1 : i] if "arrive" not in line)
    # no CTA barrier per stage: one before the wait (the mbarriers' initialization), three
    # after the loop (the ring free, then the two k-halves' sums into the result tile), and
    # the rotation's: the tile read before the peer is told it may overwrite it
    assert entry[:wait].count("bar.sync") == 1 and entry.count("bar.sync") == 5
    assert not re.search(r"ld\.global", entry[:wait])
    # the epilogue's reads per token (length, its RoPE row's cos and sin, the logits of w): at
    # <= EARLY_READS tokens all between the wait and the first MMA, else after the last
    reads = [m.start() for m in re.finditer(r"ld\.global\.(s32|nc\.v4\.f32|b32) ", entry)]
    assert len(reads) == 4 * tokens // 16
    first_mma, last_mma = entry.index("mma.sync"), entry.rindex("mma.sync")
    if tokens <= index_query.EARLY_READS:
        assert all(wait < at < first_mma for at in reads)
    else:
        assert all(at > last_mma for at in reads)
    # tensor cores fed by ldmatrix: 4 k-steps x tokens / 8 n-tiles per warp and stage
    assert entry.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == J.STAGES * 4 * tokens // 8
    assert entry.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == J.STAGES * 2 * (2 + tokens // 8)
    # the head's two CTAs swap their halves (rotated: DeepSeek-V3.2) through distributed shared
    # memory: one-way pushes onto mbarriers after the start's cluster barrier, no other
    push = "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32"
    assert "mapa.shared::cluster.u32" in entry and entry.count(push) == tokens // 16
    assert entry.count("barrier.cluster.arrive") == 1 and entry.count("barrier.cluster.wait") == 1
    assert "cvt.rn.satfinite.e4m3x2.f32" in entry and ".minnctapersm 2" in entry


@pytest.mark.parametrize("tokens", index_query.TOKENS)
def test_index_query_fits_two_ctas_per_sm(tmp_path, tokens):
    """Two CTAs per SM (so two of DsaIndex's CTAs fit beside one under PDL): <= 128 registers
    with no spills, and at most half the SM's 228 KB of shared memory, less the 1 KB per CTA
    the hardware reserves: the launch's dynamic shared memory (a constant of the compiled
    host code) is index_query.shared_bytes. Beside one, two DsaIndex CTAs' shared memory and
    registers (64K per SM, allocated per warp in multiples of 8 a thread)."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream
    from graphstep.kernels import dsa_index

    def registers(threads, regs):
        return threads * -(-regs // 8) * 8

    scorer_folder = tmp_path / "dsa_index"
    scorer_folder.mkdir()
    scorer_op = catalog.build(SHAPES["tp8"], "dsa_index", True)
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), DumpDir(str(scorer_folder))](
        scorer_op.op, *scorer_op.args, make_fake_stream()
    )
    (cubin,) = [p for p in scorer_folder.iterdir() if p.suffix == ".cubin"]
    scorer_registers = registers(dsa_index.THREADS, _cubin_attributes(cubin.read_bytes())["regs"])
    for hadamard in (False, True):
        folder = tmp_path / f"h{hadamard}"
        folder.mkdir()
        op = index_query.IndexQuery(2304, 2240, tokens, True, hadamard)
        compiled = cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), DumpDir(str(folder))](
            op, *index_query.compile_args(), make_fake_stream()
        )
        (cubin,) = [p for p in Path(folder).iterdir() if p.suffix == ".cubin"]
        found = _cubin_attributes(cubin.read_bytes())
        assert found["frame"] == 0 and found["regs"] <= 128, (tokens, hadamard, found)
        shared = index_query.shared_bytes(tokens, hadamard)
        assert f"llvm.mlir.constant({shared} : i64)" in str(compiled.ir_module), (tokens, hadamard, shared)
        assert shared <= 228 * 1024 // 2 - 1024, shared
        scorer = dsa_index.STAGES * dsa_index.PAGE_BYTES + dsa_index.QUERY_BYTES + 16 * dsa_index.STAGES
        assert (shared + 1024) + 2 * (scorer + 1024) <= 228 * 1024, (shared, scorer)
        # the deep ring (B = 3 / 4 at 32K): one of its CTAs fits beside one, two beside none
        deep = dsa_index.DEEP_STAGES * (dsa_index.PAGE_BYTES + 16) + dsa_index.QUERY_BYTES
        assert (shared + 1024) + (deep + 1024) <= 228 * 1024 < (shared + 1024) + 2 * (deep + 1024)
        assert 2 * (deep + 1024) <= 228 * 1024
        assert registers(256, found["regs"]) + 2 * scorer_registers <= 65536, (found, scorer_registers)


def _variant_ptx(op, args, folder) -> str:
    catalog.compile_op(op, args, "sm_90a", str(folder))
    (path,) = [p for p in folder.iterdir() if p.suffix == ".ptx"]
    return path.read_text()


def _counts(text: str) -> dict:
    ops = ("shfl.sync.bfly.b32", "add.rn.f32", "sub.rn.f32", "fma.rn.f32", "mul.rn.f32", "div.rn.f32")
    return {op: text.count(op) for op in ops}


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_index_key_rotation_is_a_warp_butterfly(tmp_path, ue8m0):
    """IndexKey with the rotation: per key, stages h = 1, 2 in the lane (4 add.rn, 4 sub.rn)
    and h = 4 .. 64 across lanes (5 x 4 shuffles, each pair one exact fma by +-1), then the
    128^-0.5 scale; ue8m0: the scale rounded up on its bits, no division by 448."""
    from graphstep.kernels import index_key

    def variant(hadamard):
        op = index_key.IndexKey(2304, 2112, 1e-6, True, hadamard, ue8m0)
        folder = tmp_path / f"h{hadamard}"
        folder.mkdir()
        return _variant_ptx(op, index_key.compile_args(), folder)

    plain, rotated = variant(False), variant(True)
    assert catalog._key(index_key.IndexKey(2304, 2112, 1e-6, True, True, ue8m0), None) != catalog._key(
        index_key.IndexKey(2304, 2112, 1e-6, True, False, ue8m0), None
    )
    before, after = _counts(plain), _counts(rotated)
    extra = {op: after[op] - before[op] for op in after}
    assert extra == {
        "shfl.sync.bfly.b32": 20,
        "add.rn.f32": 4,
        "sub.rn.f32": 4,
        "fma.rn.f32": 20,
        "mul.rn.f32": 4,
        "div.rn.f32": 0,
    }
    for text in (plain, rotated):
        assert ("and.b32" in text and "2139095040" in text) == ue8m0  # the exponent mask
        assert ("0f43E00000" in text) != ue8m0  # / 448
        assert ".local" not in text


@pytest.mark.parametrize("tokens", index_query.TOKENS)
def test_index_query_rotation_spans_the_cluster(tmp_path, tokens):
    """IndexQuery with the rotation: per token group of 16 threads, 16 shuffles for the stages
    h = 4 .. 32 inside the CTA's 64 dims, the last stage (i, i + 64) through one 16-byte push
    (st.async onto the peer's `ready` mbarrier) into the peer CTA's tile per thread and token,
    once the peer has read it (its remote arrival on this CTA's `free`), and no amax swap:
    one cluster barrier (the start's relaxed arrive after the PDL wait, waited before the
    exchange) against the two without it."""

    def variant(hadamard, ue8m0):
        op = index_query.IndexQuery(2304, 2240, tokens, True, hadamard, ue8m0)
        folder = tmp_path / f"h{hadamard}u{ue8m0}"
        folder.mkdir()
        (entry,) = _entries(_variant_ptx(op, index_query.compile_args(), folder))
        return entry

    plain, rotated = variant(False, False), variant(True, True)
    groups = tokens // 16
    before, after = _counts(plain), _counts(rotated)
    assert after["shfl.sync.bfly.b32"] - before["shfl.sync.bfly.b32"] == 16 * groups
    # 16 across the threads, 8 for the last stage (this rank's output and the other's for |max|)
    assert after["fma.rn.f32"] - before["fma.rn.f32"] == 24 * groups
    assert after["mul.rn.f32"] - before["mul.rn.f32"] == 9 * groups  # 8 x 128^-0.5, 1 ue8m0 scale
    push = "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32"
    assert plain.count("st.shared::cluster.f32") == groups and "st.shared::cluster.v4" not in plain
    assert rotated.count(push) == groups and "st.shared::cluster" not in rotated and push not in plain
    # thread 0 tells the peer its tile is read: released at CTA scope, never the cluster's
    assert rotated.count("mbarrier.arrive.release.cta.shared::cluster.b64") == 1
    assert "mbarrier.arrive.release.cluster" not in rotated
    assert rotated.count("mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64") == 2 * 2  # free, ready (bounded)
    assert "barrier.cluster.arrive.relaxed" in plain and "barrier.cluster.arrive.relaxed" in rotated
    assert plain.count("barrier.cluster.arrive") == 2 and plain.count("barrier.cluster.wait") == 2
    assert rotated.count("barrier.cluster.arrive") == 1 and rotated.count("barrier.cluster.wait") == 1
    for entry in (plain, rotated):
        assert ".local" not in entry
    wait = rotated.index("griddepcontrol.wait;")
    assert "barrier.cluster" not in rotated[:wait]
    # the start's arrive follows the swap mbarriers' initialization and its fence
    assert rotated.index("fence.mbarrier_init.release.cluster") < rotated.index("barrier.cluster.arrive.relaxed")


def test_top_k_selects_by_radix_histograms_not_a_sort(ptx):
    for shape, name in [*((shape, "top_k") for shape in SHAPES), ("kimi-dcp2-fp8", "dcp_merge")]:
        text = ptx[(shape, name)]
        assert "atom.shared.add" in text and "bar.sync" in text and "shfl.sync.up.b32" in text  # block scans
        # TopK ranks each chunk's elements by ballots; DcpMerge holds 4 a thread and scans their count
        assert ("vote.sync.ballot.b32" in text) == (name == "top_k")
    # DCP: candidates carry their scores for the merge; a single rank writes slots only
    assert ptx[("kimi-dcp2-fp8", "top_k")].count("st.global.b32") > ptx[("tp8", "top_k")].count("st.global.b32")


def test_sparse_core_has_a_variant_per_planned_split_and_uses_the_tensor_cores(ptx):
    """The plan's variants of 16- and 32-row CTAs on mma.sync: per block and column warp, 36
    k steps of scores per 8-slot tile and P @ V over the block's 16-slot steps x 8 n-tiles,
    in bf16. partial_mma_sync (every thread copies into a ring of ring_stages blocks), fp8
    rows dequantized in shared memory; the variants MMA_PRODUCER_BLOCKS puts on partial_mma_ws
    and TRANSPOSED_BLOCKS on partial_transposed_ws have their own PTX tests (TP 8's bf16 cache
    takes partial_mma_ws at every split: partial_mma_sync's planned variants here are the fp8
    cache's 32-slot ones)."""
    checked = []
    for shape_name, shape in SHAPES.items():
        names = sorted(
            name for s, name in ptx if s == shape_name and name.startswith("sparse_core") and not name.endswith("_poll")
        )
        choices = sorted(
            {sparse_core.plan(b, shape.q_heads, shape.model.index_topk, shape.topology.mla_cache) for b in range(1, 65)}
        )
        assert names == sorted(f"sparse_core_s{slots}" for slots in choices)
        fp8 = shape.topology.mla_cache == "fp8"
        for name in names:
            op_slots = int(name.split("_s")[-1])
            op = catalog.build(shape, "sparse_core", slots=op_slots).op
            heads = sparse_core.heads_per_cta(shape.q_heads)
            least = sparse_core.MMA_PRODUCER_BLOCKS["fp8" if fp8 else "bf16"]
            most = sparse_core.TRANSPOSED_BLOCKS["fp8" if fp8 else "bf16"]
            block = sparse_core.block_for(op_slots)
            assert op.transposed == (heads == 16 and block == 64 and op_slots // block <= most)
            assert op.mma_ws == (heads == 16 and not op.transposed and op_slots // block >= least)
            if op.mma_ws or op.transposed:  # (their own PTX tests)
                continue
            heads = sparse_core.heads_per_cta(shape.q_heads)
            block, cols = sparse_core.block_for(op_slots), sparse_core.COLS
            text = ptx[(shape_name, name)]
            assert len(_entries(text)) == (2 if op_slots < shape.model.index_topk else 1)  # partial (+ combine)
            tiles = max(1, block // 8 // cols)  # QK slot tiles per warp: 36 k steps each
            values = (block // 16) * (512 // cols // 8)  # P @ V: k steps x n-tiles
            bf16 = text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
            per_block = tiles * 36 + values
            assert bf16 >= per_block and bf16 % per_block == 0, (name, bf16)  # (the compiler may peel a block)
            assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text and "cp.async.cg.shared.global" in text
            assert "f16.f16.f32" not in text and "mbarrier" not in text
            assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text
            stages = sparse_core.ring_stages(heads, block, op_slots, fp8)
            assert f"cp.async.wait_group {stages - 1}" in text
            checked.append((shape_name, name))
    assert checked, "no planned variant reached partial_mma_sync's checks"
    # the fp8 cache and fp8 query rows are widened exactly
    assert "cvt.rn.f16x2.e4m3x2" in ptx[("kimi-dcp2-fp8", "sparse_core_s32")]
    assert "cvt.rn.f16x2.e4m3x2" not in ptx[("tp8", "sparse_core_s32")]


MMA_SHAPES = {
    **SHAPES,
    "tp8-fp8": RankShape(preset("deepseek-v3.2"), Topology(tp=8, mla_cache="fp8")),
    "tp8-dcp2": RankShape(preset("deepseek-v3.2"), Topology(tp=8, dcp=2)),
    "tp8-dcp2-fp8": RankShape(preset("deepseek-v3.2"), Topology(tp=8, dcp=2, q_format="fp8", mla_cache="fp8")),
}


def _compile_sparse_core(tmp_path, shape, slots: int, producer: bool) -> tuple:
    """PTX and cubin attributes of a SparseCore variant's partial kernel."""
    variant = catalog.build(shape, "sparse_core", slots=slots, publish=slots == 2048, producer=producer)
    return (variant.op, *_compile_partial(tmp_path, variant))


def _compile_partial(out, variant) -> tuple:
    """(PTX, cubin attributes) of a SparseCore catalog variant's partial kernel, compiled for
    sm_90a into the folder `out` (created)."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    out.mkdir(parents=True, exist_ok=True)
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(out))](
        variant.op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in out.iterdir() if p.suffix == ".ptx"]
    partial = next(e for e in _entries(ptx) if "sparse_core_partial" in e.split("(")[0])
    (cubin,) = [p for p in out.iterdir() if p.suffix == ".cubin"]
    (found,) = [v for k, v in _cubin_kernels(cubin.read_bytes()).items() if "sparse_core_partial" in k]
    return partial, found


def test_sparse_core_no_combine_probe_drops_only_the_combine_launch(tmp_path, monkeypatch):
    """bench_sparse_core.py --probes no_combine (sparse_core.COMBINE = False): a split
    variant's module holds the partial kernel alone, its PTX the default's (source lines
    aside); the probe is its own compile-cache entry, so the default never runs without its
    combine."""
    modules, keys = {}, {}
    for combine in (True, False):
        monkeypatch.setattr(sparse_core, "COMBINE", combine)
        variant = catalog.build(MMA_SHAPES["tp8"], "sparse_core", slots=64)
        assert variant.op.splits == 32 and variant.op.combine == combine
        keys[combine] = catalog._key(variant.op, "sm_90a")
        catalog.compile_op(variant.op, variant.args, "sm_90a", str(tmp_path / str(combine)))
        (ptx,) = [p.read_text() for p in (tmp_path / str(combine)).iterdir() if p.suffix == ".ptx"]
        modules[combine] = {
            short(re.match(r"\.entry (\w+)\(", e).group(1)): "\n".join(
                line
                for line in e[: e.rindex("\n}") + 2].splitlines()
                if not line.lstrip().startswith((".loc", ".file"))
            )  # (an entry's text ends at its closing brace)
            for e in _entries(ptx)
        }
    assert sorted(modules[True]) == ["cute:sparse_core_combine", "cute:sparse_core_partial"]
    assert sorted(modules[False]) == ["cute:sparse_core_partial"]
    assert modules[False]["cute:sparse_core_partial"] == modules[True]["cute:sparse_core_partial"]
    assert keys[True] != keys[False]


@pytest.mark.parametrize("slots", [512, 64])  # 4 splits (combine_warp), 32 (combine_cta)
def test_sparse_core_combine_early_probe_moves_only_the_combines_wait(tmp_path, monkeypatch, slots):
    """bench_sparse_core.py --probes combine_early (sparse_core.COMBINE_EARLY): the combine loads
    the partials before its griddepcontrol.wait (the default waits before any load); the partial
    kernel's PTX is the default's and the probe is its own compile-cache entry."""
    modules, keys = {}, {}
    for early in (False, True):
        monkeypatch.setattr(sparse_core, "COMBINE_EARLY", early)
        variant = catalog.build(MMA_SHAPES["tp8"], "sparse_core", slots=slots)
        assert variant.op.combine_early == early and variant.op.splits == 2048 // slots
        keys[early] = catalog._key(variant.op, "sm_90a")
        catalog.compile_op(variant.op, variant.args, "sm_90a", str(tmp_path / str(early)))
        (ptx,) = [p.read_text() for p in (tmp_path / str(early)).iterdir() if p.suffix == ".ptx"]
        modules[early] = {
            short(re.match(r"\.entry (\w+)\(", e).group(1)): [
                line.strip()
                for line in e[: e.rindex("\n}") + 2].splitlines()
                if not line.lstrip().startswith((".loc", ".file"))
            ]
            for e in _entries(ptx)
        }
    assert modules[True]["cute:sparse_core_partial"] == modules[False]["cute:sparse_core_partial"]
    assert keys[True] != keys[False]
    for early, module in modules.items():
        combine = module["cute:sparse_core_combine"]
        waits = [i for i, line in enumerate(combine) if line.startswith("griddepcontrol.wait")]
        loads = [i for i, line in enumerate(combine) if re.match(r"(@!?%?\w+\s+)?ld\.global", line)]
        assert len(waits) == 1 and loads
        if early:  # the partials loaded before the wait
            assert min(loads) < waits[0]
        else:
            assert waits[0] < min(loads)


@pytest.mark.parametrize(
    "shape_name, slots, ways",
    [("tp1-fp8", 512, 1), ("tp1-fp8", 1024, 1), ("tp8", 512, 1), ("tp1-fp8", 128, 4), ("tp8", 64, 4)],
)  # 4 / 2 / 4 / 16 / 32 splits
def test_sparse_core_combine_takes_one_warp_a_head_up_to_combine_warp_splits(tmp_path, shape_name, slots, ways):
    """The combine kernel: up to COMBINE_WARP_SPLITS splits one warp a (quarter, head), four
    heads a CTA (the grid covers the gathered heads), each lane's float4 of every split loaded
    before the (max, sum) it reduces by shuffles, no barrier, no shared memory; more splits:
    the CTA's four warps share one (quarter, head) and meet at its barriers. No local memory."""
    shape = {**MMA_SHAPES, "tp1-fp8": RankShape(preset("deepseek-v3.2"), Topology(tp=1, mla_cache="fp8"))}[shape_name]
    variant = catalog.build(shape, "sparse_core", slots=slots, publish=True)
    op = variant.op
    assert (op.combine_warps, op.combine_heads) == (ways, 4 // ways) and not op.clustered
    assert (op.splits <= sparse_core.COMBINE_WARP_SPLITS) == (ways == 1)
    catalog.compile_op(op, variant.args, "sm_90a", str(tmp_path))
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    (combine,) = [e for e in _entries(ptx) if "sparse_core_combine" in e.split("(")[0]]
    outputs = [m.start() for m in re.finditer(r"ld\.global\.v4\.f32", combine)]
    assert len(outputs) == -(-op.splits // ways)  # this warp's share of the splits, one float4 each
    assert ".local" not in combine
    if ways == 1:
        assert "bar.sync" not in combine and ".shared" not in combine
        assert outputs[-1] < combine.index("ld.global.v2.f32") < combine.index("shfl.sync.bfly")
        assert combine.count("shfl.sync.bfly") == 10  # the max and the total over the warp
        assert combine.count("shfl.sync.idx") == op.splits  # split s's weight from lane s
    else:
        assert combine.count("bar.sync") == 5 and "st.shared" in combine


@pytest.mark.parametrize("value", [-1, 33])
def test_sparse_core_refuses_a_combine_warp_splits_past_a_warp(monkeypatch, value):
    """combine_warp holds split s's (max, sum) in lane s: at most 32 splits a warp."""
    monkeypatch.setattr(sparse_core, "COMBINE_WARP_SPLITS", value)
    with pytest.raises(ValueError, match=r"COMBINE_WARP_SPLITS must be 0 \.\. 32"):
        catalog.build(MMA_SHAPES["tp8"], "sparse_core", slots=512)


@pytest.mark.parametrize(
    "slots, cluster_splits", [(64, None), (256, None), (512, None), (1024, None), (256, 8), (512, 8)]
)
@pytest.mark.parametrize("shape_name", ["tp8", "tp8-fp8", "kimi-dcp2-fp8"])
def test_sparse_core_mma_producer_path_combines_in_a_cluster_at_up_to_cluster_splits(
    tmp_path, monkeypatch, shape_name, slots, cluster_splits
):
    """partial_mma_ws with 2 .. CLUSTER_SPLITS splits (the module's 2: 1024 slots a CTA at k
    2048; at 8 also 8 and 4 splits) has no combine kernel and stores no partials: each CTA
    stages its rows in shared memory, every thread of the CTA meets the cluster twice
    (barrier.cluster arrive / wait: the producer warps after their loops, the consumers
    around cluster_combine), and between the two barriers each consumer thread loads every
    split's (max, sum) and its dims of every split's rows over DSMEM (mapa +
    ld.shared::cluster: splits x (1 + dims / 4)); registers as the unclustered variant (168,
    no spills). At more splits the combine kernel stays, no cluster."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    if cluster_splits is not None:
        monkeypatch.setattr(sparse_core, "CLUSTER_SPLITS", cluster_splits)
    shape = MMA_SHAPES[shape_name]
    variant = catalog.build(shape, "sparse_core", slots=slots, publish=True, producer=True)
    op = variant.op
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(tmp_path))](
        op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    (cubin,) = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    splits = shape.model.index_topk // slots
    assert op.mma_ws and op.splits == splits and op.clustered == (splits <= sparse_core.CLUSTER_SPLITS)
    names = [short(name) for name in re.findall(r"\.entry (\w+)\(", ptx)]
    partial = next(e for e in _entries(ptx) if "sparse_core_partial" in e.split("(")[0])
    if not op.clustered:
        assert names == ["cute:sparse_core_partial", "cute:sparse_core_combine"] and "barrier.cluster" not in partial
        return
    assert names == ["cute:sparse_core_partial"]
    arrives = re.findall(r"barrier\.cluster\.arrive(?:\.release)?\.aligned;", partial)
    waits = re.findall(r"barrier\.cluster\.wait(?:\.acquire)?(?:\.aligned)?;", partial)
    assert len(arrives) == len(waits) == 4, (len(arrives), len(waits))  # 2 on each side of the warp split
    width = 512 // splits // 16
    assert partial.count("mapa.shared::cluster.u32") == splits * (1 + width // 4)
    assert partial.count("ld.shared::cluster.v2.f32") == splits
    assert partial.count("ld.shared::cluster.v4.f32") == splits * (width // 4)
    assert "st.global.v2.f32" in partial  # out
    first, last = partial.index("barrier.cluster.arrive"), partial.rindex("barrier.cluster.wait")
    loads = [found.start() for found in re.finditer(r"ld\.shared::cluster", partial)]
    assert all(first < at < last for at in loads)
    dec = partial.index(f"setmaxnreg.dec.sync.aligned.u32 \t{sparse_core_mma.MMA_PRODUCER_REGS};")
    inc = partial.index(f"setmaxnreg.inc.sync.aligned.u32 \t{sparse_core_mma.MMA_CONSUMER_REGS};")
    producer = partial[dec:inc] if dec < inc else partial[dec:]
    assert producer.count("barrier.cluster.arrive") == 2, "the producer warps meet both cluster barriers"
    (found,) = [v for k, v in _cubin_kernels(cubin.read_bytes()).items() if "sparse_core_partial" in k]
    assert found == {"regs": 168, "frame": 0}, found


@pytest.mark.parametrize("bulk", [None, 0, 3, 16], ids=lambda n: "default" if n is None else f"bulk{n}")
@pytest.mark.parametrize("slots", [16, 32, 64, 1024, 2048])
@pytest.mark.parametrize("shape_name", ["tp8", "tp8-fp8", "kimi-dcp2-fp8"])
def test_sparse_core_mma_producer_path_keeps_its_registers_and_has_no_cta_barrier_in_its_loop(
    tmp_path, monkeypatch, shape_name, slots, bulk
):
    """16-row CTAs with a producer warpgroup (partial_mma_ws): 384 threads, setmaxnreg
    re-dealing the launch's 168 registers a thread as 2 x MMA_CONSUMER_REGS +
    MMA_PRODUCER_REGS, no spills. The producer (between setmaxnreg.dec and .inc) copies each
    block's rows two ways (MMA_BULK_SIXTEENTHS[cache] / 16 of them bulk: the module's table,
    none, 3 / 16, all): cp.async.bulk, one per row below bulk_rows (row_bytes each,
    bulk_rows / 32 per lane per block; the compiler may unroll the loop), the bytes of
    those rows alone expected on the full mbarrier; the rest by 16-byte cp.async.cg, each
    with its zero-fill operand (holes), a warp per row (ceil(rest / 3) rows per warp, 72 /
    32 or 41 / 32 instructions a row), then one cp.async.mbarrier.arrive.noinc per thread.
    The full mbarrier counts 32 arrivals (the bulk warp's lanes) + 96 (the cp.async
    threads'; none when every row is bulk-copied). The consumers copy no cache rows and
    release a stage behind a proxy fence. They meet at their named barrier (bar.sync 1,
    256), and the CTA's one bar.sync 0 is before the loop (the mbarriers' initialization).
    Over the fp8 cache the latent's MMAs are f16 (e4m3 widened by cvt, exactly), the rope's
    bf16; over the bf16 cache every MMA is bf16."""
    if bulk is not None:
        monkeypatch.setattr(sparse_core, "MMA_BULK_SIXTEENTHS", {"bf16": bulk, "fp8": bulk})
    shape = MMA_SHAPES[shape_name]
    op, partial, found = _compile_sparse_core(tmp_path, shape, slots, True)
    fp8 = shape.topology.mla_cache == "fp8"
    assert op.mma_ws and not op.wgmma and op.threads == op.consumers + 128 == 384
    assert op.stages == sparse_core.ws_stages(op.block, fp8) == (4 if fp8 else 3 if op.block == 64 else 4)
    assert found == {"regs": 168, "frame": 0}, found
    assert 2 * sparse_core_mma.MMA_CONSUMER_REGS + sparse_core_mma.MMA_PRODUCER_REGS == 3 * 168
    sixteenths = sparse_core.MMA_BULK_SIXTEENTHS["fp8" if fp8 else "bf16"] if bulk is None else bulk
    assert op.bulk_rows == op.block * sixteenths // 16
    rest = op.block - op.bulk_rows  # rows by cp.async
    dec = partial.index(f"setmaxnreg.dec.sync.aligned.u32 \t{sparse_core_mma.MMA_PRODUCER_REGS};")
    inc = partial.index(f"setmaxnreg.inc.sync.aligned.u32 \t{sparse_core_mma.MMA_CONSUMER_REGS};")
    assert ".reqntid 384, 1, 1" in partial and ".minnctapersm 1" in partial
    assert partial.count("mbarrier.init.shared::cta.b64") == 2 * op.stages
    arrivals = 32 + (96 if rest else 0)
    assert len(re.findall(rf"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], {arrivals};", partial)) == op.stages
    producer = partial[dec:inc] if dec < inc else partial[dec:]
    copy = r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes [^,]+, [^,]+, (\d+),"
    bulk_copies = re.findall(copy, producer)
    per_lane = (op.bulk_rows + 31) // 32
    if op.bulk_rows:
        assert bulk_copies and len(bulk_copies) % per_lane == 0 and set(bulk_copies) == {str(op.row_bytes)}
        assert str(op.bulk_rows * op.row_bytes) in producer  # the bytes expected
    assert len(bulk_copies) == len(re.findall(r"cp\.async\.bulk\.", partial))  # the consumers copy no cache rows
    assert "mbarrier.arrive.expect_tx.shared::cta.b64" in producer and "cp.async.ca" not in producer
    lsu = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16(, %r\d+)?;", producer)
    assert all(lsu), lsu  # every one with its zero-fill operand
    per_row = (op.row_bytes // 16 + 31) // 32
    per_block = (rest + 2) // 3 * per_row
    assert (len(lsu) > 0 and len(lsu) % per_block == 0) if rest else not lsu, (len(lsu), per_block)
    noinc = "cp.async.mbarrier.arrive.noinc.shared::cta.b64"
    assert (noinc in producer) == bool(rest) and partial.count("cp.async.mbarrier") == producer.count(noinc)
    if rest:  # the arrival after the copies; a stage's release waited for before them (once reused)
        first, last = producer.index("cp.async.cg"), producer.rindex("cp.async.cg")
        assert producer.find(noinc, last) > last
        # every thread arrives once a block, rows or none: from the cp.async warps' entry (the
        # first branch after setmaxnreg.dec parts them from the bulk warp), no branch jumps
        # past a block's arrival (a skipped arrival hangs the consumers)
        labels = {found.group(1): found.start() for found in re.finditer(r"^(\$L__\w+):", producer, re.M)}
        parting = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", producer)
        start = labels[parting.group(1)] if labels[parting.group(1)] < first else parting.end()
        for arrive in (found.start() for found in re.finditer(re.escape(noinc), producer)):
            targets = re.findall(r"bra(?:\.uni)?\s+(\$L__\w+);", producer[start:arrive])
            assert all(labels.get(target, len(producer)) < arrive for target in targets), targets
            start = arrive
        if slots // op.block >= op.stages:  # (after the bulk warp's code)
            assert producer.rfind("mbarrier.try_wait", 0, first) > producer.rfind("expect_tx", 0, first)
    assert "fence.proxy.async.shared::cta" in partial and "mbarrier.try_wait.parity" in partial
    barriers = re.findall(r"bar(?:rier)?\.sync(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?;", partial)
    assert barriers.count(("0", "")) == 1 and set(barriers) == {("0", ""), ("1", "256")}, barriers
    assert partial.index("bar.sync \t0;") < partial.index("griddepcontrol.wait;") < partial.index("mbarrier.try_wait")
    assert ".local" not in partial
    assert ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in partial) == fp8
    assert ("cvt.rn.f16x2.e4m3x2" in partial) == fp8 and ("cvt.rn.f16x2.f32" in partial) == fp8


@pytest.mark.parametrize("slots", [16, 64, 1024, 2048])
@pytest.mark.parametrize("shape_name", ["tp8-fp8", "kimi-dcp2-fp8"])
def test_sparse_core_mma_producer_path_over_fp8_has_f16_operands_and_their_range_guards(tmp_path, shape_name, slots):
    """partial_mma_ws's fp8 consumers: per block and scoring warp, 32 latent k steps of f16
    MMAs per 8-slot tile from e4m3 widened by cvt (two per word of four), 4 rope k steps of
    bf16 MMAs, and P @ V's block / 16 k steps x 8 n-tiles of f16 MMAs (the compiler may
    peel a block); no local memory. The range guards (consume_ring): bf16 query rows' latent
    x a power of two (P.pow2_fit to 2^15: sub 269, once per row of the warp's two, before
    the loop), none for e4m3 query rows; P x scale x a power of two per row from the row's
    largest P x scale so far (P.pow2_ceil to 2^14: cvt.rpi, sub 268) twice per block (the
    thread's two rows), after the first named barrier (the warps' bounds beside the row
    maxima) and before P is packed to f16."""
    shape = MMA_SHAPES[shape_name]
    op, partial, found = _compile_sparse_core(tmp_path, shape, slots, True)
    assert op.mma_ws and found["frame"] == 0 and ".local" not in partial
    per = max(1, op.block // 8 // sparse_core.COLS)  # 8-slot tiles per scoring warp
    f16 = partial.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    bf16 = partial.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    per_block = per * 32 + op.block // 16 * 8
    assert f16 >= per_block and f16 % per_block == 0, f16
    assert bf16 == f16 // per_block * per * 4, bf16  # the rope's k steps
    assert partial.count("cvt.rn.f16x2.e4m3x2") >= 2 * f16  # two per MMA's B fragment (+ e4m3 query rows)
    q_fit, p_fit = partial.count("sub.s32 d, 269, e;"), partial.count("sub.s32 d, 268, e;")
    assert q_fit == (0 if shape.topology.q_format == "fp8" else 2) and p_fit == 2 * (f16 // per_block), (q_fit, p_fit)
    assert partial.count("cvt.rpi.f32.f32") == p_fit
    dec = partial.index(f"setmaxnreg.dec.sync.aligned.u32 \t{sparse_core_mma.MMA_PRODUCER_REGS};")
    inc = partial.index(f"setmaxnreg.inc.sync.aligned.u32 \t{sparse_core_mma.MMA_CONSUMER_REGS};")
    consumers = partial[inc:] if dec < inc else partial[inc:dec]
    loop = consumers.index("mbarrier.try_wait")  # the first block's full wait
    named = [m.start() for m in re.finditer(r"bar\.sync \t1, 256;", consumers)]
    fit = consumers.index("sub.s32 d, 268, e;")
    assert all(m.start() < loop for m in re.finditer("sub.s32 d, 269, e;", consumers))
    assert loop < fit and any(a < fit < b for a, b in zip(named, named[1:]))
    after = next(b for b in named if b > fit)  # P is packed before the barrier that hands it on
    assert "cvt.rn.f16x2.f32" in consumers[fit:after]


@pytest.mark.parametrize("slots", [32, 1024])
@pytest.mark.parametrize("shape_name", ["tp8", "tp8-fp8", "kimi-dcp2-fp8", "tp8-dcp2", "tp8-dcp2-fp8"])
def test_sparse_core_mma_path_without_a_producer(tmp_path, shape_name, slots):
    """partial_mma_sync (16- and 32-row CTAs but partial_mma_ws's; bench_sparse_core.py
    --paths msync): every thread copies its rows into a ring of ring_stages blocks
    (cp.async.wait_group stages - 1), CTA barriers per block, no mbarriers, no spills; fp8
    rows dequantized into bf16 rows in shared memory."""
    shape = MMA_SHAPES[shape_name]
    op, partial, found = _compile_sparse_core(tmp_path, shape, slots, False)
    heads = sparse_core.heads_per_cta(shape.q_heads)
    fp8 = shape.topology.mla_cache == "fp8"
    assert not op.mma_ws and not op.producer and op.threads == heads // 16 * 256 and found["frame"] == 0
    stages = sparse_core.ring_stages(heads, sparse_core.block_for(slots), slots, fp8)
    assert f"cp.async.wait_group {stages - 1}" in partial and "mbarrier" not in partial
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" not in partial
    assert ("cvt.rn.f16x2.e4m3x2" in partial) == fp8
    # per block and warp: 36 k steps of scores per 8-slot tile, P @ V over 16-slot steps x n-tiles
    block, cols = sparse_core.block_for(slots), sparse_core.COLS
    per_block = max(1, block // 8 // cols) * 36 + (block // 16) * (512 // cols // 8)
    bf16 = partial.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    assert bf16 >= per_block and bf16 % per_block == 0, bf16  # (the compiler may peel a block)


@pytest.mark.parametrize("split", top_k.SPLITS, ids=lambda split: split.name)
def test_cluster_top_k_exchanges_histograms_by_one_way_pushes(ptx, split):
    for shape in SHAPES:
        text = ptx[(shape, f"top_k_{split.name}")]
        (entry,) = _entries(text)
        # the CTA's own histogram in shared memory; ballots and scans rank the kept scores
        assert "atom.shared.add" in entry and "bar.sync" in entry
        assert "vote.sync.ballot.b32" in entry and "shfl.sync.up.b32" in entry
        # each round's exchange is two one-way hops: 16-byte st.async pushes (the CTA's group
        # sums, then its bins of the chosen group) into every CTA, each completing its own
        # mbarrier there (2 a round, single use, set up before the start barrier), waited on
        # with cluster-scope acquire: no remote loads, no remote atomics
        assert "mapa.shared::cluster.u32" in entry and "%cluster_ctarank" in entry
        push = "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32"
        rounds = len(top_k.ROUNDS)
        # a site a round for hop 1 (lane d of each warp to CTA d), and for hop 2 one per 4
        # CTAs (lane l to CTA l / 8 + 4 p: 8 lanes a CTA)
        assert entry.count(push) == rounds * (1 + -(-8 * split.ctas // 32))
        assert entry.count("mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64") == 2 * 2 * rounds  # bounded
        assert entry.count("mbarrier.init.shared::cta.b64") == 2 * rounds
        # warp 0 alone chooses the group and hands it to the other warps by its arrival on hop 2's
        assert entry.count("mbarrier.arrive.shared::cta.b64") == rounds
        # each hop's mbarrier expects the bytes its pushes carry
        op = top_k.ClusterTopK(split=split)
        expected = sorted(op.hop_bytes(r, hop) for r in range(rounds) for hop in (0, 1))
        assert sorted(map(int, re.findall(r"expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);", entry))) == expected
        assert "ld.shared::cluster" not in entry and "st.shared::cluster" not in entry
        assert "red.shared::cluster" not in entry and "atom.shared::cluster" not in entry
        # the lower CTAs' counts (the compaction's offsets): a warp reduction a hop
        assert entry.count("redux.sync.add.s32") == 2 * rounds
        # the kernel's only cluster barrier: arrived after zeroing the histograms and setting
        # up the mbarriers (no global reads: before the PDL wait), waited on after the slice's
        # loads, before the first histogram atomics and so before any push
        entries = top_k.list_entries(split)
        compactions = 2 if 0 < entries < 128 * split.loads else 1
        assert entry.count("barrier.cluster.arrive.aligned;") == 1 and entry.count("barrier.cluster.wait;") == 1
        wait = entry.index("griddepcontrol.wait;")
        arrive = entry.index("barrier.cluster.arrive.aligned;")
        assert entry.index("st.shared.v4.b32") < arrive and entry.index("fence.mbarrier_init.release.cluster") < arrive
        assert arrive < wait < entry.index("barrier.cluster.wait;") < entry.index("atom.shared.add")
        assert entry.index("barrier.cluster.wait;") < entry.index(push)
        # the slice is read once: 16-byte loads predicated by the row's length into
        # registers, and (the stashed loads) 16-byte cp.async copies into shared memory,
        # waited on before the first cluster barrier's wait and read back with 16-byte loads;
        # where the list can overflow, the 4 passes after it read the held loads again
        # (rounds 1 and 2, the compaction's counts and writes)
        assert entry.count("@p ld.global.v4.b32") == split.held * (5 if compactions == 2 else 1)
        # the candidate list: 8-byte entries (key, offset)
        assert ("st.shared.v2.b32" in entry) == (entries > 0)
        assert entry.count("cp.async.cg.shared.global") == split.stashed
        if split.stashed:
            assert entry.index("cp.async.wait_group 0;") < entry.index("barrier.cluster.wait;")
            assert "ld.shared.v4.b32" in entry
    # DCP: positions and scores; a single rank: cache slots through the block table
    name = f"top_k_{split.name}"
    assert ptx[("kimi-dcp2-fp8", name)].count("st.global.b32") > ptx[("tp8", name)].count("st.global.b32")


@pytest.mark.parametrize("split", top_k.SPLITS, ids=lambda split: split.name)
def test_cluster_top_k_pushes_fill_every_slot_once_with_the_expected_bytes(split):
    """A model of the two hops' pushes as push_group_sums and push_group_bins address them
    (thread tid, lane, pass p): every CTA receives each word of every source's slot exactly
    once, 16-byte aligned, inside its own round's and hop's part of the inbox (the parts
    disjoint), and as many bytes as its mbarrier for the hop expects (hop_bytes)."""
    ctas, threads = split.ctas, split.threads
    offsets, words = top_k.inbox(ctas)
    op = top_k.ClusterTopK(split=split)
    parts = []
    for r, (_, bins) in enumerate(top_k.HISTS):
        groups, quads = bins // top_k.GROUP, bins // 4
        hop1, hop2 = offsets[r]
        sent = [[], []]  # (destination, first word) of each 16-byte push, per hop
        for source in range(ctas):
            for p in range(-(-quads // threads)):
                for tid in range(threads):
                    quad, lane = tid + threads * p, tid % 32
                    if quad - lane < quads and lane < ctas:
                        sent[0].append((lane, hop1 + groups * source + (quad - lane) // 8))
            for lane in range(32):
                for p in range(-(-8 * ctas // 32)):
                    if lane // 8 + 4 * p < ctas:
                        sent[1].append((lane // 8 + 4 * p, hop2 + top_k.GROUP * source + 4 * (lane % 8)))
        for hop, (start, per_source) in enumerate(((hop1, groups), (hop2, top_k.GROUP))):
            part = set(range(start, start + ctas * per_source))
            parts.append(part)
            for cta in range(ctas):
                landed = [w + i for d, w in sent[hop] if d == cta for i in range(4)]
                assert all(w % 4 == 0 for d, w in sent[hop] if d == cta)
                assert sorted(landed) == sorted(part), (r, hop, cta)  # each word once, nothing outside
                assert 4 * len(landed) == op.hop_bytes(r, hop)
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == words


def _elf_sections(cubin: bytes) -> list[tuple[str, int, int, int, int, int]]:
    """(name, type, offset, size, link, entry size) of each section of an ELF64 cubin."""
    assert cubin[:4] == b"\x7fELF"
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    return [
        (cubin[names + name : cubin.index(b"\0", names + name)].decode(), kind, offset, size, link, entsize)
        for name, kind, _, _, offset, size, link, _, _, entsize in headers
    ]


def _cubin_kernels(cubin: bytes) -> dict:
    """{kernel symbol name: {"regs": REGCOUNT, "frame": FRAME_SIZE (local memory per thread:
    spills)}} of a cubin, from its ELF .nv.info attributes (EIATTR 0x2f and 0x11: [symbol
    index, value] words) and its symbol table."""
    sections = _elf_sections(cubin)
    symbols = {}
    for _, kind, offset, size, link, entsize in sections:
        if kind == 2:  # SHT_SYMTAB: Elf64_Sym entries, names in the linked string table
            strings = sections[link][2]
            for i in range(size // entsize):
                (name,) = struct.unpack_from("<I", cubin, offset + i * entsize)
                end = cubin.index(b"\0", strings + name)
                symbols[i] = cubin[strings + name : end].decode()
    found = {}
    for name, _, offset, size, *_ in sections:
        if not name.startswith(".nv.info"):
            continue
        i = 0
        while i + 4 <= size:
            fmt, attribute, value = (
                cubin[offset + i],
                cubin[offset + i + 1],
                struct.unpack_from("<H", cubin, offset + i + 2)[0],
            )
            if fmt == 4:  # a sized value
                if attribute in (0x2F, 0x11):
                    symbol, number = struct.unpack_from("<II", cubin, offset + i + 4)
                    found.setdefault(symbols.get(symbol, symbol), {})["regs" if attribute == 0x2F else "frame"] = number
                i += 4 + value
            else:
                i += 4
    return found


def _coop_group_offsets(cubin: bytes) -> dict[str, set[int]]:
    """{kernel symbol name: the .text offsets its .nv.info lists as EIATTR_COOP_GROUP_INSTR_OFFSETS
    (0x28)}: the instructions ptxas marks as executed by a member mask (shuffles, votes, and
    the non-aligned barriers: `barrier.sync`, not `bar.sync`). The SASS of both barrier forms
    is the same; this list is what tells them apart, and compute-sanitizer's synccheck reads
    it (session 28, bench/probe_role_barrier.cu)."""
    found = {}
    for name, _, offset, size, *_ in _elf_sections(cubin):
        if not name.startswith(".nv.info."):
            continue
        offsets, i = found.setdefault(name[len(".nv.info.") :], set()), 0
        while i + 4 <= size:
            fmt, attribute = cubin[offset + i], cubin[offset + i + 1]
            (value,) = struct.unpack_from("<H", cubin, offset + i + 2)
            if fmt == 4:  # a sized value
                if attribute == 0x28:
                    offsets.update(struct.unpack_from(f"<{value // 4}I", cubin, offset + i + 4))
                i += 4 + value
            else:
                i += 4
    return found


def _named_barriers(listing: str) -> dict[str, set[int]]:
    """{kernel symbol name: offsets of its BAR.SYNC on barriers 1-15} in an nvdisasm listing
    (barrier 0 is the CTA's `bar.sync 0`, aligned by design; an arrive, BAR.ARV, waits for no
    one, and ptxas leaves even `barrier.arrive` out of the list)."""
    found, kernel = {}, None
    for line in listing.splitlines():
        header = re.match(r"^\.text\.(\S+):", line)
        if header:
            kernel = header.group(1)
            found.setdefault(kernel, set())
            continue
        bar = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\d\s+)?BAR\.SYNC\S*\s+0x([0-9a-f]+)\b", line)
        if bar and kernel and int(bar.group(2), 16) != 0:
            found[kernel].add(int(bar.group(1), 16))
    return found


def _check_named_barriers_marked(path: Path, kernel_part: str, expect: int):
    """Every named-barrier wait (BAR.SYNC) of the cubin's kernel whose name holds `kernel_part` is in
    its list of member-mask instructions (test_non_aligned_named_barriers_are_marked_in_the_cubin),
    at least `expect` of them. Needs nvdisasm (the dev extra's); without it, a warning says nothing
    was checked."""
    try:
        disassembler = catalog.nvdisasm()
    except FileNotFoundError:
        warnings.warn("no nvdisasm here: named barriers' marks not checked (the dev extra has one)", stacklevel=2)
        return
    listing = subprocess.run([disassembler, "-c", str(path)], check=True, capture_output=True, text=True).stdout
    marked = _coop_group_offsets(path.read_bytes())
    ((kernel, bars),) = [(k, v) for k, v in _named_barriers(listing).items() if kernel_part in k]
    assert len(bars) >= expect and bars <= marked[kernel], (sorted(bars), sorted(marked[kernel]))


def _cubin_attributes(cubin: bytes) -> dict:
    """REGCOUNT and FRAME_SIZE of a one-kernel cubin (the most over its functions)."""
    found = _cubin_kernels(cubin).values()
    return {key: max(f.get(key, 0) for f in found) for key in ("regs", "frame")}


@pytest.mark.parametrize("split", top_k.SPLITS, ids=lambda split: split.name)
def test_cluster_top_k_fits_its_registers_without_spills(tmp_path, split):
    """A thread must fit 64 registers (one 1024-thread CTA or two 512-thread CTAs per SM, as
    PICKS assumes); the scores a split holds in registers (all but its stashed loads) stay
    there (ptxas spills show only in the cubin, not in the PTX)."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    for dcp, rank in ((1, 0), (2, 1)):
        folder = tmp_path / f"dcp{dcp}"
        folder.mkdir()
        op = top_k.ClusterTopK(2048, dcp, rank, split)
        cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), DumpDir(str(folder))](
            op, *top_k.compile_args(), make_fake_stream()
        )
        (cubin,) = [p for p in Path(folder).iterdir() if p.suffix == ".cubin"]
        found = _cubin_attributes(cubin.read_bytes())
        assert found["frame"] <= SWEEP_ONLY_SPILLS.get(split.name, 0), (split.name, dcp, found)
        assert found["regs"] <= 64, (split.name, dcp, found)


# DcpMerge's stack frame (ptxas spills) by dcp: every candidate, position and page is held
# for the whole kernel, and from dcp 16 (8 vectors a thread) that passes 64 registers --
# correct, slower, not measured (levers.md Part V: hold positions and pages only for the own
# rank's vectors).
DCP_MERGE_FRAME = {2: 0, 3: 0, 8: 0, 16: 96}


@pytest.mark.parametrize("dcp, vectors", [(2, 1), (3, 2), (8, 4), (16, 8)])
def test_dcp_merge_holds_every_candidate_in_registers(tmp_path, dcp, vectors):
    """DcpMerge's 1024 threads hold ceil(dcp x k / 4096) 16-byte vectors of candidates each
    (with dcp 3 some lanes hold none) within 64 registers, without a stack up to dcp 8; its
    radix rounds read them as one chunk (find_threshold steps by the op's chunk: at TopK's 16K
    a dcp 16 merge would count the same registers twice)."""
    import inspect

    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream
    from graphstep.kernels import dcp_merge

    op = dcp_merge.DcpMerge(2048, dcp, dcp - 1)
    assert op.vectors == vectors and op.chunk >= dcp * 2048
    assert "range(0, count, self.chunk)" in inspect.getsource(top_k.RadixSelect.find_threshold)
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), DumpDir(str(tmp_path))](
        op, *dcp_merge.compile_args(), make_fake_stream()
    )
    (cubin,) = [p for p in Path(tmp_path).iterdir() if p.suffix == ".cubin"]
    found = _cubin_attributes(cubin.read_bytes())
    assert found["frame"] <= DCP_MERGE_FRAME[dcp] and found["regs"] <= 64, (dcp, found)
    with pytest.raises(ValueError, match="multiple of 4"):
        dcp_merge.DcpMerge(2046, dcp, 0)
    with pytest.raises(ValueError, match="dcp >= 2"):
        dcp_merge.DcpMerge(2048, 1, 0)


# Splits only the TopK sweep runs (no PICKS entry), where ptxas spills a few bytes since the
# mbarrier waits are bounded (primitives.mbar_wait: one more register at each wait).
SWEEP_ONLY_SPILLS = {"c16x1024x8": 16, "c4x1024x32": 8}


def test_the_splits_that_spill_are_never_picked():
    picked = {split.name for _, rows in top_k.PICKS for _, split in rows}
    assert picked and not picked & set(SWEEP_ONLY_SPILLS)


# Every kernel that addresses memory with an id from the inputs records an out-of-range one
# (kernels/guards.py), after its PDL wait; QueryNorm and QueryWait take no such id.
GUARDED = ("mla_query", "index_key", "key_and_norm", "index_query", "dsa_index", "top_k", "dcp_merge", "sparse_core")


def test_guarded_kernels_record_by_atomic_min_after_the_wait(ptx):
    for (shape, name), text in ptx.items():
        guarded = name.startswith(GUARDED) and not (name.startswith("top_k") and shape == "kimi-dcp2-fp8")
        assert ("red.global.min.s64" in text) == guarded, (shape, name)
        for entry in _entries(text):
            if "red.global.min.s64" in entry:
                assert entry.index("griddepcontrol.wait;") < entry.index("red.global.min.s64"), (shape, name)
        if guarded:  # the range test: one unsigned compare per id
            assert "setp.lt.u32" in text or "setp.ge.u32" in text, (shape, name)
    # under DCP TopK writes positions, not slots: no page is read, nothing to guard
    assert "red.global.min.s64" not in ptx[("kimi-dcp2-fp8", "top_k")]


TP1 = {
    "tp1-bf16": RankShape(preset("deepseek-v3.2"), Topology(tp=1)),
    "tp1-fp8": RankShape(preset("deepseek-v3.2"), Topology(tp=1, q_format="fp8", mla_cache="fp8")),
}


@pytest.mark.parametrize("path", ["wsh", "wsr", "wsx"])
@pytest.mark.parametrize("shape_name", TP1)
@pytest.mark.parametrize("slots", [16, 32, 64, 128, 512, 2048])
def test_sparse_core_64_row_ctas_use_wgmma_without_spills(tmp_path, monkeypatch, shape_name, slots, path):
    """64 query rows per CTA (TP 1) on wgmma: no mma.sync, PDL, no local memory. The producer
    warpgroup (384 threads in all): setmaxnreg re-deals the launch's registers, the blocks
    pass by full / empty mbarriers and the loop has no CTA barrier: the one bar.sync 0 is
    before it (the mbarriers' initialization). wsh: the two consumer warpgroups score half a
    block each (36 k steps), then P @ V over the block's slots in 16-slot steps, 256 dims
    each, meeting at one 256-thread named barrier. wsr (FlashMLA's shape): warpgroup 0 scores
    whole blocks (m64n(block)k16) and does P @ V on its dims with P from registers, warpgroup
    1 P @ V from shared memory; P_READY / P_FREE hand P over (bar.arrive one way, bar.sync
    the other); the scorer and the values warpgroup spill nothing, the producer at most a
    few loop scalars (at most 64 B of stack, ptxas's choice at any producer count: the
    RESHAPE_PRODUCER_REGS comment). wsx: wsr with the crossover (either cache at 64-slot
    blocks; elsewhere today's kernel): the same registers, no stack but where the
    launch publishes bf16 query rows in FlashMLA's shape (XOVER_PUBLISH_FRAME), and
    _check_crossover's instructions."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    reshape = path in ("wsr", "wsx")
    monkeypatch.setattr(sparse_core, "RESHAPE_BLOCKS", 1 << 30 if reshape else 0)
    shape = TP1[shape_name]
    crossover = path.startswith("wsx")
    variant = catalog.build(shape, "sparse_core", slots=slots, publish=slots == 2048, crossover=crossover)
    threads = sparse_core.WS_THREADS
    assert variant.op.wgmma and variant.op.producer and variant.op.threads == threads
    assert variant.op.reshape == reshape
    assert variant.op.crossover == (crossover and slots >= 64)
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(tmp_path))](
        variant.op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    entries = _entries(ptx)
    assert len(entries) == (1 if slots == 2048 else 2)
    partial = next(e for e in entries if "sparse_core_partial" in e.split("(")[0])
    block = min(64, slots)
    values = "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"
    if reshape:
        assert partial.count(f"wgmma.mma_async.sync.aligned.m64n{block}k16.f32.bf16.bf16") == 36
        # P @ V: warpgroup 0's with P in registers ({4 words}, then the descriptor), 1's SS
        from_registers = re.findall(values + r" \{[^}]*\}, \{[^}]*\}, b,", partial)
        shared = partial.count(values) - len(from_registers)  # (a loop of two blocks may be unrolled)
        assert from_registers and shared and len(from_registers) % (block // 16) == shared % (block // 16) == 0
    else:
        assert partial.count(f"wgmma.mma_async.sync.aligned.m64n{block // 2}k16.f32.bf16.bf16") == 36
        assert partial.count(values) == block // 16
    assert "mma.sync" not in partial and ".local" not in partial
    assert "griddepcontrol.wait;" in partial and "fence.proxy.async.shared::cta;" in partial
    assert ("cvt.rn.f16x2.e4m3x2" in partial) == (shape_name == "tp1-fp8")
    _check_descriptors(partial)
    (cubin,) = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    kernels = _cubin_kernels(cubin.read_bytes())
    (found,) = [v for k, v in kernels.items() if "sparse_core_partial" in k]
    frame = 64 if reshape else 0
    if variant.op.crossover:
        frame = XOVER_PUBLISH_FRAME if reshape and variant.op.publish and not variant.op.q_fp8 else 0
    assert all(v["frame"] <= frame for v in kernels.values()), kernels
    assert found["regs"] * threads <= 65536, found
    barriers = re.findall(r"bar(?:rier)?\.sync(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?;", partial)
    arrives = re.findall(r"bar(?:rier)?\.arrive(?:\.aligned)?\s+(\d+),\s*(\d+);", partial)
    # the re-dealt registers are what the launch gives the CTA (per 128 threads): the
    # most a 384-thread CTA may have, or the consumers' setmaxnreg.inc would never return
    assert found["regs"] == 168, found
    regs = (
        (sparse_core_wgmma.SCORER_REGS, sparse_core_wgmma.VALUES_REGS, sparse_core_wgmma.RESHAPE_PRODUCER_REGS)
        if reshape
        else (sparse_core_wgmma.CONSUMER_REGS, sparse_core_wgmma.CONSUMER_REGS, sparse_core_wgmma.PRODUCER_REGS)
    )
    assert sum(regs) == 3 * 168 and all(r % 8 == 0 for r in regs)
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{regs[0]};" in partial
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{regs[2]};" in partial
    if reshape:
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{regs[1]};" in partial
    assert ".reqntid 384, 1, 1" in partial and ".minnctapersm 1" in partial
    assert partial.count("mbarrier.init.shared::cta.b64") == 4 and "mbarrier.try_wait.parity" in partial
    assert "mbarrier.arrive.shared::cta.b64" in partial
    assert barriers.count(("0", "")) == 1, barriers  # before the loop only
    # P_FREE only where a CTA has a second block to wait for
    handover = {("2", "256")} | ({("3", "256")} if slots > 64 else set())
    named = {("1", "256")} | (handover if reshape else set())
    assert set(barriers) - {("0", "")} == named, barriers
    assert set(arrives) == (named - {("1", "256")}), arrives
    # the named barriers are non-aligned: the roles reach them at different instructions
    assert not re.search(r"\bbar\.(sync|arrive)\s+[1-3],", partial)
    # and the cubin lists each of them as one (EIATTR 0x28), which synccheck reads
    _check_named_barriers_marked(cubin, "sparse_core_partial", expect=len(named))
    wait = partial.index("mbarrier.try_wait.parity")
    assert partial.index("bar.sync \t0;") < partial.index("griddepcontrol.wait;") < wait
    _check_crossover(partial, variant.op)


# The crossover in FlashMLA's shape, publishing bf16 query rows (one split: B = 64 at TP 1):
# the values warpgroup (160 registers) keeps a few of publish_rows' addresses in local memory
# (its 18 loads a thread of 16 bytes, 4 words and 2 addresses each; ptxas, sm_90a), the fp8
# cache's crossover with bf16 query rows (the step's TP 1 fp8 launch) as much.
XOVER_PUBLISH_FRAME = 40


def _check_descriptors(partial: str):
    """Every wgmma descriptor's start address is the shared address >> 4 masked to its 14-bit
    field before the layout bits (primitives.smem_desc_lines): in a cluster launch (the
    crossover) the address carries the CTA's rank from bit 24 up, which unmasked would land
    in the leading byte offset of rank 1's descriptors."""
    shifts = re.findall(r"shr\.u64 (\w+), (\w+), 4;\s*and\.b64 (\w+), (\w+), (0x[0-9a-f]+);", partial)
    assert shifts and len(shifts) == partial.count("shr.u64"), partial.count("shr.u64")
    for d, s, d2, s2, mask in shifts:
        assert d == s == d2 == s2 and int(mask, 16) == 0x3FFF


def _check_crossover(partial: str, op):
    """The crossover's instructions in partial_wgmma_ws's PTX (none without it): per block
    each producer thread pushes its 18 chunks (st.async v4, 16 bytes each, 128 threads:
    XOVER_BYTES, which thread 0's arrival on full[s] expects); the peer's tile and full[0]
    mapped once (the producer's 2 mapa), each remote arrive with its own; empty[s] counts 16
    warps; every mbarrier wait acquires at cluster scope (each consumer warp its own); remote
    arrives (arrive.release at CTA scope, never the cluster's: no MEMBAR.ALL.GPU) only where a
    CTA has more than two blocks; no bulk copies between the CTAs; one cluster barrier
    arrived on after the mbarriers' initialization and each role's two waits plus one
    closing arrive. The producer (_producer_ptx) issues every push and, over bf16 rows, loads
    each chunk it pushes by one predicated 16-byte ld.global, all of a block's before its
    first push: no cp.async, no e4m3 widened."""
    pushes = re.findall(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.v4\.b32 \[%r\d+\]", partial)
    remote_arrive = "mbarrier.arrive.release.cta.shared::cluster.b64"
    assert "mbarrier.arrive.release.cluster" not in partial
    assert "cp.async.bulk.shared::cluster.shared::cta" not in partial
    if not op.crossover:
        assert not pushes and "mapa" not in partial and "barrier.cluster" not in partial
        assert remote_arrive not in partial and ".acquire.cluster" not in partial
        assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 8;", partial)
        return
    blocks = op.slots_per_cta // op.block
    roles = 2 if op.reshape else 1  # consume_blocks' code once per role
    per_thread = sparse_core_wgmma.TILE_CHUNKS // 4  # 18 chunks of its row (64-slot blocks: step 1)
    assert per_thread * 16 * 128 == sparse_core_wgmma.XOVER_BYTES == 36864
    assert pushes and len(pushes) % per_thread == 0, len(pushes)
    expects = re.findall(r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);", partial)
    assert expects and set(expects) == {str(sparse_core_wgmma.XOVER_BYTES)}, expects
    assert partial.count("mapa.shared::cluster.u32") == 2 + partial.count(remote_arrive)
    assert len(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 16;", partial)) == 2  # empty[s]
    assert len(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 128;", partial)) == 2  # full[s]
    waits = re.findall(r"mbarrier\.try_wait\.parity(\S*)\.shared::cta", partial)
    assert waits and set(waits) == {".acquire.cluster"}, waits
    arrives = partial.count(remote_arrive)  # (a loop as short as no_math's may be unrolled)
    assert (arrives > 0) == (blocks > 2) and arrives % roles == 0, arrives
    assert partial.count("barrier.cluster.arrive.aligned;") == 1 + 1 + roles
    assert partial.count("barrier.cluster.wait;") == 2 * (1 + roles)
    # the first arrive after the mbarriers' initialization, before the PDL wait
    assert partial.index("fence.mbarrier_init.release.cluster;") < partial.index("barrier.cluster.arrive")
    assert partial.index("barrier.cluster.arrive") < partial.index("griddepcontrol.wait;")
    # each push lands on the peer's full barrier: the producer's mapped base, not a local address
    assert partial.index("mapa.shared::cluster.u32") < partial.index("st.async")
    producer = _producer_ptx(partial, op)
    assert producer.count("st.async") == len(pushes)
    assert ("cvt.rn.f16x2.e4m3x2" in producer) == op.mla_fp8 and "cp.async" not in producer
    if not op.mla_fp8:
        loads = [m.start() for m in re.finditer(r"@p ld\.global\.v4\.b32", producer)]
        assert len(loads) == len(pushes), (len(loads), len(pushes))
        assert loads[per_thread - 1] < producer.index("st.async")


def _producer_ptx(partial: str, op) -> str:
    """partial_wgmma_ws's producer warpgroup's PTX: from its setmaxnreg.dec to the next
    setmaxnreg or the end of the kernel (the roles' code is laid out in source order)."""
    regs = sparse_core_wgmma.RESHAPE_PRODUCER_REGS if op.reshape else sparse_core_wgmma.PRODUCER_REGS
    start = partial.index(f"setmaxnreg.dec.sync.aligned.u32 \t{regs};")
    end = partial.find("setmaxnreg", start + 1)
    return partial[start : end if end > 0 else len(partial)]


@pytest.mark.parametrize("probe", ["no_loads", "no_math"])
@pytest.mark.parametrize("shape_name", TP1)
def test_the_crossover_keeps_its_probes(tmp_path, monkeypatch, shape_name, probe):
    """The producer probes on the crossover (bench_sparse_core.py --probe-paths wsx), over
    either cache: 168 registers, no stack; no_loads still stores (fp8: dequantizes) and
    pushes zeros so full[s] sees the same bytes, no_math issues no MMAs but waits for and
    releases every block to both CTAs."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    monkeypatch.setattr(sparse_core, "PROBE", probe)
    variant = catalog.build(TP1[shape_name], "sparse_core", slots=2048, publish=False, producer=True, crossover=True)
    assert variant.op.crossover and variant.op.probe == probe
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(tmp_path))](
        variant.op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    (cubin,) = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    (found,) = [v for k, v in _cubin_kernels(cubin.read_bytes()).items() if "sparse_core_partial" in k]
    assert found == {"regs": 168, "frame": 0}, found
    (partial,) = [e for e in _entries(ptx) if "sparse_core_partial" in e.split("(")[0]]
    assert ("wgmma.mma_async" in partial) == (probe != "no_math")
    _check_crossover(partial, variant.op)


@pytest.mark.parametrize("form", sparse_core.FP8_ROW_LOAD_FORMS)
def test_the_no_dequant_probe_drops_only_the_producers_conversions(tmp_path, monkeypatch, form):
    """bench_sparse_core.py --probes no_dequant (the crossover over the fp8 cache): the producer
    stores its 16 latent chunks a block raw (FP8_ROW_LOADS "16B": 8 pairs), so exactly their 64
    e4m3 conversions go (the query rows' stay), at the same 168 registers; no stack by default,
    at most 24 bytes under the probe (ptxas keeps some of the prefetching producer's raw words in
    local memory: the probe's time is an upper bound); elsewhere the probe is refused."""
    monkeypatch.setattr(sparse_core, "FP8_ROW_LOADS", dict.fromkeys(sparse_core.FP8_ROW_LOADS, form))
    counts = {}
    for probe in ("", "no_dequant"):
        monkeypatch.setattr(sparse_core, "PROBE", probe)
        variant = catalog.build(TP1["tp1-fp8"], "sparse_core", slots=2048, publish=False, producer=True)
        assert variant.op.crossover and variant.op.probe == probe and variant.op.fp8_row_loads == form
        partial, found = _compile_partial(tmp_path / (probe or "default"), variant)
        assert found["regs"] == 168 and found["frame"] <= (24 if probe else 0), (probe, found)
        counts[probe] = partial.count("cvt.rn.f16x2.e4m3x2")
    assert counts[""] - counts["no_dequant"] == 16 * 4 and counts["no_dequant"] > 0, counts
    monkeypatch.setattr(sparse_core, "PROBE", "no_dequant")
    for shape in (TP1["tp1-bf16"], MMA_SHAPES["tp8-fp8"]):
        with pytest.raises(ValueError, match="no_dequant"):
            catalog.build(shape, "sparse_core", slots=2048, publish=False, producer=True)


@pytest.mark.parametrize("probe", ["trace", "trace+no_push", "trace+cta_full"])
@pytest.mark.parametrize("shape_name", TP1)
def test_the_trace_probe_stamps_each_role_once_a_step(tmp_path, monkeypatch, shape_name, probe):
    """bench_sparse_core.py --trace (the crossover at one split): eleven %clock reads or more, each
    stored by one thread (kernel entry; the scorer's four steps, the values warpgroup's three and the
    producer's three a block), at the same 168 registers and no stack; refused where partial_o
    holds partials (several splits) or the path has no roles (TP 8). With no_push joined: no
    st.async into the peer, the full barrier expecting no bytes from it; with cta_full: the
    consumers' full waits at CTA scope (the producer's empty waits still the cluster's)."""
    monkeypatch.setattr(sparse_core, "PROBE", probe)
    variant = catalog.build(TP1[shape_name], "sparse_core", slots=2048, publish=False, producer=True)
    assert variant.op.crossover and variant.op.reshape and variant.op.probe == probe
    partial, found = _compile_partial(tmp_path, variant)
    # (without the pushes ptxas allocates the fp8 producer otherwise: up to 40 bytes of stack there
    # with its prefetch, XOVER_PREFETCH; the probe's times are then upper bounds)
    assert found["regs"] == 168 and found["frame"] <= (40 if "no_push" in probe else 0), found
    # (LLVM may peel a loop's first or last block and copy its stamps: at least one read a step)
    assert len(re.findall(r"mov\.u32\s+%r\d+, %clock;", partial)) >= 11
    assert ("st.async" in partial) == ("no_push" not in probe)
    assert ("arrive.expect_tx" in partial) == ("no_push" not in probe)
    waits = re.findall(r"mbarrier\.try_wait\.parity(\S*)\.shared::cta", partial)
    assert set(waits) == ({"", ".acquire.cluster"} if "cta_full" in probe else {".acquire.cluster"}), waits
    for shape, slots in ((TP1[shape_name], 512), (MMA_SHAPES["tp8-fp8"], 2048)):
        with pytest.raises(ValueError, match="trace"):
            catalog.build(shape, "sparse_core", slots=slots, publish=False, producer=True)
    monkeypatch.setattr(sparse_core, "PROBE", "no_push")
    assert catalog.build(TP1[shape_name], "sparse_core", slots=512, publish=False, producer=True).op.crossover
    with pytest.raises(ValueError, match="no_push"):
        catalog.build(TP1[shape_name], "sparse_core", slots=512, publish=False, producer=True, crossover=False)


@pytest.mark.parametrize("slots", [128, 2048])
@pytest.mark.parametrize("shape_name", TP1)
def test_the_values_warpgroup_takes_p_from_registers_when_asked(tmp_path, monkeypatch, shape_name, slots):
    """sparse_core.VALUES_RS (bench_sparse_core.py --paths wsxv): both warpgroups' P @ V are
    wgmma RS (P's words loaded from shared memory by the values warpgroup), none SS, the
    registers re-dealt as sparse_core_wgmma.VALUES_RS_REGS (within the launch's 3 x 168),
    no stack (ptxas spilled the values' P words at 168 and serialized the scorer's wgmmas at
    192)."""
    monkeypatch.setattr(sparse_core, "VALUES_RS", True)
    variant = catalog.build(TP1[shape_name], "sparse_core", slots=slots)
    op = variant.op
    assert op.crossover and op.reshape and op.values_rs
    partial, found = _compile_partial(tmp_path, variant)
    assert found == {"regs": 168, "frame": 0}, found
    regs = sparse_core_wgmma.VALUES_RS_REGS
    assert sum(regs) == 3 * 168 and all(r % 8 == 0 for r in regs)
    assert sum(regs) == 3 * sparse_core_wgmma.LAUNCH_REGS
    # past the launch's count a role must ask with inc (a dec there is an illegal instruction)
    dealt = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32 \t(\d+);", partial)
    assert dealt == [("inc", "200"), ("inc", "176"), ("dec", "128")] and [int(r) for _, r in dealt] == list(regs)
    rs = re.findall(r"m64n256k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", partial)
    # every m64n256 wgmma RS, at least the two warpgroups' k steps a block (LLVM may copy a
    # peeled block's)
    assert partial.count("m64n256k16") == len(rs) >= 2 * (op.block // 16) and len(rs) % (op.block // 16) == 0


@pytest.mark.parametrize("shape_name", TP1)
def test_the_crossover_fp8_producer_loads_a_block_ahead_when_asked(tmp_path, monkeypatch, shape_name):
    """sparse_core.XOVER_PREFETCH (bench_sparse_core.py --paths wsxp): over the fp8 cache the
    producer issues block 0's row loads before its loop (their 19 predicated loads: the
    scales, 16 latent pieces, 2 rope pieces) and each later block's in the loop, one block
    ahead, so its PTX holds the row loads twice and the slot ids' once more; still 168
    registers and no stack. Over bf16 (72 words a block in flight) it is off."""
    rows = r"ld\.global\.v[24]\.(?:b32|f32)"
    found_rows = {}
    for prefetch in (False, True):
        monkeypatch.setattr(sparse_core, "XOVER_PREFETCH", prefetch)
        variant = catalog.build(TP1[shape_name], "sparse_core", slots=2048, publish=False)
        op = variant.op
        assert op.crossover and op.prefetch == (prefetch and op.mla_fp8)
        partial, found = _compile_partial(tmp_path / str(prefetch), variant)
        assert found == {"regs": 168, "frame": 0}, found
        producer = _producer_ptx(partial, op)
        found_rows[prefetch] = (len(re.findall(rows, producer)), len(re.findall(r"ld\.global\.s32 ", producer)))
    (plain, plain_ids), (ahead, ahead_ids) = found_rows[False], found_rows[True]
    if TP1[shape_name].topology.mla_cache == "fp8":
        assert plain == 19 and ahead == 2 * 19 and ahead_ids == plain_ids + 2, found_rows
    else:
        assert found_rows[True] == found_rows[False]


@pytest.mark.parametrize("shape_name", TP1)
def test_the_consumers_skip_unmoved_rescales_when_asked(tmp_path, monkeypatch, shape_name):
    """sparse_core.SKIP_UNMOVED (bench_sparse_core.py --paths wsxs): FlashMLA's consumer shape
    votes (vote.any) in each warp of both warpgroups whether any row's factor is not 1 before
    its 128 rescaling multiplications, which it then branches around; the default has no vote;
    168 registers, no stack either way."""
    votes = {}
    for skip in (False, True):
        monkeypatch.setattr(sparse_core, "SKIP_UNMOVED", skip)
        variant = catalog.build(TP1[shape_name], "sparse_core", slots=2048, publish=False)
        assert variant.op.reshape and variant.op.skip_unmoved == skip
        partial, found = _compile_partial(tmp_path / str(skip), variant)
        assert found == {"regs": 168, "frame": 0}, found
        votes[skip] = len(re.findall(r"vote\.sync\.any\.pred", partial))
    assert votes == {False: 0, True: 2}, votes


TP1_FP8_CACHE = RankShape(preset("deepseek-v3.2"), Topology(tp=1, mla_cache="fp8"))  # bf16 query rows: cp.async
# the wgmma paths whose threads load and dequantize fp8 rows (FP8_ROW_LOADS): (shape, build choices)
FP8_ROW_PATHS = {
    "crossover": (TP1_FP8_CACHE, {"slots": 2048, "publish": False}),
    "producer": (TP1_FP8_CACHE, {"slots": 2048, "publish": False, "producer": True, "crossover": False}),
    "transposed": (
        RankShape(preset("deepseek-v3.2"), Topology(tp=8, mla_cache="fp8")),
        {"slots": 512, "transposed": True},
    ),
}


@pytest.mark.parametrize("form", sparse_core.FP8_ROW_LOAD_FORMS)
@pytest.mark.parametrize("path", FP8_ROW_PATHS)
def test_the_wgmma_paths_load_fp8_rows_as_fp8_row_loads_says(tmp_path, monkeypatch, path, form):
    """sparse_core.FP8_ROW_LOADS: the wgmma paths' threads that dequantize fp8 rows (the crossover's
    producer, partial_wgmma_ws's, the transposed path's two producer warpgroups) load a row share's
    latent by 16 8-byte loads ("8B") or by 8 16-byte loads of two chunks ("16B": FlashMLA's map; no
    L2 prefetch size), beside its scales' and rope's 3 loads: for every scales load (a row share in
    the code: shares a thread, and the prefetch's copy before the loop) 16 + 2 or 10 row loads, 16
    or 0 of 8 bytes; every bf16 chunk still widened from e4m3 (64 conversions a row share);
    registers within the CTA (168 and no stack for the 64-row paths, TRANSPOSED_FRAME for the
    transposed path). The bf16 cache and the mma.sync paths keep their loads."""
    monkeypatch.setattr(sparse_core, "FP8_ROW_LOADS", dict.fromkeys(sparse_core.FP8_ROW_LOADS, form))
    shape, choices = FP8_ROW_PATHS[path]
    variant = catalog.build(shape, "sparse_core", **choices)
    op = variant.op
    assert (op.crossover, op.producer, op.transposed) == {
        "crossover": (True, True, False),
        "producer": (False, True, False),
        "transposed": (False, True, True),
    }[path]
    assert op.fp8_row_loads == form and op.wide_fp8 == (form != "8B")
    bf16 = RankShape(preset("deepseek-v3.2"), Topology(tp=1 if path != "transposed" else 8))
    assert catalog.build(bf16, "sparse_core", **choices).op.fp8_row_loads == "8B"
    mma = catalog.build(shape, "sparse_core", slots=512, transposed=False).op if path == "transposed" else None
    assert mma is None or (not mma.transposed and mma.fp8_row_loads == "8B")
    partial, found = _compile_partial(tmp_path, variant)
    code = _producer_ptx(partial, op) if op.producer and not op.transposed else partial
    wide = len(re.findall(r"ld\.global\.v4\.b32", code))
    narrow = len(re.findall(r"ld\.global\.v2\.b32", code))
    scales = len(re.findall(r"ld\.global\.v4\.f32", code))
    copies = 2  # row shares in the code: two a producer thread, or the prefetch's and the loop's
    assert scales == copies, scales
    assert (wide, narrow) == ((2 * copies, 16 * copies) if form == "8B" else (10 * copies, 0)), (wide, narrow)
    assert "ld.global.L2::" not in code
    assert code.count("cvt.rn.f16x2.e4m3x2") == 64 * (copies // 2 if op.prefetch else copies)
    if op.producer and not op.transposed:
        assert found == {"regs": 168, "frame": 0}, found
    else:
        assert found["regs"] * op.threads <= 65536 and found["frame"] <= TRANSPOSED_FRAME, found


def test_fp8_row_loads_default_to_16_bytes_on_the_transposed_path_only(monkeypatch):
    """sparse_core.FP8_ROW_LOADS by path (session 37, H200): the transposed path's producers take
    "16B" (TP 8 fp8 B = 64 48.6 -> 44.3 us), the 64-row wgmma paths "8B" (TP 1's crossover lost
    2.8% with 16); a path's form follows its own key only, and a form not in
    FP8_ROW_LOAD_FORMS, or a path left out, is refused by name (a key that is no path: --knob's
    check, tests/test_cli.py)."""
    assert sparse_core.FP8_ROW_LOADS == {"transposed": "16B", "wgmma": "8B"}
    for path, form in (("transposed", "16B"), ("crossover", "8B"), ("producer", "8B")):
        shape, choices = FP8_ROW_PATHS[path]
        assert catalog.build(shape, "sparse_core", **choices).op.fp8_row_loads == form, path
    monkeypatch.setattr(sparse_core, "FP8_ROW_LOADS", {"transposed": "8B", "wgmma": "16B"})
    for path, form in (("transposed", "8B"), ("crossover", "16B"), ("producer", "16B")):
        shape, choices = FP8_ROW_PATHS[path]
        assert catalog.build(shape, "sparse_core", **choices).op.fp8_row_loads == form, path
    monkeypatch.setattr(sparse_core, "FP8_ROW_LOADS", {"transposed": "32B", "wgmma": "8B"})
    shape, choices = FP8_ROW_PATHS["crossover"]
    with pytest.raises(ValueError, match=r"FP8_ROW_LOADS\['transposed'\] must be one of"):
        catalog.build(shape, "sparse_core", **choices)
    monkeypatch.setattr(sparse_core, "FP8_ROW_LOADS", {"transposed": "16B"})  # a path left out
    with pytest.raises(ValueError, match=r"FP8_ROW_LOADS\['wgmma'\] must be one of .*got None"):
        catalog.build(shape, "sparse_core", **choices)


TP8_CACHES = {
    "tp8-bf16": RankShape(preset("deepseek-v3.2"), Topology(tp=8)),
    "tp8-fp8": RankShape(preset("deepseek-v3.2"), Topology(tp=8, mla_cache="fp8")),
    "kimi-dcp2-fp8": SHAPES["kimi-dcp2-fp8"],  # e4m3 query rows: 16 x 36 items over 128 threads
}
# partial_transposed_ws's stack: ptxas's spill of a few producer loop scalars within the 168
# registers a thread of the 384 (fp8: two blocks' rows in flight a thread; sm_90a)
TRANSPOSED_FRAME = 32


@pytest.mark.parametrize("most", [0, 1, 8])
@pytest.mark.parametrize("shape_name", TP8_CACHES)
def test_the_transposed_path_runs_where_transposed_blocks_says(monkeypatch, shape_name, most):
    """By default (TRANSPOSED_BLOCKS) 16-row CTAs over the fp8 cache take the transposed path
    at 1 .. 8 64-slot blocks a CTA (TP 8 B = 2 .. 32 by the plan) and partial_mma_ws past it
    (B = 64); over bf16 never; 64-row CTAs and 32-slot blocks never."""
    shape = TP8_CACHES[shape_name]
    fp8 = shape.topology.mla_cache == "fp8"
    assert sparse_core.TRANSPOSED_BLOCKS == {"bf16": 0, "fp8": 8}
    default = [catalog.build(shape, "sparse_core", slots=s).op.transposed for s in (32, 64, 512, 1024, 2048)]
    assert default == [False, fp8, fp8, False, False]
    planned = {b: sparse_core.plan(b, shape.q_heads, 2048, shape.topology.mla_cache) for b in (1, 2, 32, 64)}
    assert [catalog.build(shape, "sparse_core", slots=s).op.transposed for s in planned.values()] == [
        False,
        fp8,
        fp8,
        False,
    ]
    monkeypatch.setattr(sparse_core, "TRANSPOSED_BLOCKS", {"bf16": most, "fp8": most})
    runs = [catalog.build(shape, "sparse_core", slots=s).op.transposed for s in (32, 64, 128, 512, 1024)]
    assert runs == [False, most >= 1, most >= 2, most >= 8, False]
    assert not catalog.build(TP1["tp1-fp8"], "sparse_core", slots=64).op.transposed
    assert not catalog.build(shape, "sparse_core", slots=64, transposed=False).op.transposed


@pytest.mark.parametrize("shape_name", TP8_CACHES)
@pytest.mark.parametrize("slots", [64, 1024, 2048])
def test_the_transposed_path_runs_both_products_at_n16(tmp_path, shape_name, slots):
    """16-row CTAs on partial_transposed_ws (sparse_core_transposed.py): 384 threads, per
    block 36 S^T k steps (m64n16k16, A and B K-major: trans 0, 0) and 8 tiles x 4 O^T k steps
    with A transposed (trans 1, 0), P^T stored as bf16 halves; no mma.sync; full[s] counts
    both producer warpgroups (256), empty[s] the 4 consumer warps; the fp8 producer widens
    e4m3 and loads a block ahead; masked descriptors; registers within the CTA, a small stack
    (TRANSPOSED_FRAME). Below 64-slot blocks the mma.sync paths run as before."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    shape = TP8_CACHES[shape_name]
    variant = catalog.build(shape, "sparse_core", slots=slots, publish=slots == 2048, transposed=True)
    op = variant.op
    assert op.transposed and op.producer and not op.mma_ws and not op.clustered and op.threads == 384
    assert op.prefetch == (shape.topology.mla_cache == "fp8")
    assert variant.name.endswith("_t")
    assert not catalog.build(shape, "sparse_core", slots=32, transposed=True).op.transposed  # 32-slot blocks
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(tmp_path))](
        op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    entries = _entries(ptx)
    assert len(entries) == (1 if slots == 2048 else 2)
    partial = next(e for e in entries if "sparse_core_partial" in e.split("(")[0])
    n16 = r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.bf16\.bf16 \{[^}]*\}, a, b, (\w+), 1, 1, (\d), (\d);"
    found = re.findall(n16, partial)
    scores = [f for f in found if f[1:] == ("0", "0")]
    values = [f for f in found if f[1:] == ("1", "0")]
    assert len(scores) == 36 and len(values) == 8 * 4 and len(found) == 68, len(found)
    assert scores[0][0] == "first" and {f[0] for f in scores[1:] + values} == {"more"}
    assert partial.count("st.shared.b16") == 8 and partial.count("cvt.rn.bf16.f32") == 8
    assert "mma.sync" not in partial and ".local" not in partial
    assert "griddepcontrol.wait;" in partial and "fence.proxy.async.shared::cta;" in partial
    assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 256;", partial)
    assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 4;", partial)
    assert "barrier.cluster" not in partial and "st.async" not in partial and "mapa" not in partial
    assert ("cvt.rn.f16x2.e4m3x2" in partial) == (shape.topology.mla_cache == "fp8" or shape.topology.q_format == "fp8")
    _check_descriptors(partial)
    (cubin,) = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    kernels = _cubin_kernels(cubin.read_bytes())
    (regs,) = [v for k, v in kernels.items() if "sparse_core_partial" in k]
    assert regs["regs"] * op.threads <= 65536 and regs["frame"] <= TRANSPOSED_FRAME, kernels


def test_sparse_core_64_row_ctas_default_to_the_producer_path():
    """The plan's 64-row variants take the producer path (partial_wgmma_ws, the only one), its
    consumers in FlashMLA's
    shape where a CTA has at most RESHAPE_BLOCKS blocks (measured faster at 1-2 blocks, slower
    at 8 and 32: B = 1 and bf16's B = 4, not fp8's B = 4 at half a wave's 4 blocks) -- under
    the fp8 cache's crossover (a head-group pair) at every block count (measured faster at
    every B, session 18); 16-row CTAs
    take partial_mma_ws from MMA_PRODUCER_BLOCKS[cache] blocks per CTA, else (and 32-row
    CTAs) partial_mma_sync."""
    assert sparse_core.RESHAPE_BLOCKS == 2  # as measured (bench/RESULTS.md, 2026-12-03)
    for shape in TP1.values():
        op = catalog.build(shape, "sparse_core", slots=2048).op
        assert op.producer and op.reshape and op.crossover
        assert op.threads == sparse_core.WS_THREADS
        fp8 = shape.topology.mla_cache == "fp8"
        for batch in (1, 4, 16, 64):
            slots = sparse_core.plan(batch, shape.q_heads, shape.model.index_topk, shape.topology.mla_cache)
            # half a wave at fp8 B = 4 (PLAN_HALF_WAVE_TOKENS, measured)
            assert slots == {1: 64, 4: 256 if fp8 else 128, 16: 512, 64: 2048}[batch]
            op = catalog.build(shape, "sparse_core", slots=slots, producer=True, crossover=False).op
            assert op.reshape == {1: True, 4: not fp8, 16: False, 64: False}[batch] and not op.crossover
            op = catalog.build(shape, "sparse_core", slots=slots, producer=True).op
            assert op.reshape and op.crossover
    # 16 rows: partial_mma_ws over the bf16 cache always, as measured (bench/RESULTS.md,
    # session 10), over fp8 from 8 blocks per CTA (TP 8 B >= 32), as predicted for its f16
    # operands; 32 rows: partial_mma_sync
    assert sparse_core.MMA_PRODUCER_BLOCKS == {"bf16": 1, "fp8": 8}
    # its rows bulk-copied / by cp.async as the two paths' rates alone balance (predicted)
    assert sparse_core.MMA_BULK_SIXTEENTHS == {"bf16": 10, "fp8": 9}
    for name, shape in MMA_SHAPES.items():
        rows16 = sparse_core.heads_per_cta(shape.q_heads) == 16
        fp8 = shape.topology.mla_cache == "fp8"
        for batch in (1, 4, 16, 32, 64):
            slots = sparse_core.plan(batch, shape.q_heads, shape.model.index_topk, shape.topology.mla_cache)
            op = catalog.build(shape, "sparse_core", slots=slots).op
            blocks = slots // sparse_core.block_for(slots)
            transposed = rows16 and fp8 and slots >= 64 and blocks <= 8  # (TRANSPOSED_BLOCKS)
            mws = rows16 and not transposed and (not fp8 or blocks >= 8)
            assert not op.wgmma and not op.reshape and op.mma_ws == mws and op.transposed == transposed, (name, batch)
            assert op.producer == (mws or transposed)
        if rows16:
            assert catalog.build(shape, "sparse_core", slots=64, producer=True).op.mma_ws
        else:
            with pytest.raises(ValueError, match="16 rows per CTA"):
                catalog.build(shape, "sparse_core", slots=64, producer=True)


@pytest.mark.parametrize(
    ("shape_name", "bulk"),
    [("tp1-fp8", None), ("tp8", None), ("tp8-fp8", None), ("tp8", 0), ("tp8", 16), ("tp8-fp8", 0), ("tp8-fp8", 16)],
)
@pytest.mark.parametrize("probe", ["no_loads", "no_math"])
def test_sparse_core_producer_probes_keep_the_registers(tmp_path, monkeypatch, probe, shape_name, bulk):
    """The producer paths' device probes (sparse_core.PROBES) keep the 168 registers the
    setmaxnreg re-deal needs, and no more stack than the kernel that runs (the 64-row test
    above; partial_mma_ws none), so they time that kernel: no_loads issues no copies,
    no_math no MMAs; partial_mma_ws's also with every row bulk-copied or none
    (bench_sparse_core.py --probes no_math:16 / no_math:0: one copy path alone)."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    monkeypatch.setattr(sparse_core, "PROBE", probe)
    if bulk is not None:
        monkeypatch.setattr(sparse_core, "MMA_BULK_SIXTEENTHS", {"bf16": bulk, "fp8": bulk})
    shape = TP1[shape_name] if shape_name in TP1 else MMA_SHAPES[shape_name]
    variant = catalog.build(shape, "sparse_core", slots=2048, publish=False, producer=True)
    assert variant.op.probe == probe and variant.op.wgmma == (shape_name == "tp1-fp8")
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(tmp_path))](
        variant.op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    (cubin,) = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    kernels = _cubin_kernels(cubin.read_bytes())
    (found,) = [v for k, v in kernels.items() if "sparse_core_partial" in k]
    assert found["regs"] == 168 and found["frame"] <= (32 if variant.op.wgmma else 0), kernels
    if variant.op.wgmma:
        assert ("wgmma.mma_async" in ptx) == (probe != "no_math")
    else:
        (partial,) = [e for e in _entries(ptx) if "sparse_core_partial" in e.split("(")[0]]
        dec = partial.index(f"setmaxnreg.dec.sync.aligned.u32 \t{sparse_core_mma.MMA_PRODUCER_REGS};")
        inc = partial.index(f"setmaxnreg.inc.sync.aligned.u32 \t{sparse_core_mma.MMA_CONSUMER_REGS};")
        producer = partial[dec:inc] if dec < inc else partial[dec:]
        assert ("mma.sync.aligned" in ptx) == (probe != "no_math")
        assert ("cp.async.bulk.shared" in producer) == (probe != "no_loads" and variant.op.bulk_rows > 0)
        lsu = probe != "no_loads" and variant.op.bulk_rows < variant.op.block
        assert ("cp.async.cg" in producer) == lsu
        assert ("cp.async.mbarrier.arrive.noinc" in producer) == (variant.op.bulk_rows < variant.op.block)


@pytest.fixture(scope="module")
def group_ptx(tmp_path_factory):
    """The variants only a rank of a DCP group exchanging through peer memory launches."""
    shape = SHAPES["kimi-dcp2-fp8"]
    out = {}
    base = {v.name for v in catalog.variants(shape, batches=(1, 64))}
    for variant in catalog.variants(shape, batches=(1, 64), group=True):
        if variant.name in base:
            continue
        folder = tmp_path_factory.mktemp(variant.name)
        catalog.compile_op(variant.op, variant.args, "sm_90a", str(folder))
        out[variant.name] = next(p for p in folder.iterdir() if p.suffix == ".ptx").read_text()
    return out


def test_a_group_rank_adds_remote_mla_query_variants_and_candidate_sync(group_ptx, ptx):
    assert set(group_ptx) == {
        "mla_query_rows_remote",
        "mla_query_tiled_remote",
        "mla_query_rows_poll_remote",
        "mla_query_tiled_poll_remote",
        "candidate_sync",
    }
    for name in ("mla_query_rows", "mla_query_tiled"):
        local = _entries(ptx[("kimi-dcp2-fp8", name)])[2]  # the absorb kernel: the publish
        remote = _entries(group_ptx[f"{name}_remote"])[2]
        # every chunk stored into both ranks' mailboxes, each at a loaded byte offset, after the wait
        assert remote.count("st.global.v4.b32") == 2 * local.count("st.global.v4.b32") > 0, name
        assert remote.count("ld.global.s64") == 2 and "ld.global.s64" not in local, name
        assert remote.index("griddepcontrol.wait") < remote.index("ld.global.s64"), name
        assert [short(n) for n in re.findall(r"\.entry (\w+)\(", group_ptx[f"{name}_remote"])] == [
            f"cute:{stage}" for stage in _stages(name, 2048)
        ]


def test_candidate_sync_releases_after_the_wait_and_spins_bounded_with_acquire(group_ptx):
    text = group_ptx["candidate_sync"]
    assert [short(n) for n in re.findall(r"\.entry (\w+)\(", text)] == ["cute:candidate_sync"]
    wait = text.index("griddepcontrol.wait;")
    assert wait < text.index("st.release.sys.global.s32") < text.index("ld.acquire.sys.global.s32")
    assert "%globaltimer" in text and "red.global.min.s32" in text
    assert text.index("fence.acq_rel.sys;") < text.index("st.release.sys.global.s32")
    # DcpMerge launches only when CandidateSync completes (its CTAs would hold SMs the peers need)
    assert "griddepcontrol.launch_dependents" not in text
    assert ".local" not in text


def test_dcp_merge_reads_each_candidate_once_at_its_ranks_offset(ptx):
    """The ranks' offsets (set up once, never written by a step) are read before the PDL
    wait; after it every candidate is read once, by 16-byte loads, before the first
    histogram (not again in each radix round): this rank's scores and positions and the
    peers' scores, one vector each a thread at dcp 2."""
    text = ptx[("kimi-dcp2-fp8", "dcp_merge")]
    wait = text.index("griddepcontrol.wait")
    assert text.count("ld.global.nc.s64") == 2 and text.rindex("ld.global.nc.s64") < wait
    vectors = [m.start() for m in re.finditer(r"ld\.global\.v4\.b32", text)]
    assert len(vectors) == 3 and wait < vectors[0] and vectors[-1] < text.index("atom.shared.add")


def _timer_reads(ptx: str) -> list[str]:
    """The trace probes' reads of the whole 64-bit timer (the bounded mbarrier waits read only
    its high word, %globaltimer_hi)."""
    return re.findall(r"%globaltimer\b", ptx)


@pytest.mark.parametrize("probe", ["no_widen", "no_mma", "trace", "trace_no_rows"])
def test_dsa_index_probes_drop_only_their_part(tmp_path, monkeypatch, probe):
    """bench_indexer.py --dsa-probes / --dsa-trace (dsa_index.PROBE; wrong scores, times only):
    no_widen keeps only the query rows' 32 cvt (not the keys' 32 a page), no_mma has no wgmma,
    trace keeps the scores' stores (without them ptxas drops the head sums) and adds %clock,
    the globaltimer (which the kernel as it runs never reads) and its slots' stores within the
    registers of 4 CTAs per SM, trace_no_rows the same without the query rows' four 16-byte
    loads; all keep the ring, its releases and no stack, each its own compile-cache entry."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream
    from graphstep.kernels import dsa_index

    default = catalog.build(SHAPES["tp8"], "dsa_index").op
    monkeypatch.setattr(dsa_index, "PROBE", probe)
    variant = catalog.build(SHAPES["tp8"], "dsa_index")
    assert variant.op.probe == probe and catalog._key(variant.op, "sm_90a") != catalog._key(default, "sm_90a")
    cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(tmp_path))](
        variant.op, *variant.args, make_fake_stream()
    )
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    (cubin,) = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    (found,) = _cubin_kernels(cubin.read_bytes()).values()
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == (32 if probe == "no_widen" else 64)
    assert ("wgmma.mma_async" in ptx) == (probe != "no_mma")
    if probe != "no_mma":  # DsaIndex's descriptors masked as every kernel's (no cluster here, yet)
        _check_descriptors(ptx)
    tracing = probe.startswith("trace")
    assert ptx.count("ld.global.v4.b32") == (0 if probe == "trace_no_rows" else 4)  # the query rows
    assert "st.global.f32" in ptx and ("%clock" in ptx) == tracing
    assert len(_timer_reads(ptx)) == 2 * tracing and ("st.global.b64" in ptx) == tracing
    # registers are allocated 8 a thread (256 a warp): 4 CTAs per SM need <= 96; no_widen
    # (101 on main, 103 with the bounded waits) has run at 3 CTAs per SM
    allocated = -(-found["regs"] // 8) * 8
    assert allocated * dsa_index.THREADS * (3 if probe == "no_widen" else 4) <= 65536, found
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and found["frame"] == 0


@pytest.mark.parametrize("split", [top_k.Split(8, 512, 2), top_k.Split(2, 1024, 16, 12)], ids=lambda s: s.name)
def test_top_k_trace_probe_adds_only_its_marks(tmp_path, monkeypatch, split):
    """bench_indexer.py --top-k-trace-step (top_k.PROBE = "trace"; outputs wrong, times only):
    the kernel as it runs plus %clock at entry, after the wait, the load, each round (and its
    histogram and its first hop), the list and the compaction and at exit, the globaltimer
    at entry and exit, one closing cluster barrier
    and the marks' stores; within the registers of a full CTA and without a stack; its own
    compile-cache entry. The default variant reads no clock."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir
    from cutlass.cute.runtime import make_fake_stream

    default = catalog.build(SHAPES["tp8"], "top_k", split=split)
    monkeypatch.setattr(top_k, "PROBE", "trace")
    variant = catalog.build(SHAPES["tp8"], "top_k", split=split)
    assert variant.op.tracing and catalog._key(variant.op, "sm_90a") != catalog._key(default.op, "sm_90a")
    texts = {}
    for name, v in (("default", default), ("trace", variant)):
        folder = tmp_path / name
        folder.mkdir()
        cute.compile[cute.GPUArch("sm_90a"), cute.KeepCUBIN(), cute.KeepPTX(), DumpDir(str(folder))](
            v.op, *v.args, make_fake_stream()
        )
        (ptx,) = [p.read_text() for p in folder.iterdir() if p.suffix == ".ptx"]
        (cubin,) = [p for p in folder.iterdir() if p.suffix == ".cubin"]
        (found,) = _cubin_kernels(cubin.read_bytes()).values()
        texts[name] = (ptx, found)
    (plain, _), (traced, found) = texts["default"], texts["trace"]
    assert "%clock" not in plain and not _timer_reads(plain)
    # %clock at entry and exit and one per mark (no list: no list mark)
    marks = top_k.TRACE_MARKS - (top_k.list_entries(split) == 0)
    assert traced.count("%clock") == 2 + marks and len(_timer_reads(traced)) == 2
    assert traced.count("barrier.cluster.arrive") == plain.count("barrier.cluster.arrive") + 1
    assert found["regs"] * split.threads <= 65536 and found["frame"] == 0, found
