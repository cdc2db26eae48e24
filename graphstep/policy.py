"""Which part of the query stage overlaps on the side stream, per batch size.

serial:    MlaQuery on the main stream writes q_c itself (store_qc) and, under DCP,
           spins on the mailbox itself (poll).
fork:      QueryNorm writes q_c on the main stream; MlaQuery and QueryWait run on
           the side stream, joined before the sparse core.
fork_poll: fork, the mailbox polled by its readers: under DCP MlaQuery polls the peers' rows
           itself instead of QueryWait; on one rank the sparse core polls its query rows and
           the side stream joins after it. Its spinning CTAs need the side stream at no
           lower priority than the main one (docs/design.md, Fork and join).
"""

from __future__ import annotations

import warnings
from functools import cache

MODES = ("serial", "fork", "fork_poll")


class UnusedPolicyEntries(UserWarning):
    """A policy table's entries that name no captured size (modes_for): unused."""


# TP1's split query has no mailbox to poll.
WIDE_MODES = ("serial", "fork")
TOPOLOGIES = ("tp1", "tp", "dcp", "dcp_split")

# Per-topology default tables ("rows:mode,..." or one mode); `graphstep tune` measures every
# mode and prints the table to put here. One rank ("tp": TP 8, and TP 1 unsplit): fork_poll,
# measured faster than fork at every size (H200, 32K, bench/RESULTS.md session 15: TP 8
# B = 1 / 4 / 16 -2.1 / -1.1 / -2.1 us, B = 64 within the run's spread; TP 1 -3.8 / -3.7 /
# -2.1 / -0.4). The others stay fork until measured.
QUERY_OVERLAP: dict[str, str] = {topology: "fork" for topology in TOPOLOGIES} | {"tp": "fork_poll"}


def batch_table(policy: str) -> dict[int, str]:
    """Parse "rows:mode,rows:mode,..." into {rows: mode}; every bad entry raises."""
    table: dict[int, str] = {}
    for entry in policy.split(","):
        rows, sep, mode = (part.strip() for part in entry.partition(":"))
        if not sep or not rows or not mode:
            raise ValueError(f"overlap policy entry {entry!r}: expected 'rows:mode' in {policy!r}")
        if not (rows.isascii() and rows.isdigit()) or int(rows) <= 0:  # (not '²' nor '٤')
            raise ValueError(f"overlap policy entry {entry!r}: rows must be a positive int")
        if mode not in MODES:
            raise ValueError(f"overlap policy entry {entry!r}: mode {mode!r} not in {MODES}")
        if int(rows) in table:
            raise ValueError(f"overlap policy entry {entry!r}: rows {int(rows)} given twice in {policy!r}")
        table[int(rows)] = mode
    return table


def topology_key(dcp: bool = False, wide: bool = False, split: bool = False) -> str:
    """The key of QUERY_OVERLAP whose table applies to a topology."""
    topology = "tp1" if wide else "dcp" if dcp else "tp"
    if split and dcp and not wide:
        topology = "dcp_split"
    return topology


def overlap_for(
    batch: int, policy: str | None = None, dcp: bool = False, wide: bool = False, split: bool = False
) -> str:
    """The query overlap mode of `batch` rows.

    policy is a mode or a "rows:mode,..." table (None: QUERY_OVERLAP of the topology; ""
    raises); a size a table does not name takes the topology's default, as with no policy
    (a size the default table does not name: "fork"). wide: the split query of TP1,
    WIDE_MODES only, in every entry of a table; split: the split query of fewer heads, under
    DCP its own table.
    """
    modes = WIDE_MODES if wide else MODES
    given = QUERY_OVERLAP[topology_key(dcp, wide, split)] if policy is None else policy
    if not given.strip():
        raise ValueError(f"overlap policy {given!r}: expected one of {modes} or a 'rows:mode,...' table")
    table = batch_table(given) if ":" in given or "," in given else {batch: given.strip()}
    for mode in table.values():  # every entry, not only this size's: a wrong one is never silently unused
        if mode not in modes:
            raise ValueError(f"DSA query overlap {mode!r}: expected one of {modes}")
    if batch in table:
        return table[batch]
    return "fork" if policy is None else overlap_for(batch, None, dcp=dcp, wide=wide, split=split)


def modes_for(
    sizes, policy: str | None = None, dcp: bool = False, wide: bool = False, split: bool = False
) -> dict[int, str]:
    """{size: overlap_for(size, ...)} of the captured `sizes`. A table's entries are captured
    sizes (a batch runs at the size it pads to): a table none of whose entries names one raises
    (it would change nothing); entries naming other sizes (`tune`'s table, measured at more
    sizes than a step may capture) are unused, with a warning."""
    modes = {size: overlap_for(size, policy, dcp=dcp, wide=wide, split=split) for size in sizes}
    if policy is not None and (":" in policy or "," in policy):
        table = batch_table(policy)
        unused = [f"{rows}:{mode}" for rows, mode in table.items() if rows not in modes]
        if len(unused) == len(table):
            raise ValueError(
                f"overlap policy {policy!r}: no entry names a captured size (captured: {sorted(modes)}; an entry's "
                "rows are the size a batch pads to)"
            )
        if unused:
            warnings.warn(
                f"overlap policy entries {', '.join(unused)} name no captured size (captured: {sorted(modes)}): unused",
                UnusedPolicyEntries,
                stacklevel=2,
            )
    return modes


@cache
def side_stream(device_index: int):
    """The query side stream of a device: one per device, shared by every step (a DcpGroup
    gives each of its ranks its own: their steps wait on each other's kernels)."""
    import torch

    return torch.cuda.Stream(device=device_index)
