"""IndexQuery's projection core on the CPU: its per-lane ldmatrix and accumulator addresses
(kernels/projection.py `Stream`, evaluated with plain ints) over shared memory filled as
the TMA copies fill it (each stage a [column block][row][64 columns] box of 128-byte rows
under the 128-byte swizzle, rows past the batch zero), driven through a model of
ldmatrix.x4 and mma.m16n8k16 as the PTX ISA defines their fragments, stage by stage, must
give W . q_c^T for the CTA's 64 rows, tokens past the batch aside. And the rings' schedule
(projection's `refill` / `released` / `parity` per ring, as the kernel's loop uses them) over
a model of mbarrier phases, with copies landing in random order: every stage's weights and
tokens read whole and current, no slot of either ring overwritten while read, no deadlock;
then the same over the compiled kernel's PTX (its own barrier addresses, parities, byte
counts and copies), which the re-stated loop cannot check."""

import random
import re
from collections import Counter

import numpy as np
import pytest
from graphstep.kernels import index_query, primitives
from graphstep.kernels import projection as J


def tma_fill(smem, base, operand, rows, stage, live):
    """A TMA copy of `stage` of a [>= live, K] operand into the box at byte `base` (1024-byte
    aligned): logical byte block x rows x 128 + row x 128 + 2 column, at its swizzled place;
    rows >= live are outside the tensor map and land as zeros."""
    assert base % 1024 == 0
    for block in range(J.KC // J.BLOCK):
        for row in range(rows):
            for column in range(J.BLOCK):
                logical = block * rows * J.ROW_BYTES + row * J.ROW_BYTES + 2 * column
                k = stage * J.KC + block * J.BLOCK + column
                smem[(base + J.swizzle(logical)) // 2] = operand[row, k] if row < live else 0


def _fill(smem, streams, weights, qc, batch, stage):
    s = streams[0]
    tma_fill(smem, s.weights_addr(stage), weights, J.ROWS, stage, J.ROWS)
    tma_fill(smem, s.tokens_addr(stage), qc, s.tokens, stage, batch)


def _streams(tokens, rings):
    w_slots, q_slots = rings
    q_base = w_slots * J.operand_bytes(J.ROWS)  # the kernel's allocation order
    return [J.Stream(tokens, w_slots, q_slots, 0, q_base, tid // 32, tid % 32) for tid in range(J.THREADS)]


def test_swizzle_is_the_128_byte_pattern():
    """Within each 1024 bytes: a permutation of the 16-byte chunks of each 128-byte row (chunk
    c of row r at c ^ r), bytes within a chunk in place."""
    for offset in range(0, 4096):
        row, chunk, byte = offset // 128, offset // 16 % 8, offset % 16
        assert J.swizzle(offset) == row * 128 + 16 * (chunk ^ (row % 8)) + byte


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
    rings, batch = index_query.RINGS[tokens], tokens - 3
    weights, qc = rng.standard_normal((J.ROWS, J.K)), rng.standard_normal((batch, J.K))
    smem = np.full(J.ring_bytes(tokens, *rings) // 2, np.nan)  # one entry per bf16 element
    streams = _streams(tokens, rings)
    accs = [{} for _ in range(J.WARPS)]
    for stage in range(J.STAGES):  # (the slot stage % ring, filled just before use)
        _fill(smem, streams, weights, qc, batch, stage)
        for warp in range(J.WARPS):
            _warp_compute(streams[32 * warp : 32 * warp + 32], stage, smem, accs[warp], monkeypatch)
    tile = np.full(J.ring_bytes(tokens, *rings) // 4, np.nan)
    for khalf in (1, 0):  # the kernel's reduction order
        for warp in (w for w in range(J.WARPS) if streams[32 * w].khalf == khalf):
            for lane in range(32):
                for i, addr in enumerate(streams[32 * warp + lane].acc_addrs(0, lane)):
                    value = accs[warp][(lane, i // 4)][i % 4]
                    tile[addr // 4] = value if khalf == 1 else value + tile[addr // 4]
    got = np.array([[tile[(t * J.OUT_PITCH + 4 * r) // 4] for r in range(J.ROWS)] for t in range(tokens)])
    np.testing.assert_allclose(got[:batch], qc @ weights.T, rtol=1e-9, atol=1e-9)
    assert np.all(got[batch:] == 0), "zero-filled token rows give zero columns"
    assert tokens * J.OUT_PITCH <= rings[0] * J.operand_bytes(J.ROWS), "the result tile fits the weight ring"


@pytest.mark.parametrize("tokens", index_query.TOKENS)
def test_every_element_of_a_stage_reaches_its_fragment_once(tokens, monkeypatch):
    """Tags instead of values: each weight (row, k) and token (t, k) of a stage carries its own
    id; every MMA's A and B fragment positions must hold exactly the ids of the rows, tokens
    and k the PTX ISA puts there, so each element is read once, where it belongs, and the
    8 row addresses of every ldmatrix matrix fall in 8 distinct 16-byte bank groups."""
    rings = index_query.RINGS[tokens]
    weights = np.arange(J.ROWS * J.K, dtype=np.float64).reshape(J.ROWS, J.K)
    qc = -1 - np.arange(tokens * J.K, dtype=np.float64).reshape(tokens, J.K)
    streams = _streams(tokens, rings)
    stage = max(rings) + 1  # a refilled slot of each ring
    smem = np.full(J.ring_bytes(tokens, *rings) // 2, np.nan)
    _fill(smem, streams, weights, qc, tokens, stage)
    seen_a, seen_b, reads = [], [], Counter()
    for warp in range(J.WARPS):
        group = streams[32 * warp : 32 * warp + 32]
        mtile, khalf = group[0].mtile, group[0].khalf
        records = []  # per lane: (its ldmatrix addresses, its MMAs' (a, b) fragment handles)
        for s in group:
            calls, mmas = [], []

            def ldmatrix(addr, calls=calls):
                calls.append(addr)
                return tuple((len(calls) - 1, r) for r in range(4))

            def mma(a, b, c, mmas=mmas):
                mmas.append((a, b))
                return c

            monkeypatch.setattr(J.P, "ldmatrix_x4", ldmatrix)
            monkeypatch.setattr(primitives, "mma_bf16_16816", mma)
            s.compute(stage, [None] * (tokens // 8))
            records.append((calls, mmas))
        for addr in (a for calls, _ in records for a in calls):  # each lane's row: 8 elements
            reads.update(range(addr // 2, addr // 2 + 8))
        for i in range(len(records[0][0])):
            for q in range(4):
                groups = {records[lane][0][i] // 16 % 8 for lane in range(8 * q, 8 * q + 8)}
                assert len(groups) == 8, (warp, i, q)
        # evaluate each MMA: lane (g, t) of matrix q gets row g, elements 2t, 2t + 1
        for m in range(len(records[0][1])):
            kstep, nt = 2 * (m // (2 * (tokens // 8))) + m % 2, m // 2 % (tokens // 8)
            k0 = stage * J.KC + khalf * J.BLOCK + 16 * kstep
            for lane in range(32):
                g, t = lane // 4, lane % 4
                a, b = records[lane][1][m]

                def element(frag, j):
                    call, q = frag
                    addr = records[8 * q + g][0][call] + 4 * t + 2 * j
                    return smem[addr // 2]

                for j in range(2):
                    for w, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                        row, k = 16 * mtile + g + dr, k0 + 2 * t + j + dk
                        assert element(a[w], j) == weights[row, k], (warp, m, lane, w, j)
                        seen_a.append((row, k))
                    for w, dk in enumerate((0, 8)):
                        token, k = 8 * nt + g, k0 + 2 * t + j + dk
                        assert element(b[w], j) == qc[token, k], (warp, m, lane, w, j)
                        seen_b.append((token, k))
    # ldmatrix reads each weight element of the stage once, each token element once per m-tile
    w0, q0 = streams[0].weights_addr(stage) // 2, streams[0].tokens_addr(stage) // 2
    assert reads == Counter(
        {e: 1 for e in range(w0, w0 + J.ROWS * J.KC)} | {e: 4 for e in range(q0, q0 + tokens * J.KC)}
    )
    ks = range(stage * J.KC, (stage + 1) * J.KC)
    # each weight element feeds one MMA of its m-tile (per n-tile: A is reused across n-tiles)
    assert sorted(set(seen_a)) == [(r, k) for r in range(J.ROWS) for k in ks]
    assert len(seen_a) == J.ROWS * J.KC * (tokens // 8)
    # each token element feeds one MMA of each of the 4 m-tiles
    assert sorted(set(seen_b)) == [(t, k) for t in range(tokens) for k in ks]
    assert len(seen_b) == tokens * J.KC * 4


class Mbarrier:
    """An mbarrier as the PTX ISA defines it: a phase completes when its pending arrivals and
    its transaction bytes both reach zero; try_wait.parity(p) succeeds once the phase of
    parity p has completed, i.e. while the current phase's parity is not p."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0

    def arrive(self, n=1, expect=0):
        self.pending, self.tx = self.pending - n, self.tx + expect
        assert self.pending >= 0
        self._advance()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._advance()

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def done(self, parity):
        return self.completed % 2 != parity


def _run_ring(tokens, rings, seed):
    """The kernel's rings (index_query.py's loop, projection's schedule per ring) with 8 warps,
    warp 0 also the producer, and copies landing in random order at random times: every
    stage's weights and tokens must be read whole and current, no copy may land in a slot a
    warp is still reading, and all must end."""
    rng = random.Random(seed)
    slots = dict(zip("wq", rings))
    full = {op: [Mbarrier(1) for _ in range(n)] for op, n in slots.items()}
    empty = {op: [Mbarrier(J.THREADS) for _ in range(n)] for op, n in slots.items()}
    sizes = {"w": J.operand_bytes(J.ROWS), "q": J.operand_bytes(tokens)}
    landed = {op: [None] * n for op, n in slots.items()}  # the stage each slot holds
    reading = {}  # warp -> the (operand, slot)s it is between its full waits and its releases
    in_flight, arrived_at_barrier = [], set()

    def warp(w):
        if w == 0:
            for op, n in slots.items():
                for slot in range(n):
                    full[op][slot].arrive(expect=sizes[op])
        arrived_at_barrier.add(w)  # the CTA barrier after the barriers' initialization
        while len(arrived_at_barrier) < J.WARPS:
            yield
        if w == 0:
            in_flight.extend((stage, "w") for stage in range(slots["w"]))  # before the PDL wait
            in_flight.extend((stage, "q") for stage in range(slots["q"]))  # after it
        for it in range(J.STAGES):
            for op, n in slots.items():
                nxt = J.refill(it, n)
                if nxt is not None and w == 0:
                    while not empty[op][nxt % n].done(J.parity(it - 1, n)):
                        yield
                    full[op][nxt % n].arrive(expect=sizes[op])
                    in_flight.append((nxt, op))
            for op, n in slots.items():
                while not full[op][it % n].done(J.parity(it, n)):
                    yield
            for op, n in slots.items():
                assert landed[op][it % n] == it, (w, it, op, landed[op][it % n])
            reading[w] = {(op, it % n) for op, n in slots.items()}
            yield  # the fragments' reads take a while
            del reading[w]
            for op, n in slots.items():
                if J.released(it, n):
                    empty[op][it % n].arrive(32)

    actors = {w: warp(w) for w in range(J.WARPS)}
    for _ in range(100_000):  # (a deadlock spins forever)
        if not actors:
            break
        choices = list(actors) + (["tma"] * 3 if in_flight else [])
        pick = rng.choice(choices)
        if pick == "tma":
            stage, op = in_flight.pop(rng.randrange(len(in_flight)))
            slot = stage % slots[op]
            assert not any((op, slot) in read for read in reading.values()), f"{op} stage {stage} lands in a read slot"
            landed[op][slot] = stage
            full[op][slot].complete_tx(sizes[op])
            continue
        try:
            next(actors[pick])
        except StopIteration:
            del actors[pick]
        assert actors or not in_flight, "every copy is waited on"
    assert not actors, "deadlock"
    for op, n in slots.items():
        assert all(b.completed == -(-(J.STAGES - s) // n) for s, b in enumerate(full[op]))
        assert all(b.completed == max(0, -(-(J.STAGES - n - s) // n)) for s, b in enumerate(empty[op]))


@pytest.mark.parametrize("rings", [(2, 2), (3, 3), (5, 5), (6, 2), (2, 6), (12, 12)])
def test_ring_schedule_holds_for_any_depths(rings):
    """Any pair of depths >= 2 (session 10's single ring is w = q), also a ring as deep as the
    stages: nothing refilled, nothing released."""
    for seed in range(40):
        _run_ring(16, rings, seed)


@pytest.mark.parametrize("tokens", index_query.TOKENS)
def test_ring_schedule_reads_each_stage_whole_and_never_overwrites_a_read_slot(tokens):
    for seed in range(200):
        _run_ring(tokens, index_query.RINGS[tokens], seed)


# -- the kernel's own PTX through the same mbarrier model ------------------------------------
# The model above re-states the loop with projection's schedule functions; these run the
# compiled loop itself: every mbarrier operation, TMA copy and ldmatrix of the entry in
# program order, each shared address resolved from the PTX. So a wrong slot, parity, byte
# count or ring in kernels/index_query.py's own indices shows here (a deadlock, a stale read,
# a copy into a slot being read), not first as a hang on the GPU.

_SHARED_KINDS = ("init", "expect", "copy", "wait", "arrive", "ldmatrix", "fence", "bar")


def _ptx_events(text: str) -> list[tuple]:
    """The entry's shared-memory protocol in program order, each address as (opaque registers,
    constant): registers are followed through mov and add.s32 from the dynamic shared memory's
    base ("smem"), any other definition is opaque. Events: ("init", addr, count), ("expect",
    addr, bytes), ("arrive", addr), ("wait", addr, parity), ("copy", dst, barrier, tensor map
    parameter, coordinates), ("ldmatrix", addr), ("fence",), ("bar",), ("pdl_wait",), ("load",)."""
    values, params, events = {}, {}, []

    def val(token):
        return ((), int(token)) if re.fullmatch(r"-?\d+", token) else values.get(token, ((token,), 0))

    def addr(expr):
        reg, _, offset = expr.partition("+")
        terms, const = val(reg)
        return terms, const + int(offset or 0)

    def add(dst, a, b):
        (ta, ca), (tb, cb) = val(a), val(b)
        values[dst] = (tuple(sorted(ta + tb)), ca + cb)

    patterns = [
        (r"mov\.b32\s+(%r\d+), __dynamic_shmem__0", lambda m: values.__setitem__(m[1], (("smem",), 0))),
        (r"shfl\.sync\.idx\.b32\s+(%r\d+), (%r\d+), 0, 31, -1", lambda m: values.__setitem__(m[1], val(m[2]))),
        (r"mov\.(?:b32|u32|f32)\s+(%r\d+), (%r\d+|-?\d+)$", lambda m: values.__setitem__(m[1], val(m[2]))),
        (r"add\.s32\s+(%r\d+), (%r\d+), (%r\d+|-?\d+)$", lambda m: add(m[1], m[2], m[3])),
        (r"mov\.b64\s+(%rd\d+), \w+_param_(\d+)", lambda m: params.__setitem__(m[1], int(m[2]))),
        (r"cvta\.param\.u64\s+(%rd\d+), (%rd\d+)", lambda m: params.__setitem__(m[1], params[m[2]])),
        (r"mbarrier\.init\.shared::cta\.b64 \[(.+)\], (\d+)", lambda m: ("init", addr(m[1]), int(m[2]))),
        (
            r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[(.+)\], (\d+)",
            lambda m: ("expect", addr(m[1]), int(m[2])),
        ),
        (r"mbarrier\.arrive\.shared::cta\.b64 _, \[(.+)\]", lambda m: ("arrive", addr(m[1]))),
        (
            r"mbarrier\.try_wait\.parity\.shared::cta\.b64 \w+, \[(.+)\], ([01])",
            lambda m: ("wait", addr(m[1]), int(m[2])),
        ),
        (
            r"cp\.async\.bulk\.tensor\.3d\.\S+ \[(.+?)\], \[(%rd\d+), \{(.+?)\}\], \[(.+?)\]",
            lambda m: ("copy", addr(m[1]), addr(m[4]), params[m[2]], tuple(val(c.strip()) for c in m[3].split(","))),
        ),
        (r"ldmatrix\.\S+ \{.+\}, \[(.+)\]", lambda m: ("ldmatrix", addr(m[1]))),
        (r"fence\.proxy\.async", lambda m: ("fence",)),
        (r"bar\.sync", lambda m: ("bar",)),
        (r"griddepcontrol\.wait", lambda m: ("pdl_wait",)),
        (r"ld\.global", lambda m: ("load",)),
        (r"[a-z][\w.:]*\s+(%r\d+),", lambda m: values.pop(m[1], None)),  # any other definition
    ]
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        for pattern, action in patterns:
            if m := re.match(pattern, line):
                if isinstance(event := action(m), tuple):
                    events.append(event)
                break
    return events


def _run_ptx(events, tokens, rings, seed):
    """The PTX's events run by 8 warps, warp 0 also the producer (the initialization, the
    expect_tx, the copies and the waits on empty barriers, those initialized for J.THREADS
    arrivals: its `if warp == 0` blocks), copies landing in random order at random times.
    The rings as `rings` says: the weights' slots from byte 0, then q_c's; a copy of stage s
    (column-block coordinate 2 s) of operand op (tensor map parameter 0: wq_b, 1: q_c) goes
    to slot s % depth and completes the box's bytes (rows past the batch too: the box is
    always whole) on that slot's full barrier. Every ldmatrix must read its warp's current
    stage, landed, with no copy in flight into the slot; a release must follow a proxy fence
    after the warp's reads; no copy may go into a slot a warp has not released; q_c's copies
    and the global reads come after the PDL wait; nothing is in flight at the CTA barrier
    after the loop; all must end."""
    rng = random.Random(seed)
    nbytes = {0: J.operand_bytes(J.ROWS), 1: J.operand_bytes(tokens)}
    base = {0: 0, 1: rings[0] * nbytes[0]}
    per_stage = 2 * (2 + tokens // 8)  # ldmatrix.x4 per warp and stage (Stream.compute)

    def offset(address):
        terms, const = address
        assert terms == ("smem",), f"unresolved shared address {address}"
        return const

    def stage_of(copy):
        terms, column_block = copy[4][2]
        assert terms == () and column_block % 2 == 0
        return column_block // 2

    counts = {offset(e[1]): e[2] for e in events if e[0] == "init"}
    wait_at = events.index(("pdl_wait",))
    slot_of, release_of = {}, {}  # full barrier -> (operand, slot); empty barrier -> the same
    for i, event in enumerate(events):
        if event[0] == "copy":
            op, stage = event[3], stage_of(event)
            key = (op, stage % rings[op])
            assert offset(event[1]) == base[op] + key[1] * nbytes[op], (key, stage, offset(event[1]))
            assert counts[offset(event[2])] == 1 and slot_of.setdefault(offset(event[2]), key) == key
            assert op == 0 or i > wait_at, "q_c copied before the PDL wait"
        elif event[0] == "wait" and counts[offset(event[1])] == J.THREADS:
            refill = next(e for e in events[i:] if e[0] == "copy")
            key = (refill[3], stage_of(refill) % rings[refill[3]])
            assert release_of.setdefault(offset(event[1]), key) == key
        assert event[0] != "load" or i > wait_at, "a global read before the PDL wait"
    assert len(set(slot_of.values())) == len(slot_of) == sum(rings), "one full barrier per slot"

    def producer(event):
        return event[0] in ("init", "expect", "copy") or (event[0] == "wait" and counts[offset(event[1])] == J.THREADS)

    bars, in_flight, landed = {}, [], {}
    reading = {w: set() for w in range(J.WARPS)}
    fenced, reads, at_bar = [True] * J.WARPS, [0] * J.WARPS, [0] * J.WARPS

    def warp(w):
        for event in events:
            kind = event[0]
            if kind not in _SHARED_KINDS or (w != 0 and producer(event)):
                continue
            assert kind in ("init", "copy", "ldmatrix", "fence", "bar") or offset(event[1]) in bars, event
            if kind == "init":
                bars[offset(event[1])] = Mbarrier(event[2])
            elif kind == "expect":
                bars[offset(event[1])].arrive(expect=event[2])
            elif kind == "copy":
                key = slot_of[offset(event[2])]
                assert not any(key in r for r in reading.values()), f"copy into slot {key} while it is read"
                in_flight.append((key, stage_of(event), offset(event[2])))
            elif kind == "wait":
                while not bars[offset(event[1])].done(event[2]):
                    yield
            elif kind == "arrive":
                assert fenced[w], "a release without a proxy fence after the reads"
                bars[offset(event[1])].arrive(32)
                reading[w].discard(release_of.get(offset(event[1])))
            elif kind == "ldmatrix":
                terms, const = event[1]  # the slot's offset + the lane's (opaque, within a stage)
                assert "smem" in terms
                op = 1 if const >= base[1] else 0
                key, stage = (op, (const - base[op]) // nbytes[op]), reads[w] // per_stage
                assert landed.get(key) == stage, f"warp {w} reads {key} for stage {stage}: holds {landed.get(key)}"
                assert all(f[0] != key for f in in_flight), f"warp {w} reads {key} with a copy in flight"
                reads[w], fenced[w] = reads[w] + 1, False
                reading[w].add(key)
                yield  # the fragments' reads take a while
            elif kind == "fence":
                fenced[w] = True
            elif kind == "bar":
                at_bar[w] += 1
                while min(at_bar) < at_bar[w]:
                    yield
                assert at_bar[w] < 2 or (not in_flight and reads[w] == J.STAGES * per_stage)

    actors = {w: warp(w) for w in range(J.WARPS)}
    for _ in range(1_000_000):  # (a deadlock spins forever)
        if not actors:
            break
        pick = rng.choice(list(actors) + (["tma"] * 3 if in_flight else []))
        if pick == "tma":
            key, stage, bar = in_flight.pop(rng.randrange(len(in_flight)))
            landed[key] = stage
            bars[bar].complete_tx(nbytes[key[0]])
            continue
        try:
            next(actors[pick])
        except StopIteration:
            del actors[pick]
    assert not actors, "deadlock"
    assert not in_flight and all(r == J.STAGES * per_stage for r in reads)
    for bar, (op, slot) in slot_of.items():
        assert bars[bar].completed == -(-(J.STAGES - slot) // rings[op])


def _index_query_ptx_events(folder, tokens, rings):
    from graphstep.kernels import catalog

    op = index_query.IndexQuery(2304, 2240, tokens, True, True, True, rings)
    catalog.compile_op(op, index_query.compile_args(), "sm_90a", str(folder))
    (path,) = [p for p in folder.iterdir() if p.suffix == ".ptx"]
    return _ptx_events(path.read_text())


# session 10's depths as two equal rings (tests/test_indexer_gpu.py compares their outputs)
_EQUAL_RINGS = {16: (5, 5), 32: (4, 4), 64: (3, 3)}


@pytest.mark.parametrize("tokens", index_query.TOKENS)
def test_compiled_rings_read_each_stage_whole_and_never_overwrite_a_read_slot(tmp_path, tokens):
    for rings in (index_query.RINGS[tokens], _EQUAL_RINGS[tokens]):
        folder = tmp_path / f"{rings[0]}-{rings[1]}"
        events = _index_query_ptx_events(folder, tokens, rings)
        for seed in range(40):
            _run_ptx(events, tokens, rings, seed)


def test_compiled_ring_model_catches_a_wrong_parity_or_a_lost_release(tmp_path):
    """The PTX run is not vacuous: the last full-barrier wait on the other parity, or the
    last release dropped, must fail it."""
    tokens = 16
    rings = index_query.RINGS[tokens]
    events = _index_query_ptx_events(tmp_path, tokens, rings)
    waits = [i for i, e in enumerate(events) if e[0] == "wait"]
    last_release = max(i for i, e in enumerate(events) if e[0] == "arrive")
    flipped = list(events)
    flipped[waits[-1]] = (*events[waits[-1]][:2], 1 - events[waits[-1]][2])
    for broken in (flipped, events[:last_release] + events[last_release + 1 :]):
        with pytest.raises(AssertionError):
            _run_ptx(broken, tokens, rings, seed=0)
