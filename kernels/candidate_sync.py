"""CandidateSync: in a DCP group, tell every other rank that this rank's top-k candidates
are complete, and wait until every other rank has said the same.

It runs right after TopK on the main stream (its griddepcontrol.wait: TopK's writes are
done and visible), with one warp: lane s (s != rank) stores 1 into flag word `rank` of
rank s's flags (a release store at system scope, `offsets[s]` bytes away: this GPU's
memory or a peer GPU's over P2P), then spins on this rank's own flag word s with acquire
loads until rank s's 1 arrives, and re-arms it to 0: a flag is written by one rank and read
and re-armed by its owner alone, like a mailbox chunk. DcpMerge after it then reads the
peers' candidates where their TopK left them.

The spin is bounded like QueryWait's: a flag still 0 when the global timer passes start +
budget_ns is recorded in the error word's candidate pair (int32 words 4-5: flag, lowest
missing rank; graphstep.launch.ErrorWord) and the kernel exits, so a lost rank fails the
step on the host instead of hanging it. One warp on one SM: a waiting rank leaves the rest
of the GPU to the ranks it waits for (on one GPU they share the SMs); for the same reason
its dependent (DcpMerge) launches only when it has completed (no explicit trigger).

The flags are doubled by step parity (graphstep.dcp_group): a fast rank writes the next
step's half while a slow one still reads this step's.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32, Int64

from . import primitives as P

SUPPORTED: dict = {}  # no ModelShape size is built in
CANDIDATE_FLAG = 4  # int32 word of the error word holding the candidate flag (then the rank)


class CandidateSync:
    def __init__(self, dcp: int, rank: int, pdl: bool = True):
        if not 2 <= dcp <= 32:
            raise ValueError(f"CandidateSync needs 2 <= dcp <= 32 (one lane per rank), got {dcp}")
        self.dcp, self.rank, self.pdl = dcp, rank, pdl

    @cute.jit
    def __call__(
        self, flags: cute.Pointer, offsets: cute.Pointer, error: cute.Pointer, budget_ns: Int64, stream: cuda.CUstream
    ):
        self.candidate_sync(flags, offsets, error, budget_ns).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def candidate_sync(self, flags: cute.Pointer, offsets: cute.Pointer, error: cute.Pointer, budget_ns: Int64):
        lane, _, _ = cute.arch.thread_idx()
        cute.arch.griddepcontrol_wait()
        if lane < self.dcp and lane != self.rank:
            # this rank's word in rank `lane`'s flags (offsets in bytes, flags int32); the
            # fence makes TopK's writes (another grid's, seen through griddepcontrol.wait)
            # cumulative with the flag at system scope
            P.fence_acq_rel_sys()
            P.store_release_i32(flags + P.load_i64(offsets + lane) // 4 + self.rank, Int32(1))
            deadline = P.globaltimer() + budget_ns
            ready = P.load_acquire_i32(flags + lane) == 1
            while not ready and P.globaltimer() < deadline:
                ready = P.load_acquire_i32(flags + lane) == 1
            if ready:
                P.store_i32(flags + lane, Int32(0))
            else:
                P.report_missing(error + CANDIDATE_FLAG, lane)
        # No explicit launch_dependents: DcpMerge launches when this grid completes. Early,
        # its 1024-thread CTAs would sit on SMs the ranks this one waits for may need (on one
        # GPU), and the first lane to trigger counts, so a trigger after the spin would still
        # depend on the warp reconverging before it.


def compile_args():
    return (P.gmem_ptr(Int32, align=4), P.gmem_ptr(Int64, align=8), P.gmem_ptr(Int32, align=8), Int64(1))
