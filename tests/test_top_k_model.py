"""CPU models of ClusterTopK's no-list compaction (kernels/top_k.py `ClusterTopK.compact`): its
raw-word threshold test and its valid-score masks bit for bit, and its ranking (bit masks,
byte counts scanned over a warp's lanes, one scan of the (load, warp) groups, a loop over
each thread's set bits) against the reference's kept set in index order. The models' word
functions (order_key, raw_bound, bin_test, nibble_counts, valid_masks) are Python-int
transcriptions of the kernel's, fast enough for the models' loops; the last test runs the
kernel's own functions on Python ints (Uint32 / select / min / max stand-ins that compute what
the device instructions do) and checks each transcription against them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from graphstep.kernels import top_k

ALL = 2**31 - 1
M32 = 0xFFFFFFFF


class U32(int):
    """A Python int as a 32-bit unsigned register: every result wraps mod 2^32."""

    def __new__(cls, value):
        return super().__new__(cls, int(value) & M32)

    def __add__(self, other):
        return U32(int(self) + int(other))

    def __sub__(self, other):
        return U32(int(self) - int(other))

    def __rsub__(self, other):
        return U32(int(other) - int(self))

    def __mul__(self, other):
        return U32(int(self) * int(other))

    def __and__(self, other):
        return U32(int(self) & int(other))

    def __or__(self, other):
        return U32(int(self) | int(other))

    def __xor__(self, other):
        return U32(int(self) ^ int(other))

    def __lshift__(self, other):
        return U32(int(self) << int(other))

    def __rshift__(self, other):
        return U32(int(self) >> int(other))

    def __invert__(self):
        return U32(~int(self))

    __radd__, __rmul__, __rand__, __ror__, __rxor__ = __add__, __mul__, __and__, __or__, __xor__


def _select(condition, a, b):
    return a if condition else b


@pytest.fixture
def python_ints():
    """kernels/top_k.py's device types and selects as Python stand-ins, during one test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(top_k, "Uint32", U32)
        patch.setattr(top_k, "cutlass", SimpleNamespace(select_=_select, min=min, max=max))
        patch.setattr(top_k, "P", SimpleNamespace(select_i32=_select))
        yield


def order_key(word: int) -> int:
    """top_k.order_key on a Python int."""
    word = 0 if word == 0x80000000 else word
    return word ^ (0xFFFFFFFF if word >> 31 else 0x80000000)


def raw_bound(threshold: int) -> tuple:
    """top_k.raw_bound."""
    flip = 0x80000000 if threshold > 0x80000000 else 0xFFFFFFFF
    return flip, threshold - (threshold == 0x80000000)


SPECIAL = [0, 1, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xBF800000, 0xFF800000]
SPECIAL += [0xFFC00000, 0xFFFFFFFF, 0x3F800000, 0x3F800001, 0x3F7FFFFF, 0x00000002, 0x807FFFFF]


def test_raw_word_threshold_test_equals_the_order_key_compare():
    """(w ^ flip) >= bound exactly when order_key(w) >= T, for every T an order key can be
    (+-0, +-inf, NaNs, denormals, neighbours of each), -0.0 with +0.0 included."""
    rng = random.Random(5)
    words = SPECIAL + [w ^ 1 for w in SPECIAL] + [rng.getrandbits(32) for _ in range(3000)]
    thresholds = sorted({order_key(w) for w in words} | {0, 1, 0x7FFFFFFE, 0x7FFFFFFF, 0x80000001, M32})
    for threshold in thresholds:
        flip, bound = raw_bound(threshold)
        for w in words:
            assert ((w ^ flip) >= bound) == (order_key(w) >= threshold), (hex(threshold), hex(w))


