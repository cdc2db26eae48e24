"""QueryWait: poll the gathered q mailbox until every rank's head rows landed (DCP).

The mailbox holds, per token, q_heads rows of 576 elements; the first `gathered` rows
are published (DCP x H/t), each `row_chunks` = 36 x q_bytes chunks of 16 B. Every chunk
is polled with volatile 16-byte loads, 8 in flight per thread, by
min(32, ceil(chunks / 2048)) CTAs of 256 threads.

Beyond the reference page, the spin is bounded: a chunk still unpublished when the
global timer passes start + budget_ns is reported in `error` (its words 0-1: flag, lowest
missing linear chunk index, see graphstep.launch.ErrorWord) and the kernel exits, so a lost
publisher fails the step on the host instead of hanging the process.

The kernel first waits (griddepcontrol) for the MlaQuery before it, so when the main
stream joins after QueryWait the KV insert is complete too. It lets its dependents launch
only after its poll (a CTA barrier first), never while it waits.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from . import primitives as P

THREADS = 256
IN_FLIGHT = P.POLL_IN_FLIGHT
# The ModelShape sizes this kernel is written for (kernels/catalog.py rejects others).
SUPPORTED = {"kv_lora_rank": (512,), "qk_rope_dim": (64,)}  # 576-element rows: 36 x q_bytes chunks


def grid_for(chunks: int) -> int:
    return min(32, -(-chunks // (THREADS * IN_FLIGHT)))


class QueryWait:
    def __init__(self, gathered: int, q_heads: int, q_bytes: int, pdl: bool = True):
        self.gathered, self.q_heads, self.pdl = gathered, q_heads, pdl
        self.row_chunks = 36 * q_bytes

    @cute.jit
    def __call__(
        self,
        mailbox: cute.Pointer,
        error: cute.Pointer,
        batch: Int32,
        ctas: Int32,
        budget_ns: Int64,
        stream: cuda.CUstream,
    ):
        self.query_wait(mailbox, error, batch, budget_ns).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def query_wait(self, mailbox: cute.Pointer, error: cute.Pointer, batch: Int32, budget_ns: Int64):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        cute.arch.griddepcontrol_wait()
        P.poll_mailbox(
            mailbox,
            error,
            cta * THREADS + tid,
            ctas * THREADS,
            batch,
            P.globaltimer() + budget_ns,
            self.gathered,
            self.q_heads,
            self.row_chunks,
            0,
            0,
            Int32(0),
        )
        # only once every thread of the CTA is done polling: an early-launched dependent
        # (the sparse core after the join) would hold SMs a peer on this GPU needs to publish
        cute.arch.sync_threads()
        cute.arch.griddepcontrol_launch_dependents()


def compile_args():
    return (P.gmem_ptr(Uint8), P.gmem_ptr(Int32, align=8), Int32(1), Int32(1), Int64(1))
