"""The one registry of kernel variants: each built from a shape (`build`), compiled once
and kept alive (`compile_op`), and its PTX (and, on request, its SASS) on disk (`write_ptx`).

graphstep/launch.py builds every op it launches with `build` and warms the list `variants`
gives for its capture sizes; `graphstep ptx` writes that same list, so the launchers and the
PTX cannot drift apart. `check` holds a shape to the sizes each kernel module declares in
its SUPPORTED. Compiling needs no GPU (`cute.GPUArch("sm_90a")`), which is how the CPU tests
and `graphstep ptx` check the generated code. A compiled function owns its CUDA module (its
finalizer unloads it), so the cache keeps every one alive for the process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cutlass.cute as cute
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.runtime import make_fake_stream

from . import (
    candidate_sync,
    dcp_merge,
    dsa_index,
    index_key,
    index_query,
    key_and_norm,
    mla_query,
    query_norm,
    query_wait,
    sparse_core,
    top_k,
)

_CACHE: dict[tuple, object] = {}
KERNELS = {
    module.__name__.rsplit(".", 1)[-1]: module
    for module in (
        query_norm,
        mla_query,
        query_wait,
        index_key,
        key_and_norm,
        index_query,
        dsa_index,
        top_k,
        candidate_sync,
        dcp_merge,
        sparse_core,
    )
}


@dataclass(frozen=True)
class Variant:
    name: str  # says which kernel and which compile-time choices
    op: object
    args: tuple  # placeholder arguments for compilation


def check(shape) -> None:
    """Raise ValueError where `shape` (a graphstep RankShape) has a size some kernel does not
    support (its module's SUPPORTED): the kernels hard-code them, other sizes would run with
    wrong addresses."""
    for name, module in KERNELS.items():
        for field, supported in module.SUPPORTED.items():
            value = getattr(shape.model, field)
            if value not in supported:
                raise ValueError(
                    f"ModelShape.{field} = {value} is not supported by kernels/{name}.py (supported: {supported})"
                )


def _config(op) -> tuple:
    """An op's compile-time configuration by value (ops it holds, like MlaQuery's QueryNorm,
    by their own configuration, not their identity)."""
    return (type(op).__name__,) + tuple(
        (name, _config(value) if hasattr(value, "__dict__") else value) for name, value in sorted(vars(op).items())
    )


def _key(op, arch) -> tuple:
    return (_config(op), arch)


def compile_op(op, args, arch: str | None = None, dump_dir: str | None = None, cubin: bool = False):
    """Compile `op` (a kernel class instance) for its placeholder args, once per config.
    dump_dir: write its PTX there; cubin: also the cubin the DSL built, with line info (the
    same instructions: line info adds only debug sections)."""
    if cubin and dump_dir is None:
        raise ValueError("compile_op: cubin=True needs a dump_dir to write the cubin into")
    key = _key(op, arch)
    if key in _CACHE and dump_dir is None:
        return _CACHE[key]
    options = []
    if arch is not None:
        options.append(cute.GPUArch(arch))
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += [cute.KeepPTX(), DumpDir(dump_dir)]
        if cubin:
            options += [cute.KeepCUBIN(), cute.GenerateLineInfo()]
    compiler = cute.compile[tuple(options)] if options else cute.compile
    fn = compiler(op, *args, make_fake_stream())
    _CACHE[key] = fn
    return fn


def _rows_or_tiled(tiled: bool) -> str:
    return "tiled" if tiled else "rows"


def _query_norm(shape, pdl, tiled: bool):
    return f"query_norm_{_rows_or_tiled(tiled)}", query_norm.QueryNorm(tiled, shape.model.packed_width, pdl)


def _mla_query(shape, pdl, tiled: bool, poll: bool, remote: bool = False, tokens: int = 0):
    """remote: store the rows into every rank's mailbox of a DCP group (peer memory); tokens:
    the streamed project's token rows (mla_query.stream_tokens), 0 for the register kernel.
    The name ends in _staged where the absorb stages its tokens (mla_query.ABSORB_STAGED)."""
    topo = shape.topology
    op = mla_query.MlaQuery(
        shape.heads,
        topo.rank * shape.heads,
        shape.q_heads,
        shape.gathered,
        shape.model.packed_width,
        tiled,
        poll,
        topo.q_format == "fp8",
        topo.mla_cache == "fp8",
        pdl,
        shape.model.fp8_scale_format == "ue8m0",
        topo.dcp if remote else 1,
        tokens,
    )
    name = f"mla_query_{_rows_or_tiled(tiled)}{'_poll' if poll else ''}{'_remote' if remote else ''}"
    return name + (f"_s{tokens}" if tokens else "") + ("_staged" if op.staged else ""), op


def _query_wait(shape, pdl):
    return "query_wait", query_wait.QueryWait(shape.gathered, shape.q_heads, shape.q_bytes, pdl)


def _index_key(shape, pdl):
    m = shape.model
    op = index_key.IndexKey(
        m.packed_width,
        m.packed_columns["idx_k"][0],
        m.index_norm_eps,
        pdl,
        m.index_rotation,
        m.fp8_scale_format == "ue8m0",
    )
    return "index_key", op


def _key_and_norm(shape, pdl, tiled: bool):
    _, key = _index_key(shape, pdl)
    _, norm = _query_norm(shape, pdl, tiled)
    return f"key_and_norm_{_rows_or_tiled(tiled)}", key_and_norm.KeyAndNorm(key, norm, pdl)


def _index_query(shape, pdl, tokens: int):
    m = shape.model
    op = index_query.IndexQuery(
        m.packed_width,
        m.packed_columns["idx_w"][0],
        tokens,
        pdl,
        m.index_rotation,
        m.fp8_scale_format == "ue8m0",
    )
    return f"index_query_{tokens}", op


def _dsa_index(shape, pdl, stages: int = dsa_index.STAGES):
    name = "dsa_index" if stages == dsa_index.STAGES else f"dsa_index_ring{stages}"
    return name, dsa_index.DsaIndex(shape.topology.dcp, shape.topology.rank, pdl, stages)


def _top_k(shape, pdl, split):
    k, topo = shape.model.index_topk, shape.topology
    if split is None:
        return "top_k", top_k.TopK(k, topo.dcp, topo.rank, pdl)
    return f"top_k_{split.name}", top_k.ClusterTopK(k, topo.dcp, topo.rank, split, pdl)


def _candidate_sync(shape, pdl):
    return "candidate_sync", candidate_sync.CandidateSync(shape.topology.dcp, shape.topology.rank, pdl)


def _dcp_merge(shape, pdl):
    return "dcp_merge", dcp_merge.DcpMerge(shape.model.index_topk, shape.topology.dcp, shape.topology.rank, pdl)


def _sparse_core(
    shape,
    pdl,
    slots: int,
    publish: bool = True,
    producer: bool | None = None,
    poll: bool = False,
    crossover: bool | None = None,
    transposed: bool | None = None,
):
    """publish: the step's launch (copies the rows it read to q_out and re-arms them); the
    read-only variant is for callers outside the step (benchmarks, tests). producer: a
    producer warpgroup or not (64-row CTAs always have one: False is refused there); None:
    MMA_PRODUCER_BLOCKS per cache (16 rows; the name says only a choice other than None).
    poll: its CTAs wait for their query rows in the mailbox (the step's fork_poll on one rank).
    crossover: 64-row CTAs in head-group pairs sharing each block's loads (a cluster of 2;
    None: sparse_core.CROSSOVER for the cache; the name says only a choice other than None,
    as the op runs it: _nox where it does not apply). transposed: 16-row CTAs on
    partial_transposed_ws (None: sparse_core.TRANSPOSED_BLOCKS; named _t / _not as it runs)."""
    m, topo = shape.model, shape.topology
    op = sparse_core.SparseCore(
        shape.q_heads,
        shape.gathered,
        m.index_topk,
        topo.q_format == "fp8",
        topo.mla_cache == "fp8",
        m.softmax_scale,
        slots,
        pdl,
        publish,
        producer,
        poll,
        crossover,
        transposed,
    )
    path = "" if producer is None else ("_ws" if producer else "_nows")
    path += "" if crossover is None else ("_x" if op.crossover else "_nox")  # as it runs (where it applies)
    path += "" if transposed is None else ("_t" if op.transposed else "_not")
    return f"sparse_core_s{slots}{'' if publish else '_read'}{path}{'_poll' if poll else ''}", op


_BUILDERS = {
    "query_norm": _query_norm,
    "mla_query": _mla_query,
    "query_wait": _query_wait,
    "index_key": _index_key,
    "key_and_norm": _key_and_norm,
    "index_query": _index_query,
    "dsa_index": _dsa_index,
    "top_k": _top_k,
    "candidate_sync": _candidate_sync,
    "dcp_merge": _dcp_merge,
    "sparse_core": _sparse_core,
}


def build(shape, kernel: str, pdl: bool = True, **choice) -> Variant:
    """The variant of `kernel` (a key of KERNELS) a step of `shape` (a graphstep RankShape)
    launches for the launch-time `choice`: query_norm, key_and_norm: tiled; mla_query: tiled, poll, remote, tokens;
    index_query: tokens; dsa_index: stages (its ring); top_k: split (a top_k.Split, or None: one CTA per row);
    sparse_core: slots (per CTA), publish, poll, producer, crossover, transposed; the others none."""
    if kernel not in _BUILDERS:
        raise ValueError(f"no kernel {kernel!r}: expected one of {sorted(_BUILDERS)}")
    name, op = _BUILDERS[kernel](shape, pdl, **choice)
    return Variant(name, op, KERNELS[kernel].compile_args())


def variants(
    shape,
    pdl: bool = True,
    batches=range(1, 65),
    norms=(False, True),
    widths=None,
    polls=(False, True),
    group: bool = False,
    fits=None,
) -> list[Variant]:
    """The variants a step of `shape` can launch for these batch sizes. norms: the
    QueryNorm / MlaQuery variants (tiled or not: the caller's choice for these batches);
    widths: the block tables' widths in scores, for DsaIndex's ring and TopK's split (None:
    every ring, TopK and every split); polls: the polling variants of the fork_poll mode
    (MlaQuery's under DCP, SparseCore's on one rank); group: a rank of a DCP group
    whose kernels exchange through peer memory (MlaQuery's remote stores, CandidateSync);
    fits: whether a TopK split's cluster can be resident on the device (top_k.split_for)."""
    check(shape)
    dcp = shape.topology.dcp > 1
    out = []
    for tiled in norms:
        out.append(build(shape, "query_norm", pdl, tiled=tiled))
        out.append(build(shape, "key_and_norm", pdl, tiled=tiled))
        for poll in polls if dcp else (False,):
            for tokens in sorted({mla_query.stream_tokens(b, shape.heads) for b in batches}):
                out.append(build(shape, "mla_query", pdl, tiled=tiled, poll=poll, remote=group, tokens=tokens))
    out.append(build(shape, "index_key", pdl))
    for tokens in sorted({tokens for b in batches for _, _, tokens in index_query.launches(b)}):
        out.append(build(shape, "index_query", pdl, tokens=tokens))
    if widths is None:
        rings, splits = dsa_index.RINGS, [None, *top_k.SPLITS]
    else:
        pages = [width // dsa_index.PAGE for width in widths]
        rings = sorted({dsa_index.ring_for(b, n, dsa_index.pages_per_cta(b, n)) for n in pages for b in batches})
        splits = dict.fromkeys(top_k.split_for(width, b, fits) for width in widths for b in batches)
    for stages in rings:
        out.append(build(shape, "dsa_index", pdl, stages=stages))
    for split in splits:
        out.append(build(shape, "top_k", pdl, split=split))
    k = shape.model.index_topk
    planned = {b: sparse_core.plan(b, shape.q_heads, k, shape.topology.mla_cache) for b in batches}
    for slots in sorted(set(planned.values())):
        out.append(build(shape, "sparse_core", pdl, slots=slots))
    if not dcp and True in polls:  # fork_poll's, where a launch may poll on 132 SMs (fewer SMs: a subset)
        polling = {slots for b, slots in planned.items() if sparse_core.may_poll(b, shape.q_heads, k, slots)}
        for slots in sorted(polling):
            out.append(build(shape, "sparse_core", pdl, slots=slots, poll=True))
    if dcp:
        out.append(build(shape, "dcp_merge", pdl))
        out.append(build(shape, "query_wait", pdl))
    if group:
        out.append(build(shape, "candidate_sync", pdl))
    return out


def nvdisasm() -> str:
    """The path of an nvdisasm: on the PATH, under $CUDA_HOME, from the `nvidia-cuda-nvdisasm`
    wheel (nvidia/cu*/bin), or under /usr/local/cuda*. Raises FileNotFoundError naming them."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    roots = [Path(os.environ["CUDA_HOME"])] if os.environ.get("CUDA_HOME") else []
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels

        roots += [d for p in nvidia.__path__ for d in sorted(Path(p).glob("cu*"), reverse=True)]
    except ImportError:
        pass
    roots += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]  # newest first
    for root in roots:
        candidate = root / "bin" / "nvdisasm"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        "nvdisasm was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda*/bin, the nvidia-cuda-nvdisasm wheel): "
        "install the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`"
    )


def write_ptx(
    out_dir,
    arch: str,
    shape,
    batch: int | None = None,
    tiled: bool | None = None,
    written_one=None,
    sass: bool = False,
) -> list[Path]:
    """Compile every variant for `arch` and write `<variant>.<arch>.ptx` files into out_dir.
    batch: only the variants that batch launches, `tiled` saying its QueryNorm / MlaQuery
    variant (every DsaIndex ring and TopK split is written: the choice depends on the context too).
    sass: also `<variant>.<arch>.sass` (write_variant). written_one(path), if given, is called
    as each file is written."""
    disassembler = nvdisasm() if sass else None  # before any compile: a missing tool fails at once
    if batch is None:
        norms, batches = (False, True), range(1, 65)
    elif tiled is None:
        raise ValueError("write_ptx for one batch needs `tiled`, the QueryNorm / MlaQuery variant that batch uses")
    else:
        norms, batches = (tiled,), (batch,)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for variant in variants(shape, norms=norms, batches=batches):
        for path in write_variant(variant, out, arch, disassembler):
            written.append(path)
            if written_one is not None:
                written_one(path)
    return written


def write_variant(variant: Variant, out: Path, arch: str, disassembler: str | None = None) -> list[Path]:
    """Compile one variant for `arch` into `out`: `<name>.<arch>.ptx`, and with a disassembler
    (an nvdisasm path) `<name>.<arch>.sass`, its listing (`-gi -c`) of the cubin the DSL built,
    the one a GPU runs, each instruction under its source line: where a compute-sanitizer or
    ncu offset (`+0xd90`) falls, read without a GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        compile_op(variant.op, variant.args, arch, tmp, cubin=disassembler is not None)
        ptx = out / f"{variant.name}.{arch}.ptx"
        ptx.write_text(_dumped(tmp, ".ptx", variant.name).read_text())
        if disassembler is None:
            return [ptx]
        cubin = _dumped(tmp, ".cubin", variant.name)
        listing = subprocess.run([disassembler, "-gi", "-c", str(cubin)], capture_output=True, text=True)
        if listing.returncode != 0:
            raise RuntimeError(f"{variant.name}: {disassembler} failed: {listing.stderr.strip()}")
        sass = out / f"{variant.name}.{arch}.sass"
        sass.write_text(listing.stdout)
        return [ptx, sass]


def _dumped(folder: str, suffix: str, name: str) -> Path:
    """The one file with `suffix` a compile dumped into `folder`."""
    found = [p for p in Path(folder).iterdir() if p.suffix == suffix]
    if len(found) != 1:
        raise RuntimeError(f"{name}: expected one {suffix} file, found {[p.name for p in found]}")
    return found[0]
