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


@pytest.mark.parametrize("tokens", sorted(index_query.RING))
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


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_row_stream_addresses_compute_the_projection(batch, monkeypatch):
    """The 16-token variant (kernels/projection_rows.py): the producer's row copies, the
    lanes' A words of q_c, ldmatrix.x4 row addresses and mma.m16n8k16 per warp and stage,
    the partial tiles and their in-order sum give W . q_c^T; token rows past the batch zero."""
    from graphstep.kernels import projection_rows as R

    rng = np.random.default_rng(batch)
    weights, qc = rng.standard_normal((J.ROWS, J.K)), rng.standard_normal((batch, J.K))
    monkeypatch.setattr(R.cutlass, "min", min)
    smem = np.full(R.SLAB_BYTES // 2, np.nan)  # one entry per bf16 element
    for stage in range(R.STAGES):
        for lane in range(R.STAGE_ROWS):
            dst, src = R.row_copy(0, Elements(weights), stage, lane)
            assert dst % 16 == 0 and src.offset * 2 % 16 == 0
            smem[dst // 2 : dst // 2 + J.K] = src.array[src.offset : src.offset + J.K]
    partials = np.full(R.SLAB_BYTES // 4, np.nan)
    for warp in range(R.WARPS):
        words = []  # [lane][k-step][4] pairs of q_c
        for lane in range(32):
            pairs = [
                src.array[src.offset : src.offset + 2] * live
                for src, live in R.a_words(Elements(qc), batch, warp, lane)
            ]
            words.append([pairs[4 * s : 4 * s + 4] for s in range(R.KSTEPS)])
        for stage in range(R.STAGES):
            c = np.zeros((16, 8))
            for pair in range(R.KSTEPS // 2):
                rows = [R.b_addr(0, stage, pair, warp, lane) // 2 for lane in range(32)]
                for half in range(2):  # k-steps 2 pair + half: matrices 2 half, 2 half + 1
                    a, b = np.zeros((16, 16)), np.zeros((16, 8))
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        w = words[lane][2 * pair + half]
                        a[g, 2 * t : 2 * t + 2], a[g + 8, 2 * t : 2 * t + 2] = w[0], w[1]
                        a[g, 2 * t + 8 : 2 * t + 10], a[g + 8, 2 * t + 8 : 2 * t + 10] = w[2], w[3]
                        for m in range(2):  # b0, b1: matrices 2 half + m, row g, columns 2t, 2t + 1
                            e = rows[8 * (2 * half + m) + g] + 2 * t
                            b[8 * m + 2 * t : 8 * m + 2 * t + 2, g] = smem[e : e + 2]
                    c += a @ b
            for lane in range(32):
                g, t = lane // 4, lane % 4
                values = [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
                for addr, value in zip(R.partial_addrs(0, stage, warp, lane), values):
                    partials[addr // 4] = value
    got = np.zeros((R.TOKENS, J.ROWS))
    for tid in range(R.THREADS):
        parts, tile = R.sum_addrs(0, tid)
        assert tile == (tid // 16) * J.OUT_PITCH + 16 * (tid % 16)
        for q in range(4):
            got[tid // 16, 4 * (tid % 16) + q] = sum(partials[p // 4 + q] for p in parts)
    np.testing.assert_allclose(got[:batch], qc @ weights.T, rtol=1e-9, atol=1e-9)
    assert np.all(got[batch:] == 0), "token rows past the batch give zero columns"
