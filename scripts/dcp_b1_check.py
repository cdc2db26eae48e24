"""Issue 10, DCP 2 (H200): the B = 1 graph of Kimi K3.1 TP8 DCP2 in a step that captured [1]
and in one that captured [1, 64], with DcpMerge timed alone on the replay's own buffers
and what a model of its radix search says about token 0 (rounds 3 with this rank's k-th:
the case that ran the dcp x k tie scan before the fix). Then a few seeds on the [1] step:
if the slowdown is the data (not the capture sizes) some seeds are slow there too.

    python scripts/dcp_b1_check.py          # needs an sm_90 GPU (H100/H200)
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_dcp_replay import _keys, search  # noqa: E402

from graphstep import RankShape, Topology, preset  # noqa: E402
from graphstep.step import DecodeStep  # noqa: E402
from graphstep.timing import load_batch, replay_us  # noqa: E402

shape = RankShape(preset("kimi-k3.1"), Topology(tp=8, dcp=2))


def check(step: DecodeStep, seed: int) -> str:
    load_batch(step, 1, 32768, seed)
    us = statistics.median(replay_us(step, 1, "fork"))
    b, peers = step.buffers, step.transport
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    candidates = peers.publish_candidates(b.own_positions, b.own_scores, 1)  # the staged peers' (no launch)
    start.record()
    for _ in range(10):
        step.stages.dcp_merge(candidates, 1)
    end.record()
    torch.cuda.synchronize()
    own, peer = _keys(b.own_scores[0].cpu()), _keys(peers.scores[0, 1].cpu())
    threshold, need, rounds = search(torch.cat([own, peer]), 2048)
    return (
        f"seed {seed}: B=1 replay {us:6.1f} us, DcpMerge alone {start.elapsed_time(end) * 100:6.1f} us, "
        f"search rounds {rounds}, need {'ALL' if need == 2**31 - 1 else need}, "
        f"own candidates at the threshold {int((own == threshold).sum())}"
    )


for sizes in ([1], [1, 64]):
    step = DecodeStep(shape, capture_sizes=sizes, policy="fork")
    step.capture()
    print(f"captured {sizes}: {check(step, 0)}", flush=True)
    if sizes == [1]:
        for seed in range(1, 9):
            print(f"captured {sizes}: {check(step, seed)}", flush=True)
    del step
    torch.cuda.empty_cache()
