"""SparseCore's crossover (sparse_core.CROSSOVER, partial_wgmma_ws in head-group pairs) on the
CPU: which launches take it, the rows each CTA's producer loads and pushes (the kernel's own
map, sparse_core_wgmma.producer_map), and a model of its mbarrier protocol run under random
interleavings -- full[s] (local arrivals + the peer's st.async bytes), empty[s] (both CTAs'
consumer warps), the two cluster barriers -- checking that every block a consumer reads is
whole, that no stage is rewritten under a reader (local or by the peer's pushes), that no
push or remote arrive reaches a CTA that has exited, and that nothing deadlocks. The same
model with the protocol's guards taken out finds each hazard they guard against. And the
wgmma descriptors of a cluster's rank-1 CTA (its shared addresses carry the rank)."""

import random

import pytest
from graphstep.kernels import catalog, sparse_core, sparse_core_layout, sparse_core_wgmma

from graphstep.shapes import RankShape, Topology, preset

TP1_FP8 = RankShape(preset("deepseek-v3.2"), Topology(tp=1, q_format="fp8", mla_cache="fp8"))
TP1_BF16 = RankShape(preset("deepseek-v3.2"), Topology(tp=1))


def test_the_crossover_is_the_fp8_caches_default_with_flashmlas_consumers():
    """On for the fp8 cache as measured (bench/RESULTS.md session 18 call H: wsxr), FlashMLA's
    consumer shape at every block count under it, the half-block scorers past RESHAPE_BLOCKS
    without it."""
    assert sparse_core.CROSSOVER == {"fp8": True, "bf16": True}  # as measured (session 21 call B)
    for batch in (1, 4, 16, 64):
        slots = sparse_core.plan(batch, TP1_FP8.q_heads, 2048, TP1_FP8.topology.mla_cache)
        op = catalog.build(TP1_FP8, "sparse_core", slots=slots).op
        assert op.crossover and op.reshape
        plain = catalog.build(TP1_FP8, "sparse_core", slots=slots, crossover=False).op
        assert not plain.crossover and plain.reshape == (slots // plain.block <= sparse_core.RESHAPE_BLOCKS)


def test_the_crossover_runs_only_where_a_64_row_producer_cta_has_a_partner():
    """A pair of 64-head CTAs (q_heads / 64 even) with a producer warpgroup, over either cache
    (the bf16 cache's producer then loads raw chunks), and 64-slot blocks; elsewhere the op
    is today's kernel (cluster 1) whatever was asked. Every 64-row CTA has the producer, so
    both caches cross over by default; producer=False is refused there."""
    for shape in (TP1_FP8, TP1_BF16):
        for slots in (64, 128, 512, 2048):
            variant = catalog.build(shape, "sparse_core", slots=slots, producer=True, crossover=True)
            op = variant.op
            assert op.crossover and op.producer and op.wgmma and op.block == 64 and not op.clustered
            assert variant.name.endswith("_x")
        assert not catalog.build(shape, "sparse_core", slots=32, producer=True, crossover=True).op.crossover
        with pytest.raises(ValueError, match="64-row CTAs always have a producer"):
            catalog.build(shape, "sparse_core", slots=2048, producer=False, crossover=True)
    assert catalog.build(TP1_FP8, "sparse_core", slots=2048, crossover=True).op.crossover  # its default producer
    assert catalog.build(TP1_BF16, "sparse_core", slots=2048, crossover=True).op.crossover  # bf16's producer
    others = {
        "64 heads": RankShape(preset("kimi-k3.1"), Topology(tp=1, mla_cache="fp8")),
        "tp8": RankShape(preset("deepseek-v3.2"), Topology(tp=8, mla_cache="fp8")),
        "dcp2": RankShape(preset("kimi-k3.1"), Topology(tp=8, dcp=2, rank=1, q_format="fp8", mla_cache="fp8")),
    }
    for name, shape in others.items():
        op = catalog.build(shape, "sparse_core", slots=2048, crossover=True).op
        assert not op.crossover, name
        assert catalog.build(shape, "sparse_core", slots=2048, crossover=True).name.endswith("_nox"), name


def test_each_cta_of_the_pair_loads_half_of_every_row_chunk_once_and_pushes_xover_bytes():
    """producer_map at 64-slot blocks: share v of the 128 producer threads is rows 32 v ..
    32 v + 31, every 16-byte chunk of them once (18 chunks a thread: 16 of latent, 2 of rope),
    so CTA rank v pushes 128 x 18 x 16 = XOVER_BYTES into its peer a block, what the peer's
    full[s] expects; the two shares are the block's 64 rows (the unpaired kernel's map)."""
    block, chunks = 64, sparse_core_wgmma.TILE_CHUNKS
    step = 8 // (block // 8)
    per_thread = (chunks // 4 + step - 1) // step
    assert per_thread == 18
    shares = []
    for v in range(2):
        seen = []
        for ptid in range(128):
            r, cg0, q4 = sparse_core_wgmma.producer_map(ptid, v, block)
            seen += [(r, 4 * (cg0 + step * j) + q4) for j in range(per_thread)]
        assert len(seen) == len(set(seen))
        assert set(seen) == {(r, c) for r in range(32 * v, 32 * v + 32) for c in range(chunks)}
        assert 16 * len(seen) == sparse_core_wgmma.XOVER_BYTES == sparse_core_wgmma.XOVER_ROWS * chunks * 16 == 36864
        shares.append(set(seen))
    assert shares[0] | shares[1] == {(r, c) for r in range(64) for c in range(chunks)}


# -- a model of the protocol ------------------------------------------------------------------


class Violation(AssertionError):
    pass


class Barrier:
    """An mbarrier: arrivals a phase, a signed tx-count; `done` phases completed so far."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.done = count, count, 0, 0

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.done, self.pending = self.done + 1, self.count

    def arrive(self, expect: int = 0):
        self.tx += expect
        self.pending -= 1
        if self.pending < 0:
            raise Violation("more arrivals than a phase counts")
        self._complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._complete()

    def ready(self, phase: int) -> bool:
        """mbarrier.try_wait.parity for `phase`: the parity test is right only while the
        barrier is at most one phase past it."""
        if self.done > phase + 1:
            raise Violation(f"barrier ran {self.done - phase - 1} phases past a waiter (parity aliasing)")
        return self.done > phase


UNITS = 2  # stores a producer splits its half of a block into (each local + a push of BYTES)
BYTES = sparse_core_wgmma.XOVER_BYTES // UNITS
WARPS = 8  # consumer warps a CTA


def run_model(
    blocks: int, seed: int, remote_empty=True, skip_last_two=True, closing_barrier=True, expect=True, steps=200000
):
    """Two CTAs (rank 0, 1), each a producer and WARPS consumer warps, as generators that
    yield what they wait for; pushes and remote arrives are messages delivered at a random
    later step. Raises Violation on a hazard, returns the number of steps."""
    rng = random.Random(seed)
    full = [[Barrier(128) for _ in range(2)] for _ in range(2)]
    empty = [[Barrier(WARPS * (2 if remote_empty else 1)) for _ in range(2)] for _ in range(2)]
    content = [[[[None] * UNITS for _ in range(2)] for _ in range(2)] for _ in range(2)]  # [cta][stage][half][unit]
    reading = [[0, 0] for _ in range(2)]
    exited = [False, False]
    agents_left = [1 + WARPS, 1 + WARPS]
    cluster = {"arrived": [0, 0, 0], "total": 2 * (1 + WARPS)}
    messages = []

    def write(cta, s, half, unit, b):
        if reading[cta][s]:
            raise Violation(f"stage {s} of CTA {cta} rewritten (block {b}) while its consumers read it")
        content[cta][s][half][unit] = b

    def producer(c):
        peer = 1 - c
        cluster["arrived"][0] += 1
        yield lambda: cluster["arrived"][0] == cluster["total"]  # the peer's mbarriers initialized
        for b in range(blocks):
            s = b % 2
            if b >= 2:
                yield lambda s=s, b=b: empty[c][s].ready((b - 2) // 2)
            for u in range(UNITS):
                write(c, s, c, u, b)
                messages.append(("push", peer, s, c, u, b))
                yield None  # other agents may run between the stores
            # thread 0's arrival (with the peer's bytes expected) and the other 127 threads' in
            # three groups, in any order
            arrivals = [sparse_core_wgmma.XOVER_BYTES if expect else -1, 0, 0, 0]
            rng.shuffle(arrivals)
            groups = iter([42, 42, 43])
            for nbytes in arrivals:
                for _ in range(1 if nbytes else next(groups)):
                    full[c][s].arrive(max(nbytes, 0))
                yield None
        if closing_barrier:
            cluster["arrived"][1] += 1
            yield lambda: cluster["arrived"][1] == cluster["total"]

    def consumer(c, w):
        peer = 1 - c
        cluster["arrived"][0] += 1
        yield None  # (the query tile)
        yield lambda: cluster["arrived"][0] == cluster["total"]
        for b in range(blocks):
            s = b % 2
            yield lambda s=s, b=b: full[c][s].ready(b // 2)
            if any(content[c][s][h][u] != b for h in range(2) for u in range(UNITS)):
                raise Violation(f"CTA {c} block {b}: stage {s} holds {content[c][s]}")
            reading[c][s] += 1
            yield None  # the warp's wgmmas over the stage
            reading[c][s] -= 1
            empty[c][s].arrive()
            if remote_empty and (b < blocks - 2 or not skip_last_two):
                messages.append(("arrive", peer, s))
            yield None
        if closing_barrier:
            cluster["arrived"][1] += 1
            yield None  # finish_wgmma
            yield lambda: cluster["arrived"][1] == cluster["total"]

    agents = [(c, producer(c)) for c in range(2)] + [(c, consumer(c, w)) for c in range(2) for w in range(WARPS)]
    waits = {i: None for i in range(len(agents))}
    live = set(range(len(agents)))

    def deliver(message):
        target = message[1]
        if exited[target]:
            raise Violation(f"{message[0]} reached CTA {target} after it exited")
        if message[0] == "push":
            _, _, s, half, unit, b = message
            write(target, s, half, unit, b)
            full[target][s].complete_tx(BYTES)
        else:
            empty[target][message[2]].arrive()

    for step in range(steps):
        runnable = [i for i in live if waits[i] is None or waits[i]()]
        if not runnable and not messages:
            if live:
                raise Violation("deadlock")
            return step
        if messages and (not runnable or rng.random() < 0.3):
            deliver(messages.pop(rng.randrange(len(messages))))
            continue
        i = rng.choice(runnable)
        c, gen = agents[i]
        try:
            waits[i] = next(gen)
        except StopIteration:
            live.discard(i)
            agents_left[c] -= 1
            if agents_left[c] == 0:
                exited[c] = True
    raise Violation("did not finish")


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 7, 32])
def test_the_crossover_protocol_is_safe_under_random_interleavings(blocks):
    for seed in range(60 if blocks < 32 else 10):
        run_model(blocks, seed)


@pytest.mark.parametrize(
    "guard, hazard",
    [
        ({"remote_empty": False}, "rewritten"),  # empty[s] counting only this CTA's consumers
        ({"expect": False}, "holds"),  # full[s] not waiting for the peer's bytes
        ({"skip_last_two": False, "closing_barrier": False}, "after it exited"),
    ],
)
def test_the_model_finds_the_hazards_the_protocol_guards_against(guard, hazard):
    found = []
    for seed in range(200):
        try:
            run_model(6, seed, **guard)
        except Violation as violation:
            found.append(str(violation))
    assert any(hazard in v for v in found), found[:3]


# -- the wgmma descriptors in a cluster -------------------------------------------------------


def _descriptor(lines: list, address: int) -> int:
    """The 64-bit value primitives.smem_desc_lines' PTX leaves in its register for the 32-bit
    shared address `address` (its cvt / shr / and / or, evaluated)."""
    value = None
    for line in lines:
        op, args = line.rstrip(";").split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "cvt.u64.u32":
            value = address & 0xFFFFFFFF
        elif op == "shr.u64":
            value >>= int(args[2], 0)
        elif op == "and.b64":
            value &= int(args[2], 0)
        elif op == "or.b64":
            value |= int(args[2], 0)
        else:
            raise AssertionError(f"unexpected descriptor line {line!r}")
    return value


def _fields(desc: int) -> tuple:
    """(start address, leading byte offset, stride byte offset) of a wgmma descriptor, in bytes."""
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def test_the_descriptors_ignore_the_cta_rank_a_cluster_puts_in_shared_addresses():
    """In a cluster launch a CTA's 32-bit shared addresses carry its rank in the cluster from
    bit 24 up (SASS: the shared base is SR_CgaCtaId << 24 | offset), so the crossover's rank-1
    CTA (heads 64 .. 127 at TP 1) hands partial_wgmma_ws's wgmmas addresses 1 << 24 above rank
    0's. Its descriptors must be rank 0's: the start address field holds bits 4 .. 17 only,
    the leading / stride byte offsets (Q, K and P: CHUNK / 128 B; V: 128 B / CHUNK) intact.
    Shifted down unmasked, bit 24 lands in the leading byte offset (+256 B): the session-18
    crossover failures (rank 1's rows read 16 rows off, past p_s into ids_s / red)."""
    from graphstep.kernels import primitives as P

    W = sparse_core_wgmma
    offsets = [0x400 + k * W.TILE_BYTES for k in range(4)]  # q_s, kv_s's two stages, p_s (the SASS's shared base 0x400)
    layouts = {"K": (W.DESC_K, W.CHUNK, 128), "V": (W.DESC_V, 128, W.CHUNK)}
    for name, (layout, lbo, sbo) in layouts.items():
        lines = P.smem_desc_lines("d", "{$r0}", layout)
        for offset in offsets:
            assert offset < sparse_core_layout.SMEM_BYTES < 1 << 18
            ranks = [_descriptor(lines, rank << 24 | offset) for rank in range(2)]
            assert ranks[0] == ranks[1], name
            assert _fields(ranks[1]) == (offset, lbo, sbo), name
        # the unmasked encoding (the bug) moves rank 1's leading byte offset
        unmasked = [line for line in lines if not line.startswith("and.b64")]
        assert _fields(_descriptor(unmasked, 1 << 24 | offsets[0]))[1] == lbo + 256, name
