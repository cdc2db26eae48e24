"""A/B of IndexQuery: this tree's kernel against other trees' (`--old`, repeatable: a tree's
kernels/ folder, e.g. main's) and cuBLAS's bare wq_b GEMM (F.linear), in one process.

    python bench/ab_index_query.py --old [NAME=]../../kernels [--old [NAME=]../other/kernels] [--batch 1,4,16,32,64]

Each time is the median per launch over replays of a CUDA graph of 8 launches rotating over
enough copies of wq_b (> L2) that each launch streams from HBM. Before timing, both kernels
run on the same fresh inputs into NaN-poisoned outputs, and the table says whether each old
tree's e4m3 queries and head weights are bit-identical to this tree's (every IndexQuery since
the cp.async ring keeps its MMA order, so they should be). An old tree's column is NAME, or
else the name of the folder that holds its kernels/.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

import torch
from bench_kernels import L2_BYTES, graph_time_us

from graphstep.launch import Kernels, current_stream, ptr, rope_rows
from graphstep.report import table
from graphstep.shapes import RankShape, Topology, preset
from graphstep.state import LayerState


def load_kernels(folder: Path, name: str):
    """Another tree's kernels package, imported as `name` (its relative imports work)."""
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.catalog"), importlib.import_module(f"{name}.index_query")


class OldIndexQuery:
    """Kernels.index_query's launches, through the other tree's catalog."""

    def __init__(self, shape, catalog, module):
        self.shape, self.catalog, self.module = shape, catalog, module

    def __call__(self, w, qc, qkv, lens, q_out, w_out, error, batch):
        from cutlass import Int32

        for start, rows, tokens in self.module.launches(batch):
            variant = self.catalog.build(self.shape, "index_query", True, tokens=tokens)
            self.catalog.compile_op(variant.op, variant.args)(
                ptr(qc[start:]),
                ptr(w.wq_b_index),
                ptr(qkv[start:]),
                ptr(w.index_rope_cos),
                ptr(w.index_rope_sin),
                ptr(lens[start:], 4),
                ptr(q_out[start:]),
                ptr(w_out[start:]),
                ptr(error, 8),
                Int32(rows),
                Int32(rope_rows(w.index_rope_cos, w.index_rope_sin)),
                Int32(start),
                current_stream(),
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--old",
        action="append",
        required=True,
        help="[NAME=]another tree's kernels/ folder, relative to the working directory (repeatable; "
        "NAME: its column, else the name of the folder holding it)",
    )
    parser.add_argument("--batch", default="1,4,16,32,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    m = shape.model
    names, olds = [], []
    for i, spec in enumerate(args.old):
        name, _, path = spec.rpartition("=")
        folder = Path(path).resolve()
        names.append(name or folder.parent.name)
        olds.append(OldIndexQuery(shape, *load_kernels(folder, f"old_kernels{i}")))
    state = LayerState(shape, max_batch=max(batches), max_context=4096, seed=5, device="cuda")
    w = state.weights
    copies = int(2 * L2_BYTES // (w.wq_b_index.numel() * 2)) + 1
    weights = [w] + [dataclasses.replace(w, wq_b_index=w.wq_b_index.clone()) for _ in range(copies - 1)]
    new = [Kernels(shape, ws) for ws in weights]
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = []
    for batch in batches:
        inputs = state.inputs(batch, context_lens=4096)
        qc = torch.randn(batch, m.q_lora_rank, device="cuda").bfloat16()
        outs = []
        for old in [*olds, None]:  # this tree's last
            q8 = torch.full((batch, m.index_heads, m.index_dim), 0x7F, dtype=torch.uint8, device="cuda")
            hw = torch.full((batch, m.index_heads), float("nan"), device="cuda")
            if old is not None:
                old(w, qc, inputs.qkv, inputs.context_lens, q8, hw, error, batch)
            else:
                new[0].index_query(qc, inputs.qkv, inputs.context_lens, q8, hw, batch)
            outs.append((q8, hw))
        torch.cuda.synchronize()
        q8, hw = outs[-1]
        compared = []
        for q_old, w_old in outs[:-1]:
            same = torch.equal(q_old, q8) and torch.equal(w_old, hw)
            compared.append("equal" if same else f"{int((q_old != q8).sum())} codes differ")

        def run_old(old, batch=batch, qc=qc, inputs=inputs, q8=q8, hw=hw):
            for i in range(8):
                old(weights[i % copies], qc, inputs.qkv, inputs.context_lens, q8, hw, error, batch)

        def run_new(batch=batch, qc=qc, inputs=inputs, q8=q8, hw=hw):
            for i in range(8):
                new[i % copies].index_query(qc, inputs.qkv, inputs.context_lens, q8, hw, batch)

        def run_cublas(qc=qc):
            for i in range(8):
                torch.nn.functional.linear(qc, weights[i % copies].wq_b_index)

        bodies = [lambda old=old: run_old(old) for old in olds] + [run_new, run_cublas]
        times = [graph_time_us(body, 8, replays=30) for body in bodies]
        floor_us = w.wq_b_index.numel() * 2 / 4.3e6
        percent = [f"{100 * floor_us / t:.1f}" for t in times[:-1]]
        rows.append([batch, *(f"{t:.2f}" for t in times), *percent, *compared])
    headers = (
        ["B", *names, "new", "cuBLAS"]
        + [f"{name} %BW" for name in [*names, "new"]]
        + [f"outputs {name} vs new" for name in names]
    )
    print(table(headers, rows, markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
