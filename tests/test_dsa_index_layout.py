"""DsaIndex's k order and shared-memory layout on the CPU, against the wgmma fragment
layouts of the PTX ISA (as CUTLASS writes them: ALayout_64x16, CLayout_64x64, and the
K-major no-swizzle canonical layout ((8, n), 2) : ((16 B, SBO), LBO)).

The kernel's threads build A registers from key bytes and write the query rows to shared
memory with kernels/dsa_index.py's index functions; this model runs those functions for
every thread, assembles what the hardware would read, and checks D = keys @ queries^T
exactly, and that the epilogue's accumulator index names the (key, head) it claims."""

import torch
from graphstep.kernels import dsa_index as D

from graphstep import formats

KEYS, HEADS, DIM = D.PAGE, D.HEADS, D.DIM


def _fp8_page(gen, rows):
    """Random finite e4m3 bytes [rows, 128] and their values (fp64)."""
    raw = torch.randint(0, 256, (rows, DIM), generator=gen, dtype=torch.int32).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaNs
    return raw, formats.fp8_to_float(raw).double()


def _a_registers(values):
    """A[s][m, k] as the hardware reads the threads' registers (ALayout_64x16: thread
    t + 4 g + 32 w, register r, half j -> row g + 16 w + 8 (r % 2), k 2 t + j + 8 (r // 2))."""
    a = torch.full((8, KEYS, 16), float("nan"), dtype=torch.float64)
    for w in range(4):
        for g in range(8):
            for t in range(4):
                rows = [16 * w + g, 16 * w + g + 8]
                # the thread's 32 bytes of each row, paired: pair q = bytes 2 q, 2 q + 1
                halves = [
                    [(values[row, D.key_byte(2 * q, t)], values[row, D.key_byte(2 * q + 1, t)]) for q in range(16)]
                    for row in rows
                ]
                for s in range(8):
                    for r, pair in enumerate(D.a_fragment(halves, s)):
                        for j in range(2):
                            m, k = g + 16 * w + 8 * (r % 2), 2 * t + j + 8 * (r // 2)
                            assert torch.isnan(a[s, m, k]), "each A element once"
                            a[s, m, k] = pair[j]
    assert not torch.isnan(a).any()
    return a


def _query_smem(values):
    """The fp16 query rows in shared memory, by byte offset -> value, as stage_queries
    writes them (thread tid = 32 warp + lane, load j: the 16 bytes at query_slice, word m of
    them, byte pair `high` of the word to query_target's chunk and position)."""
    smem = {}
    loaded = set()
    for tid in range(D.CONSUMERS):
        lane, warp = tid % 32, tid // 32
        for j in range(4):
            head, byte = D.query_slice(j, lane, warp)
            assert byte % 16 == 0 and (head, byte) not in loaded
            loaded.add((head, byte))
            for m in range(4):
                for high in range(2):
                    chunk, tt = D.query_target(byte, m, high)
                    for e in range(2):
                        offset = D.query_offset(chunk, head) + 4 * tt + 2 * e
                        assert offset not in smem
                        smem[offset] = values[head, byte + 4 * m + 2 * high + e]
    assert len(loaded) == HEADS * DIM // 16, "every 16 bytes of the rows loaded once"
    assert len(smem) == HEADS * DIM and max(smem) < D.QUERY_BYTES
    return smem


def _b_operand(smem, s):
    """B[k, n] of k16 step s as wgmma reads it through the descriptor (start s x STEP_BYTES,
    LBO and SBO decoded from the descriptor bits the kernel ORs in)."""
    lbo = ((D.DESC_LAYOUT >> 16) & 0x3FFF) << 4
    sbo = ((D.DESC_LAYOUT >> 32) & 0x3FFF) << 4
    assert D.DESC_LAYOUT >> 62 == 0  # layout type 0: no swizzle
    b = torch.empty(16, HEADS, dtype=torch.float64)
    for k in range(16):
        for n in range(HEADS):
            b[k, n] = smem[s * D.STEP_BYTES + (n // 8) * sbo + (n % 8) * 16 + (k // 8) * lbo + (k % 8) * 2]
    return b


def test_wgmma_operands_compute_keys_times_queries_exactly():
    gen = torch.Generator().manual_seed(0)
    _, keys = _fp8_page(gen, KEYS)
    _, queries = _fp8_page(gen, HEADS)
    a = _a_registers(keys)
    smem = _query_smem(queries)
    d = sum(a[s] @ _b_operand(smem, s) for s in range(8))
    assert torch.equal(d, keys @ queries.T)


def test_accumulator_index_matches_the_wgmma_accumulator_layout():
    # CLayout_64x64: thread t + 4 g + 32 w, value v -> row g + 16 w + 8 ((v // 2) % 2),
    # column 2 t + v % 2 + 8 (v // 4)
    for v in range(32):
        r, e, nt = (v // 2) % 2, v % 2, v // 4
        assert D.accumulator(nt, r, e) == v


def test_e4m3_widens_exactly_to_fp16():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (raw & 0x7F) != 0x7F
    wide = formats.fp8_to_float(raw)[finite]
    assert torch.equal(wide.half().float(), wide)


def test_host_runs_fill_the_gpu_and_bound_the_waves():
    for batch, pages, run in [
        (1, 512, 2),
        (4, 512, 8),
        (8, 512, 16),
        (16, 512, 16),
        (64, 512, 32),
        (1, 2048, 4),
        (4, 2048, 16),
        (8, 2048, 32),
        (16, 2048, 32),
        (64, 2048, 32),
        (1, 1, 2),
    ]:
        assert D.pages_per_cta(batch, pages) == run, (batch, pages)
        assert run in D.CTA_PAGES
    grid = D.grid_for(3, 2049, 32)
    assert grid == (65, 3)
