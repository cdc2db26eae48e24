"""One case of scripts/sanitize.sh, run under each compute-sanitizer tool: for every overlap
mode of a topology, one eager step, then one captured replay, each synchronized and its
error word checked. Small on purpose (batch 2, context 4096): the tools slow kernels 10-100x.
The `tp8-range` case loads out-of-range ids unchecked (check_values=False: a slot, a used
block-table page and a length far past the pool) and expects no access out of bounds and
the kernels' guards to report the first one (DecodeStep.check raising InputRangeError). `tp1`
runs MlaQuery's streamed project (kernels/mla_query.py STREAM_FROM_HEADS: 128 heads and up) and
the bf16 64-row SparseCore.

    python scripts/sanitize_case.py CASE [--batch 2] [--context 4096]
    python scripts/sanitize_case.py --list
"""

import argparse
import dataclasses
import sys
import time

import torch

from graphstep import InputRangeError
from graphstep.cli import sm90_device
from graphstep.policy import MODES, WIDE_MODES
from graphstep.shapes import RankShape, Topology, preset
from graphstep.step import DecodeStep

CASES = {
    "tp8": Topology(tp=8),
    "tp1-wide": Topology(tp=1, wide=True),
    "dcp2": Topology(tp=8, dcp=2),
    "tp1-fp8": Topology(tp=1, q_format="fp8", mla_cache="fp8"),
    "dcp2-fp8": Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8"),
    "tp8-range": Topology(tp=8),
    "tp1": Topology(tp=1),
}
# The mailbox polls give up after a budget of device time; under a sanitizer a healthy poll
# runs far slower, so the budget is 10 s instead of 200 ms.
SANITIZER_BUDGET_NS = 10_000_000_000


def modes_of(topology: Topology) -> tuple[str, ...]:
    """The overlap modes a topology can run (fork_poll differs from fork only under DCP)."""
    if topology.wide:
        return WIDE_MODES
    return MODES if topology.dcp > 1 else ("serial", "fork")


def run_case(name: str, batch: int, context: int) -> None:
    shape = RankShape(preset("deepseek-v3.2"), CASES[name])
    modes = modes_of(shape.topology)
    step = DecodeStep(shape, capture_sizes=[batch], policy=modes[0], max_context=context, budget_ns=SANITIZER_BUDGET_NS)
    inputs = step.state.inputs(batch, context_lens=context, seed=1)
    peers = step.state.peer_inputs(inputs, seed=2) if shape.topology.dcp > 1 else None
    good = inputs
    out_of_range = name.endswith("-range")
    if out_of_range:  # each past the pool by far: any unguarded access would leave the allocations
        # on copies: the inputs' block tables are a view of the state's own
        inputs = dataclasses.replace(
            inputs, **{f.name: getattr(inputs, f.name).clone() for f in dataclasses.fields(inputs)}
        )
        inputs.slot_mapping[0] = 2**30
        inputs.block_tables[-1, 0] = 2**30
        inputs.context_lens[-1] = 2**30
    for label, run, captured in (("eager step", step.run_stages, False), ("graph replay", step.replay, True)):
        if captured:  # the capture's warm-up step runs on the good inputs
            step.load(good, peers)
            step.capture(modes=modes)
        for mode in modes:
            started = time.perf_counter()
            step.load(inputs, peers, check_values=not out_of_range)
            run(batch, mode)
            torch.cuda.synchronize()
            if out_of_range:
                try:
                    step.check()
                except InputRangeError as error:
                    print(f"sanitize_case {name}: reported as expected: {error}", flush=True)
                else:
                    raise SystemExit(f"sanitize_case {name}: the out-of-range ids were not reported")
            else:
                step.error.check(shape.gathered, shape.mailbox_row_chunks)
            print(f"sanitize_case {name}: {label}, {mode}: {time.perf_counter() - started:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", choices=sorted(CASES), help="the topology")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--batch", type=int, default=2, help="tokens per step")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    args = parser.parse_args()
    if args.list:
        print(" ".join(CASES))
        return 0
    if args.case is None:
        parser.error("name a case (or --list)")
    if not sm90_device():
        print("sanitize_case: needs an sm_90 GPU (H100/H200); none was found", file=sys.stderr)
        return 2
    started = time.perf_counter()
    run_case(args.case, args.batch, args.context)
    print(f"sanitize_case {args.case}: done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
