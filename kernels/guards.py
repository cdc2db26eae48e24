"""The range checks of the kernels that address memory with ids from the step's inputs, and
the record each one leaves in the step's error word on an out-of-range id.

An out-of-range id never causes an access out of bounds: a slot write is skipped, a page
or slot read is a hole (its scores -inf, never selected, slot -1), a RoPE row read at
length - 1 is clamped to row 0. The kernel records (check, token, value) with one 64-bit
atomic min at int32 words 2-3 (bytes 8 .. 15) of the error word (int32 [4] for an op, [6]
for the step; words 0-1 are the polls' flag and chunk):

    record = check << 56 | token << 32 | value as uint32        (empty: 2**63 - 1)

so the lowest check, in the step's order, then the lowest token, wins whatever the order
the CTAs ran in; the host reads it with the polls' word in one transfer. Plain Python (no
cutlass import): graphstep reads these numbers too.
"""

from __future__ import annotations

# check id -> (kernel, what the value is, what it must be in); ids in the step's data-path order
CHECKS = {
    1: ("IndexKey", "slot_mapping", "the indexer cache's slots"),
    2: ("IndexKey", "context_lens", "the RoPE table's rows"),
    3: ("MlaQuery", "slot_mapping", "the MLA cache's slots"),
    4: ("MlaQuery", "context_lens", "the RoPE table's rows"),
    5: ("IndexQuery", "context_lens", "the RoPE table's rows"),
    6: ("DsaIndex", "block_tables", "the indexer cache's pages"),
    7: ("TopK", "block_tables", "the indexer cache's pages"),
    8: ("DcpMerge", "own_positions", "the block table's local positions (x dcp + rank)"),
    9: ("DcpMerge", "block_tables", "the indexer cache's pages"),
    10: ("SparseCore", "slots", "the MLA cache's slots"),
}
INDEX_KEY_SLOT, INDEX_KEY_LENGTH, MLA_QUERY_SLOT, MLA_QUERY_LENGTH, INDEX_QUERY_LENGTH = 1, 2, 3, 4, 5
DSA_INDEX_PAGE, TOP_K_PAGE, DCP_MERGE_POSITION, DCP_MERGE_PAGE, SPARSE_CORE_SLOT = 6, 7, 8, 9, 10
EMPTY = 2**63 - 1  # no record

# Waits that cannot hang. The polls of other streams' or ranks' data (QueryWait, the
# fork_poll SparseCore, MlaQuery's DCP poll, CandidateSync) give up after their budget_ns and
# record what never came. An mbarrier wait inside a kernel (primitives.mbar_wait) executes
# `trap` once it has spun MBAR_WAIT_LIMIT_NS, which only a kernel bug can cause (a wrong byte
# count, a skipped arrive or push): the launch fails with a CUDA error at the host's next
# sync instead of hanging the replay. Healthy waits take microseconds, but one can sit behind
# a cluster peer's poll (the crossover's producer waits on its peer CTA), and a poll under a
# sanitizer is given 10 s (scripts/sanitize_case.py): so the limit is a minute and a poll's
# budget at most a quarter of it.
MBAR_WAIT_LIMIT_NS = 60_000_000_000
MAX_BUDGET_NS = MBAR_WAIT_LIMIT_NS // 4


def wait_limit_units() -> int:
    """MBAR_WAIT_LIMIT_NS in units of the timer's high word (2**32 ns), rounded up: a wait
    traps once the high word has advanced by more than this (read when a kernel is traced)."""
    return -(-MBAR_WAIT_LIMIT_NS // (1 << 32))


TOKEN_BITS = 24  # a launch's tokens (at most a few hundred) are far below 2**24


def pack(check: int, token: int, value: int) -> int:
    """The record of (check, token, value), as the kernels write it (int64); the host clamps
    token to TOKEN_BITS, the kernels do not need to."""
    return check << 56 | min(token, (1 << TOKEN_BITS) - 1) << 32 | (value & 0xFFFFFFFF)


def unpack(record: int) -> tuple[int, int, int] | None:
    """(check, token, value) of a record, value as int32; None for EMPTY."""
    if record == EMPTY:
        return None
    value = record & 0xFFFFFFFF
    return record >> 56, (record >> 32) & ((1 << TOKEN_BITS) - 1), value - (1 << 32) if value >= 1 << 31 else value
