"""bench_sparse_core.py --trace's reading of SparseCore's trace probe (sparse_core_wgmma.TRACE_*),
on a synthetic trace: the CPU half of the probe, whose kernel half is compiled and checked in
test_kernels_compile.py."""

import sys
from pathlib import Path

import pytest
import torch
from graphstep.kernels import sparse_core_wgmma as W

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_sparse_core import trace_steps  # noqa: E402

# a block's steps, cycles after the scorer's full wait: its scores, softmax and P @ V end at
# 100 / 150 / 250; the values' P is ready at 160, rescaled at 180, its P @ V done at 260; the
# producer issued its loads 200 before, passed empty 150 before, stored 20 before
BLOCK = 300
SCORER, VALUES, PRODUCER = (0, 100, 150, 250), (160, 180, 260), (-200, -150, -20)


def _trace(tokens: int, groups: int, blocks: int, origin: int) -> torch.Tensor:
    """partial_o [tokens, 64 groups rows, 512] with each CTA's words: entry at `origin` (+ 7 per
    CTA), the first full wait 500 later, blocks BLOCK apart; NaN elsewhere."""
    partial_o = torch.full((tokens, 64 * groups, 512), float("nan"))
    words = partial_o.view(tokens, groups, -1).view(torch.int32)
    for cta in range(tokens * groups):
        row = words[cta // groups, cta % groups]
        entry = origin + 7 * cta

        def put(index: int, value: int) -> None:
            row[index] = torch.tensor(value % (1 << 32), dtype=torch.int64).to(torch.int32)

        put(W.TRACE_START, entry)
        for b in range(blocks):
            base = entry + 500 + BLOCK * b
            for i, d in enumerate(SCORER):
                put(W.TRACE_SCORER + 4 * b + i, base + d)
            for i, d in enumerate(VALUES):
                put(W.TRACE_VALUES + 3 * b + i, base + d)
            for i, d in enumerate(PRODUCER):
                put(W.TRACE_PRODUCER + 3 * b + i, base + d)
    return partial_o


@pytest.mark.parametrize("origin", [1000, (1 << 32) - 4000])  # the second wraps %clock mid-CTA
def test_trace_steps_reads_each_roles_steps(origin):
    blocks = 32
    steps = {row[0]: row[1:] for row in trace_steps(_trace(2, 2, blocks, origin), 2, blocks)}
    expected = {
        "scorer: full waited (after its last P @ V)": BLOCK - SCORER[3],
        "scorer: scores (36 wgmma + wait)": SCORER[1],
        "scorer: softmax, P handed over": SCORER[2] - SCORER[1],
        "scorer: its P @ V (RS) + wait": SCORER[3] - SCORER[2],
        "scorer: a block (full waited to full waited)": BLOCK,
        "values: P ready (after its last P @ V)": BLOCK + VALUES[0] - VALUES[2],
        "values: rescale (and VALUES_RS: P loaded)": VALUES[1] - VALUES[0],
        "values: its P @ V issued and waited": VALUES[2] - VALUES[1],
        "producer: slot ids + loads issued": BLOCK + PRODUCER[0] - PRODUCER[2],
        "producer: empty waited": PRODUCER[1] - PRODUCER[0],
        "producer: loads landed, dequantized, stored": PRODUCER[2] - PRODUCER[1],
        "first block: entry to scorer's full waited": 500,
        "whole CTA: entry to the last P @ V": 500 + BLOCK * (blocks - 1) + SCORER[3],
    }
    assert set(steps) == set(expected)
    for label, cycles in expected.items():
        assert steps[label] == [cycles] * 3, label


def test_trace_steps_reads_only_the_blocks_a_cta_has():
    """A CTA of 8 blocks: the words past them (another role's, or NaN) are never read."""
    steps = {row[0]: row[1:] for row in trace_steps(_trace(1, 2, 8, 0), 2, 8)}
    assert steps["scorer: a block (full waited to full waited)"] == [BLOCK] * 3
    assert steps["whole CTA: entry to the last P @ V"] == [500 + BLOCK * 7 + SCORER[3]] * 3
