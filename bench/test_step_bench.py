"""pytest-benchmark timing of the captured step (GPU only):

    python -m pytest bench/test_step_bench.py --benchmark-only -m gpu

The benchmark target replays the graph and synchronizes, so pytest-benchmark's host
clock covers the device work; the median of CUDA-event times over the same replays is
recorded beside it in extra_info["device_us"]."""

import statistics

import pytest
import torch

from graphstep.shapes import RankShape, Topology, preset
from graphstep.step import DecodeStep
from graphstep.timing import load_batch, replay_us

pytestmark = pytest.mark.gpu
SIZES = (1, 4, 16, 64)
CONTEXT = 32768


@pytest.fixture(scope="module", params=["cute", "torch"])
def step(request):
    built = DecodeStep(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8)),
        capture_sizes=SIZES,
        policy="fork",
        backend=request.param,
        max_context=CONTEXT,
    )
    built.capture(modes=("serial",) if request.param == "cute" else ())
    return built


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["fork", "serial"])
def test_step(benchmark, step, size, mode):
    if (size, mode) not in step.graphs:
        pytest.skip(f"{step.backend} captured no {mode} graph")
    load_batch(step, size, CONTEXT)
    graph = step.graph(size, mode)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=50, warmup_rounds=5)
    benchmark.extra_info["device_us"] = statistics.median(replay_us(step, size, mode, replays=50))
    benchmark.extra_info["backend"] = step.backend
