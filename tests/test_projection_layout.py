"""IndexQuery's projection core on the CPU: its per-thread copy, ldmatrix and accumulator
addresses (kernels/projection.py `Stream`, evaluated with plain ints) driven through a
model of cp.async, ldmatrix.x4 and mma.m16n8k16 as the PTX ISA defines their fragments,
stage by stage, must give W . q_c^T for the CTA's 64 rows, tokens past the batch aside."""

import numpy as np
import pytest
from graphstep.kernels import index_query, primitives
from graphstep.kernels import projection as J


class Elements:
    """An element pointer into a float array (stands in for a bf16 global pointer)."""

    def __init__(self, array, offset=0):
        self.array, self.offset = array.reshape(-1), offset

    def __add__(self, n):
        return Elements(self.array, self.offset + int(n))


def _warp_compute(streams, stage, smem, acc, monkeypatch):
    """One warp's Stream.compute: record each lane's ldmatrix addresses and MMA operands,
    then evaluate them warp-wide (lane l of matrix q gets row l // 4, columns 2 (l % 4) + 0, 1)."""
    records = []
    for s in streams:
        calls = []

        def ldmatrix(addr, calls=calls):
            calls.append(("ldm", addr))
            return tuple((len(calls) - 1, r) for r in range(4))

        def mma(a, b, c, calls=calls):
            calls.append(("mma", a, b))
            return c

        monkeypatch.setattr(J.P, "ldmatrix_x4", ldmatrix)
        monkeypatch.setattr(primitives, "mma_bf16_16816", mma)
        s.compute(stage, [None] * (s.tokens // 8))
        records.append(calls)
    words = {}
    for i, call in enumerate(records[0]):
        if call[0] == "ldm":
            addrs = [records[lane][i][1] for lane in range(32)]
            for lane in range(32):
                for q in range(4):
                    e = addrs[8 * q + lane // 4] // 2 + 2 * (lane % 4)
                    words[(i, lane, q)] = smem[e : e + 2]
    mmas = 0
    for i, call in enumerate(records[0]):
        if call[0] != "mma":
            continue
        nt, mmas = mmas // 2 % (streams[0].tokens // 8), mmas + 1  # compute's order: (a0, a1) per n-tile
        a, b = np.zeros((16, 16)), np.zeros((16, 8))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            (_, fa, fb) = records[lane][i]
            w = lambda frag: words[(frag[0], lane, frag[1])]  # noqa: E731
            a[g, 2 * t : 2 * t + 2], a[g + 8, 2 * t : 2 * t + 2] = w(fa[0]), w(fa[1])
            a[g, 2 * t + 8 : 2 * t + 10], a[g + 8, 2 * t + 8 : 2 * t + 10] = w(fa[2]), w(fa[3])
            b[2 * t : 2 * t + 2, g], b[2 * t + 8 : 2 * t + 10, g] = w(fb[0]), w(fb[1])
        c = a @ b
        for lane in range(32):
            g, t = lane // 4, lane % 4
            acc[(lane, nt)] = acc.get((lane, nt), 0) + np.array(
                [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
            )


@pytest.mark.parametrize("tokens", [16, 32])
def test_stream_addresses_compute_the_projection(tokens, monkeypatch):
    rng = np.random.default_rng(tokens)
    ring, batch = index_query.RING[tokens], tokens - 3
    weights, qc = rng.standard_normal((J.ROWS, J.K)), rng.standard_normal((batch, J.K))
    smem = np.full(J.ring_bytes(tokens, ring) // 2, np.nan)  # one entry per bf16 element

    def cp_async(dst, src, live=True):
        assert dst % 16 == 0
        smem[dst // 2 : dst // 2 + 8] = src.array[src.offset : src.offset + 8] if live else 0

    monkeypatch.setattr(J.P, "cp_async_16", cp_async)
    monkeypatch.setattr(J.cutlass, "min", min)
    streams = [J.Stream(tokens, ring, 0, tid, tid // 32, tid % 32) for tid in range(J.THREADS)]
    accs = [{} for _ in range(J.WARPS)]
    for stage in range(J.STAGES):  # (the slot stage % ring, filled just before use)
        for s in streams:
            s.issue_weights(Elements(weights), stage)
            s.issue_tokens(Elements(qc), batch, stage)
        for warp in range(J.WARPS):
            _warp_compute(streams[32 * warp : 32 * warp + 32], stage, smem, accs[warp], monkeypatch)
    tile = np.full(J.ring_bytes(tokens, ring) // 4, np.nan)
    for khalf in (1, 0):  # the kernel's reduction order
        for warp in (w for w in range(J.WARPS) if streams[32 * w].khalf == khalf):
            for lane in range(32):
                for i, addr in enumerate(streams[32 * warp + lane].acc_addrs(0, lane)):
                    value = accs[warp][(lane, i // 4)][i % 4]
                    tile[addr // 4] = value if khalf == 1 else value + tile[addr // 4]
    got = np.array([[tile[(t * J.OUT_PITCH + 4 * r) // 4] for r in range(J.ROWS)] for t in range(tokens)])
    np.testing.assert_allclose(got[:batch], qc @ weights.T, rtol=1e-9, atol=1e-9)
    assert np.all(got[batch:] == 0), "zero-filled token rows give zero columns"
