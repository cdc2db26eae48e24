"""The workload scripts/nsys_capture.sh profiles: build and capture the step, warm up,
then replay a few steady-state steps inside a cudaProfilerApi range, one NVTX range each.

    python scripts/nsys_steps.py [--batch 4] [--steps 5] [--mode fork] [--context 32768]
"""

import argparse

import torch

from graphstep.shapes import RankShape, Topology, preset
from graphstep.step import DecodeStep
from graphstep.timing import load_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", default="fork")
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    step = DecodeStep(
        RankShape(preset(args.preset), Topology(tp=args.tp)),
        capture_sizes=[args.batch],
        policy=args.mode,
        max_context=args.context,
    )
    step.capture()
    load_batch(step, args.batch, args.context)
    for _ in range(20):  # steady state before the capture range
        step.replay(args.batch)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for i in range(args.steps):
        torch.cuda.nvtx.range_push(f"step {i} batch {args.batch} {args.mode}")
        step.replay(args.batch)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print(f"profiled {args.steps} replays of batch {args.batch} ({args.mode})")


if __name__ == "__main__":
    main()
