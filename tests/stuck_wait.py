"""A one-CTA kernel that waits on an mbarrier (primitives.mbar_wait) which completes only if
its thread 0 arrives: the bounded wait's test subject (tests/test_mbar_wait_gpu.py runs it in
a child process, since a trap ends the process's CUDA context; the CPU compile test reads
its PTX).

    python tests/stuck_wait.py arrive|stuck LIMIT_NS

prints "stored 7" when the wait completed; a trapped wait raises at the sync."""

from __future__ import annotations

import sys
import time

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_stream
from graphstep.kernels import guards
from graphstep.kernels import primitives as P


class MbarWaitProbe:
    def __init__(self, arrive: bool):
        self.arrive = arrive

    @cute.jit
    def __call__(self, out: cute.Pointer, stream):
        self.probe(out).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def probe(self, out: cute.Pointer):
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        bar = smem.allocate_tensor(Int64, cute.make_layout(1), byte_alignment=8).iterator.toint()
        if tid == 0:
            P.mbar_init(bar, 1)
            P.mbar_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.arrive):
            if tid == 0:
                P.mbar_arrive(bar)
        P.mbar_wait(bar, 0)
        if tid == 0:
            P.store_i32(out, Int32(7))


def compile_probe(arrive: bool, options=()):
    compiler = cute.compile[tuple(options)] if options else cute.compile
    return compiler(MbarWaitProbe(arrive), P.gmem_ptr(cutlass.Int32), make_fake_stream())


def main(mode: str, limit_ns: int) -> None:
    import torch

    from graphstep.launch import current_stream, ptr

    guards.MBAR_WAIT_LIMIT_NS = limit_ns  # read when the wait's PTX is written
    op = compile_probe(mode == "arrive")
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    start = time.monotonic()
    op(ptr(out), current_stream())
    print("launched", flush=True)  # compiled and launched: an error after this is the kernel's
    torch.cuda.synchronize()
    print(f"stored {int(out[0])} after {time.monotonic() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
