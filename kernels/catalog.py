"""Every kernel variant of a shape, compiled once and kept alive, and its PTX on disk.

Compiling needs no GPU (`cute.GPUArch("sm_90a")`), which is how the CPU tests and
`graphstep ptx` check the generated code. A compiled function owns its CUDA module
(its finalizer unloads it), so the cache keeps every one alive for the process.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cutlass.cute as cute
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.runtime import make_fake_stream

from . import dcp_merge, dsa_index, index_key, index_query, mla_query, query_norm, query_wait, sparse_core, top_k

_CACHE: dict[tuple, object] = {}


@dataclass(frozen=True)
class Variant:
    name: str  # says which kernel and which compile-time choices
    op: object
    args: tuple  # placeholder arguments for compilation


def _config(op) -> tuple:
    """An op's compile-time configuration by value (ops it holds, like MlaQuery's QueryNorm,
    by their own configuration, not their identity)."""
    return (type(op).__name__,) + tuple(
        (name, _config(value) if hasattr(value, "__dict__") else value) for name, value in sorted(vars(op).items())
    )


def _key(op, arch) -> tuple:
    return (_config(op), arch)


def compile_op(op, args, arch: str | None = None, dump_dir: str | None = None):
    """Compile `op` (a kernel class instance) for its placeholder args, once per config."""
    key = _key(op, arch)
    if key in _CACHE and dump_dir is None:
        return _CACHE[key]
    options = []
    if arch is not None:
        options.append(cute.GPUArch(arch))
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += [cute.KeepPTX(), DumpDir(dump_dir)]
    compiler = cute.compile[tuple(options)] if options else cute.compile
    fn = compiler(op, *args, make_fake_stream())
    _CACHE[key] = fn
    return fn


def variants(
    shape,
    pdl: bool = True,
    polls=(False, True),
    norms=(False, True),
    batches=range(1, 65),
    index_tokens=index_query.TOKENS,
) -> list[Variant]:
    """The kernel variants a step of `shape` (a graphstep RankShape) can launch for the
    given batch sizes (SparseCore's slots per CTA depend on the batch; norms,
    index_tokens: only these MlaQuery/QueryNorm and IndexQuery variants)."""
    m, topo = shape.model, shape.topology
    q_fp8, mla_fp8 = topo.q_format == "fp8", topo.mla_cache == "fp8"
    ue8m0 = m.fp8_scale_format == "ue8m0"
    out = []
    for tiled in norms:
        norm = "tiled" if tiled else "rows"
        out.append(
            Variant(f"query_norm_{norm}", query_norm.QueryNorm(tiled, m.packed_width, pdl), query_norm.compile_args())
        )
        for poll in polls if topo.dcp > 1 else (False,):
            op = mla_query.MlaQuery(
                shape.heads,
                topo.rank * shape.heads,
                shape.q_heads,
                shape.gathered,
                m.packed_width,
                tiled,
                poll,
                q_fp8,
                mla_fp8,
                pdl,
                ue8m0,
            )
            out.append(Variant(f"mla_query_{norm}{'_poll' if poll else ''}", op, mla_query.compile_args()))
    out.append(
        Variant(
            "index_key",
            index_key.IndexKey(
                m.packed_width, m.packed_columns["idx_k"][0], m.index_norm_eps, pdl, m.index_rotation, ue8m0
            ),
            index_key.compile_args(),
        )
    )
    for tokens in index_tokens:  # launch.Kernels.index_query picks by batch
        out.append(
            Variant(
                f"index_query_{tokens}",
                index_query.IndexQuery(
                    m.packed_width, m.packed_columns["idx_w"][0], tokens, pdl, m.index_rotation, ue8m0
                ),
                index_query.compile_args(),
            )
        )
    out.append(Variant("dsa_index", dsa_index.DsaIndex(topo.dcp, topo.rank, pdl), dsa_index.compile_args()))
    out.append(Variant("top_k", top_k.TopK(m.index_topk, topo.dcp, topo.rank, pdl), top_k.compile_args()))
    for split in top_k.SPLITS:  # every split top_k.split_for can choose
        out.append(
            Variant(
                f"top_k_{split.name}",
                top_k.ClusterTopK(m.index_topk, topo.dcp, topo.rank, split, pdl),
                top_k.compile_args(),
            )
        )
    for slots in sorted({sparse_core.plan(b, shape.q_heads, m.index_topk) for b in batches}):
        op = sparse_core.SparseCore(
            shape.q_heads, shape.gathered, m.index_topk, q_fp8, mla_fp8, m.softmax_scale, slots, pdl
        )
        out.append(Variant(f"sparse_core_s{slots}", op, sparse_core.compile_args()))
    if topo.dcp > 1:
        out.append(
            Variant("dcp_merge", dcp_merge.DcpMerge(m.index_topk, topo.dcp, topo.rank, pdl), dcp_merge.compile_args())
        )
        out.append(
            Variant(
                "query_wait",
                query_wait.QueryWait(shape.gathered, shape.q_heads, shape.q_bytes, pdl),
                query_wait.compile_args(),
            )
        )
    return out


def write_ptx(out_dir, arch: str, shape, batch: int | None = None) -> list[Path]:
    """Compile every variant for `arch` and write `<variant>.ptx` files into out_dir.
    batch: only the norm and IndexQuery variants that batch would use."""
    from graphstep.shapes import tiled_from

    norms = (False, True) if batch is None else (batch >= tiled_from(shape.heads),)
    batches = range(1, 65) if batch is None else (batch,)
    index_tokens = index_query.TOKENS if batch is None else sorted({t for _, _, t in index_query.launches(batch)})
    # (the other indexer kernels do not depend on the batch; every TopK split is written,
    # the choice depends on the context too)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for variant in variants(shape, norms=norms, batches=batches, index_tokens=index_tokens):
        with tempfile.TemporaryDirectory() as tmp:
            compile_op(variant.op, variant.args, arch, tmp)
            ptx = [p for p in Path(tmp).iterdir() if p.suffix == ".ptx"]
            if len(ptx) != 1:
                raise RuntimeError(f"{variant.name}: expected one PTX file, found {[p.name for p in ptx]}")
            target = out / f"{variant.name}.{arch}.ptx"
            target.write_text(ptx[0].read_text())
            written.append(target)
    return written
