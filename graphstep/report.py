"""Plain-text and markdown tables, JSON-safe records, and a progress line for long runs."""

from __future__ import annotations

import sys
import time


def table(headers: list[str], rows: list[list], markdown: bool = False) -> str:
    """Rows as an aligned plain-text table, or a markdown one (RESULTS.md, bench.md)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        padded = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded)

    rule = ("|" + "|".join("-" * (w + 2) for w in widths) + "|") if markdown else "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


BIG = 1e9  # floats from here on print as 1.23e+09: fixed-point would be 11+ digits wide


def _fmt(value) -> str:
    """A cell: floats to 3 significant digits below 10, one decimal up to BIG, scientific past
    it (a 1e300 is not 300 digits wide)."""
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:.3g}" if abs(value) < 10 or abs(value) >= BIG else f"{value:.1f}"
    return str(value)


def json_keys(value):
    """`value` with every dict key JSON cannot take (a tuple, as PLAN_HALF_WAVE_TOKENS's) as its
    repr, in nested dicts too: the --knob records written beside a run's times."""
    if isinstance(value, dict):
        return {
            key if key is None or isinstance(key, (str, int, float, bool)) else repr(key): json_keys(item)
            for key, item in value.items()
        }
    return value


def mb(n: int) -> float:
    """Bytes -> MB (1e6)."""
    return n / 1e6


class Progress:
    """A one-line progress bar on stderr: `with Progress(total, "replay") as p: p.update()`."""

    def __init__(self, total: int, label: str, stream=sys.stderr, every: float = 0.2):
        self.total, self.label, self.stream, self.every = total, label, stream, every
        self.done, self._last, self._start = 0, 0.0, time.perf_counter()

    def update(self, n: int = 1) -> None:
        """Count `n` more done; redraw at most every `every` seconds."""
        self.done += n
        now = time.perf_counter()
        if now - self._last >= self.every or self.done == self.total:
            self._last = now
            width = 30
            filled = width * self.done // max(1, self.total)
            rate = self.done / max(1e-9, now - self._start)
            self.stream.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.0f}/s"
            )
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.write("\n")
        self.stream.flush()