def valid_masks(limit: int, threads: int, loads: int) -> list:
    """ClusterTopK.valid_masks (Int32 arithmetic on Python ints)."""
    full = min(max(limit - 1, 0) // (4 * threads), loads)
    count = 4 * loads if full >= loads else 4 * full + min(limit - 4 * threads * full, 4)
    count = max(count, 0)
    masks = []
    for i in range((4 * loads + 31) // 32):
        bits = min(max(count - 32 * i, 0), 32)
        masks.append(M32 if bits >= 32 else (1 << min(bits, 31)) - 1)
    return masks


@pytest.mark.parametrize("threads, loads", [(1024, 16), (1024, 8), (512, 4), (512, 1), (64, 16)])
def test_valid_masks_hold_exactly_the_scores_below_the_limit(threads, loads):
    for limit in [-5000, -1, 0, 1, 2, 3, 4, 5, 4 * threads - 1, 4 * threads, 4 * threads + 3, 4 * threads * loads]:
        for extra in (0, 1, 7, 4 * threads * 3 + 2, 10**6):
            lim = limit + extra
            masks = valid_masks(lim, threads, loads)
            for u in range(loads):
                for j in range(4):
                    bit = (masks[u // 8] >> (4 * (u % 8) + j)) & 1
                    assert bit == (4 * threads * u + j < lim), (lim, u, j)


def nibble_counts(mask: int) -> list:
    mask = (mask - ((mask >> 1) & 0x55555555)) & M32
    mask = (mask & 0x33333333) + ((mask >> 2) & 0x33333333)
    return [mask & 0x0F0F0F0F, (mask >> 4) & 0x0F0F0F0F]


def compact_cta(raw, keyed_loads, n_cta, threshold, need, lower, threads, loads, at_shift=12):
    """One CTA's compact(): raw[t][u][j] its fp32 words (load u of thread t), the loads
    below keyed_loads compared as order keys (held), the rest raw (stashed); n_cta: the
    row's scores from this CTA's first. -> {position: offset}."""
    warps = threads // 32
    words = (4 * loads + 31) // 32
    counted = 2 * words
    ties = need != ALL
    above_lower, at_lower = lower
    if not ties:
        above_lower, at_lower = above_lower + at_lower, 0
    flip, bound = raw_bound(threshold)
    above, equal, lanes_a, lanes_e = [], [], [], []
    table_a, table_e = {}, {}
    for warp in range(warps):
        counts_a, counts_e = [], []
        for lane in range(32):
            tid = 32 * warp + lane
            valid = valid_masks(n_cta - 4 * tid, threads, loads)
            at_least, eq = [0] * words, [0] * words
            for u in range(loads):
                for j in range(4):
                    w = raw[tid][u][j]
                    hit = order_key(w) >= threshold if u < keyed_loads else (w ^ flip) >= bound
                    at_least[u // 8] |= hit << (4 * (u % 8) + j)
                    if ties:
                        eq[u // 8] |= (order_key(w) == threshold) << (4 * (u % 8) + j)
            at_least = [at_least[i] & valid[i] for i in range(words)]
            eq = [eq[i] & valid[i] for i in range(words)]
            ab = [at_least[i] & ~eq[i] & M32 for i in range(words)]
            above.append(ab)
            equal.append(eq)
            counts_a.append([c for i in range(words) for c in nibble_counts(ab[i])])
            counts_e.append([c for i in range(words) for c in nibble_counts(eq[i])])
        for counts, lanes, table in ((counts_a, lanes_a, table_a), (counts_e, lanes_e, table_e)):
            inclusive = [[0] * counted for _ in range(32)]
            for q in range(counted):
                total = 0
                for lane in range(32):
                    total += counts[lane][q]  # bytes: no carry (at most 128 a byte)
                    assert all(((total >> (8 * m)) & 0xFF) <= 128 for m in range(4))
                    inclusive[lane][q] = total
            for lane in range(32):
                lanes.append([inclusive[lane][q] - counts[lane][q] for q in range(counted)])
            table[warp] = inclusive[31]
    # 3. the (load, warp) groups in index order
    group_before, running = {}, 0
    for u in range(loads):
        for w in range(warps):
            q, shift = 2 * (u // 8) + u % 2, 8 * ((u % 8) // 2)
            group = (table_a[w][q] >> shift) & 0xFF
            if ties:
                group |= ((table_e[w][q] >> shift) & 0xFF) << at_shift
            group_before[(u, w)] = running
            running += group
    assert running < 2**32
    # 4. each thread's set bits
    placed = {}
    for tid in range(threads):
        warp = tid // 32
        for i in range(words):
            pending = above[tid][i] | equal[tid][i]
            while pending:
                low = pending & -pending
                b = (low - 1).bit_count()
                pending ^= low
                u, j = 8 * i + (b >> 2), b & 3
                nibble, earlier, byte, odd = b & ~3, (1 << j) - 1, 8 * (b >> 3), (b >> 2) & 1
                group = group_before[(u, warp)]
                above_before = above_lower + (group & ((1 << at_shift) - 1))
                above_before += ((above[tid][i] >> nibble) & earlier).bit_count()
                above_before += (lanes_a[tid][2 * i + odd] >> byte) & 0xFF
                at_before = at_lower + (group >> at_shift) + ((equal[tid][i] >> nibble) & earlier).bit_count()
                at_before += (lanes_e[tid][2 * i + odd] >> byte) & 0xFF
                if (above[tid][i] >> b) & 1 or at_before < need:
                    position = above_before + min(at_before, need)
                    assert position not in placed
                    placed[position] = 4 * (threads * u + tid) + j
    return placed


def _row(kind: str, width: int, rng: random.Random) -> list:
    import struct

    def bits(x: float) -> int:
        return struct.unpack("<I", struct.pack("<f", x))[0]

    if kind == "continuous":
        return [bits(rng.gauss(0, 1)) for _ in range(width)]
    if kind == "ties":  # few values, -0.0 and +0.0 among them
        return [rng.choice([bits(-1.0), 0x80000000, 0, bits(0.5), bits(2.0), bits(-3.0)]) for _ in range(width)]
    if kind == "clustered":  # the best scores in one contiguous stretch: most groups empty, a few full
        row = [bits(rng.uniform(-2, -1)) for _ in range(width)]
        start = rng.randrange(width // 2)
        for i in range(start, start + 3000):
            row[i % width] = bits(rng.uniform(1, 2))
        return row
    if kind == "spread":  # one score above the rest in every (load, warp) group
        row = [bits(rng.uniform(-2, -1)) for _ in range(width)]
        for i in range(0, width, 128):
            row[i + rng.randrange(128)] = bits(rng.uniform(1, 2))
        return row
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["continuous", "ties", "clustered", "spread"])
@pytest.mark.parametrize("n_cut", [0, 1, 2, 3])
def test_compaction_model_places_the_reference_top_k_in_index_order(kind, n_cut):
    """Two CTAs of 64 threads x 64 scores; the row's kept set (every key > T, the first
    `need` == T by index) must land at positions 0.. in ascending index, each once, with
    the lower CTA's counts as offsets (ALL: only their sum, split arbitrarily here)."""
    rng = random.Random(f"{kind}{n_cut}")
    ctas, threads, loads, k = 2, 64, 16, 700
    per_cta = 4 * threads * loads
    width = ctas * per_cta
    n = width - [0, 1, 4097, per_cta + 5][n_cut]  # whole, a partial vector, CTA 1 partly, CTA 0 only
    row = _row(kind, width, rng)
    keys = [order_key(w) for w in row[:n]]
    ranked = sorted(range(n), key=lambda i: (-keys[i], i))
    threshold = keys[ranked[k - 1]]
    above_count = sum(key > threshold for key in keys)
    at_count = sum(key == threshold for key in keys)
    need = k - above_count
    if need == at_count:
        need = ALL
    kept = sorted(i for i in range(n) if keys[i] > threshold or (keys[i] == threshold and need == ALL))
    if need != ALL:
        at = [i for i in range(n) if keys[i] == threshold][:need]
        kept = sorted(kept + at)
    assert len(kept) == k
    out = {}
    lower_above = lower_at = 0
    for c in range(ctas):
        base = c * per_cta
        raw = [
            [[row[base + 4 * (threads * u + t) + j] for j in range(4)] for u in range(loads)] for t in range(threads)
        ]
        lower = (lower_above, lower_at)
        if need == ALL and c > 0:  # only the sum matters
            shift = rng.randrange(lower_above + lower_at + 1)
            lower = (shift, lower_above + lower_at - shift)
        placed = compact_cta(raw, 4, n - base, threshold, need, lower, threads, loads)
        for position, offset in placed.items():
            assert position not in out
            out[position] = base + offset
        cta_keys = keys[base : base + per_cta]
        lower_above += sum(key > threshold for key in cta_keys)
        lower_at += sum(key == threshold for key in cta_keys)
    assert [out.get(p) for p in range(k)] == kept
    assert len(out) == k


def bin_test(prefix: int) -> tuple:
    """top_k.bin_test: (scale, offset, width) of round 0's bin `prefix`."""
    lowest = prefix << 21
    if prefix > 0x400:
        return 1, (0x80000000 - lowest) & M32, 1 << 21
    if prefix == 0x400:
        return 2, 0, 2 << 21
    return M32, ~lowest & M32, 1 << 21


def test_bin_test_passes_every_word_of_its_bin():
    """(w x scale + offset) mod 2^32 < width for every raw word whose order key is in the bin
    (-0.0 in +0.0's, 0x400), on all 2048 bins; exact on positive scores' bins, and few extra
    words elsewhere (the bins of the same tiny magnitudes, -0.0, NaNs)."""
    rng = random.Random(11)
    words = SPECIAL + [w ^ 1 for w in SPECIAL] + [rng.getrandbits(32) for _ in range(4000)]
    for prefix in range(2048):  # each bin's edges, as keys, and their raw words
        for key in (prefix << 21, (prefix << 21) + 1, ((prefix + 1) << 21) - 1):
            for k in (key - 1, key, key + 1):
                k &= M32
                words.append(k ^ 0x80000000 if k >> 31 else ~k & M32)
    words = sorted(set(words))
    for prefix in range(2048):
        scale, offset, width = bin_test(prefix)
        passed = {w for w in words if (w * scale + offset) & M32 < width}
        inside = {w for w in words if order_key(w) >> 21 == prefix}
        assert inside <= passed, (hex(prefix), [hex(w) for w in sorted(inside - passed)])
        extra = passed - inside
        if prefix > 0x400:
            assert not extra, (hex(prefix), [hex(w) for w in sorted(extra)][:5])
        elif prefix == 0x400:  # the negative scores of +0.0's bin's magnitudes
            assert all(w >> 31 and (w & 0x7FFFFFFF) < 1 << 21 for w in extra)
        else:  # -0.0 (bin 0x3FF) and NaNs 0x7FE00001.. only
            assert all(w == 0x80000000 or 0x7FE00000 < w <= 0x7FFFFFFF for w in extra), [hex(w) for w in extra]


def histogram_bits_thread(raw, keys_held, limit_t, held, loads, threads, rounds_prefix) -> dict:
    """One thread's increments in ClusterTopK.histogram_bits (rounds_prefix = (round, its
    prefix, round 0's bin)): the held keys straight, the stashed words at bin_masks' bits."""
    r, prefix, prefix0 = rounds_prefix
    shift, bits = ((21, 11), (10, 11), (0, 10))[r]
    hist = {}
    for u in range(held):
        for j in range(4):
            key = keys_held[u][j]
            if 4 * threads * u + j < limit_t and key >> (shift + bits) == prefix:
                digit = (key >> shift) & ((1 << bits) - 1)
                hist[digit] = hist.get(digit, 0) + 1
    scale, offset, width = bin_test(prefix0)
    near = [0, 0]
    for u in range(held, loads):
        for j in range(4):
            if (raw[u][j] * scale + offset) & M32 < width:
                near[u // 8] |= 1 << (4 * (u % 8) + j)
    valid = valid_masks(limit_t, threads, loads)
    for i in range((4 * loads + 31) // 32):
        pending = near[i] & valid[i]
        while pending:
            low = pending & -pending
            b = (low - 1).bit_count()
            pending ^= low
            u, j = 8 * i + (b >> 2), b & 3
            assert u >= held
            key = order_key(raw[u][j])
            if key >> (shift + bits) == prefix:
                digit = (key >> shift) & ((1 << bits) - 1)
                hist[digit] = hist.get(digit, 0) + 1
    return hist


@pytest.mark.parametrize("kind", ["continuous", "ties", "clustered", "spread", "zeros"])
@pytest.mark.parametrize("n_cut", [0, 1, 2, 3])
def test_histogram_bits_model_counts_as_the_whole_slice_histogram(kind, n_cut):
    """Rounds 1 and 2 over bin_masks' bits (c2x1024x64's layout: 16 loads, 12 stashed; 64
    threads here) count exactly what `histogram` counts over the whole slice."""
    rng = random.Random(f"bits{kind}{n_cut}")
    threads, loads, held = 64, 16, 4
    per_cta = 4 * threads * loads
    n = per_cta - [0, 1, 1001, per_cta - 5][n_cut]
    if kind == "zeros":  # +0.0 and -0.0 mixed with tiny values of both signs: +0.0's bin
        row = [rng.choice([0, 0x80000000, 1, 0x80000001, 0x3F800000, 0xBF800000]) for _ in range(per_cta)]
    else:
        row = _row(kind, per_cta, rng)
    raw = [[[row[4 * (threads * u + t) + j] for j in range(4)] for u in range(loads)] for t in range(threads)]
    keys = [order_key(w) for w in row[:n]]
    k = min(700, n - 1)
    threshold = sorted(keys, reverse=True)[k - 1]
    prefixes = (threshold >> 21, threshold >> 10)
    for r in (1, 2):
        prefix = prefixes[r - 1]
        shift, bits = ((21, 11), (10, 11), (0, 10))[r]
        want = {}
        for key in keys:
            if key >> (shift + bits) == prefix:
                digit = (key >> shift) & ((1 << bits) - 1)
                want[digit] = want.get(digit, 0) + 1
        got = {}
        for t in range(threads):
            keys_held = [[order_key(w) for w in raw[t][u]] for u in range(held)]
            search = (r, prefix, prefixes[0])
            part = histogram_bits_thread(raw[t], keys_held, n - 4 * t, held, loads, threads, search)
            for digit, c in part.items():
                got[digit] = got.get(digit, 0) + c
        assert got == want, (r, hex(prefix))


def test_the_models_word_functions_are_the_kernels(python_ints):
    """Each transcription below equals kernels/top_k.py's function run on Python ints: on the
    special words and their neighbours, random words, every round-0 bin, every mask word."""
    rng = random.Random()
    words = SPECIAL + [w ^ 1 for w in SPECIAL] + [rng.getrandbits(32) for _ in range(2000)]
    for w in words:
        assert order_key(w) == top_k.order_key(U32(w)), hex(w)
        assert raw_bound(w) == tuple(top_k.raw_bound(U32(w))), hex(w)
        assert nibble_counts(w) == top_k.nibble_counts(U32(w)), hex(w)
    for prefix in range(2048):
        assert bin_test(prefix) == tuple(top_k.bin_test(U32(prefix))), prefix
    for threads, loads in [(1024, 16), (1024, 8), (512, 4), (512, 1), (64, 16)]:
        for limit in [-5000, -1, 0, 1, 3, 4, 5, 4 * threads - 1, 4 * threads, 4 * threads * loads, 10**6]:
            for extra in (0, 1, 7, rng.randrange(4 * threads * loads)):
                kernel = top_k.ClusterTopK.valid_masks(SimpleNamespace(threads=threads, loads=loads), limit + extra)
                assert valid_masks(limit + extra, threads, loads) == kernel, (threads, loads, limit + extra)
