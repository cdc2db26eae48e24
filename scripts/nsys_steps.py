"""The workload scripts/nsys_capture.sh profiles: build and capture the step, warm up, then,
inside a cudaProfilerApi range (all nsys records), replay `--steps` steady-state steps, one
NVTX range each, and run `--eager-steps` eager steps, one NVTX range each with one range per
stage launch inside (the cute backend's launchers, wrapped here).

    python scripts/nsys_steps.py [--batch 4] [--steps 3] [--eager-steps 0] [--mode fork] [--context 4096]
"""

import argparse
import functools
import sys
import time

import torch

from graphstep.cli import add_shape_args, rank_shape, sm90_device
from graphstep.policy import MODES
from graphstep.step import DecodeStep
from graphstep.timing import load_batch

# Kernels' launchers -> the stage each NVTX range is named after
STAGE_LAUNCHERS = {
    "index_key": "IndexKey",
    "key_and_query_norm": "IndexKey+QueryNorm",
    "query_norm": "QueryNorm",
    "mla_query": "MlaQuery",
    "query_wait": "QueryWait",
    "index_query": "IndexQuery",
    "dsa_index": "DsaIndex",
    "top_k": "TopK",
    "dcp_merge": "DcpMerge",
    "sparse_core": "SparseCore",
}


def stage_ranges(kernels) -> list[str]:
    """Wrap each stage launcher of `kernels` (a launch.Kernels) in an NVTX range named after its
    stage; returns the stages wrapped."""
    wrapped = []
    for method, stage in STAGE_LAUNCHERS.items():
        launch = getattr(kernels, method, None)
        if launch is None:
            continue

        @functools.wraps(launch)
        def ranged(*args, _launch=launch, _stage=stage, **kwargs):
            with torch.cuda.nvtx.range(_stage):
                return _launch(*args, **kwargs)

        try:
            setattr(kernels, method, ranged)
        except (AttributeError, TypeError):  # a launcher that cannot be replaced: no range for it
            continue
        wrapped.append(stage)
    return wrapped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(parser)
    parser.add_argument("--batch", type=int, default=4, help="the size captured")
    parser.add_argument("--steps", type=int, default=3, help="graph replays recorded")
    parser.add_argument("--eager-steps", type=int, default=0, help="eager steps recorded (stage ranges inside)")
    parser.add_argument("--warmup", type=int, default=5, help="replays before the recorded range")
    parser.add_argument("--mode", default=None, choices=MODES, help="overlap mode (default: the policy's)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    args = parser.parse_args()
    if args.steps < 0 or args.eager_steps < 0 or args.steps + args.eager_steps == 0:
        parser.error("--steps and --eager-steps must be >= 0, and one of them positive")
    if not sm90_device():
        print("nsys_steps: needs an sm_90 GPU (H100/H200); none was found", file=sys.stderr)
        return 2
    started = time.perf_counter()
    shape = rank_shape(args)
    step = DecodeStep(shape, capture_sizes=[args.batch], policy=args.mode, max_context=args.context)
    step.capture()
    mode = step.modes[args.batch]
    load_batch(step, args.batch, args.context)
    for _ in range(args.warmup):  # steady state before the recorded range
        step.replay(args.batch)
    inputs = step.state.inputs(args.batch, context_lens=args.context, seed=1)
    peers = step.state.peer_inputs(inputs, seed=2) if shape.topology.dcp > 1 else None
    kernels = getattr(step.stages, "kernels", None)  # CuteStages' launch.Kernels
    stages = stage_ranges(kernels) if args.eager_steps and kernels is not None else []
    if args.eager_steps and not stages:
        print("nsys_steps: no stage launchers to wrap: eager steps get no stage ranges", file=sys.stderr)
    torch.cuda.synchronize()
    print(f"nsys_steps: built, captured and warmed in {time.perf_counter() - started:.1f} s", flush=True)
    torch.cuda.profiler.start()
    for _ in range(args.steps):
        with torch.cuda.nvtx.range(f"replay batch {args.batch} {mode}"):
            step.replay(args.batch)
            torch.cuda.synchronize()
    for _ in range(args.eager_steps):
        with torch.cuda.nvtx.range(f"eager batch {args.batch} {mode}"):
            step.step(inputs, peers, eager=True)
            torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(
        f"nsys_steps: recorded {args.steps} replays and {args.eager_steps} eager steps of batch {args.batch} "
        f"({shape.topology.name}, {mode}, context {args.context})" + (f"; stage ranges: {stages}" if stages else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
