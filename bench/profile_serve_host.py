"""Where a serving step's host time goes: `graphstep serve` with cProfile on DecodeStep.load
only (the value checks with their one device-to-host read, and the input copies), not on
the compile, the capture or the replays.

Session 43 (H100): serve's checked host wall was 866 us a step against 177 unchecked, ~690 us
of checks, after session 42 had cut their device ops from ~55 to ~8 (predicted 300-450): the
count of device ops is not what costs. This names what does.

    python3 bench/profile_serve_host.py [--top 25] [serve's flags, default --steps 200 --batch 1,4,16]

Prints serve's own table, then load()'s callees by their own time (tottime) and by their
cumulative time. A builtin that synchronizes (`.cpu()`, `.tolist()` of a device tensor)
carries the device's wait in its own time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys

from graphstep.cli import main as graphstep_main
from graphstep.step import DecodeStep


def profiled(cls: type, name: str, profile: cProfile.Profile):
    """Wrap method `name` of `cls` so that `profile` runs only inside it; returns a function
    that puts the original back."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        profile.enable()
        try:
            return original(*args, **kwargs)
        finally:
            profile.disable()

    setattr(cls, name, wrapper)
    return lambda: setattr(cls, name, original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="rows of each profile table")
    args, serve_args = parser.parse_known_args(argv)
    serve_args = serve_args or ["--steps", "200", "--batch", "1,4,16"]
    profile = cProfile.Profile()
    restore = profiled(DecodeStep, "load", profile)
    try:
        rc = graphstep_main(["serve", *serve_args])
    finally:
        restore()
    stats = pstats.Stats(profile, stream=sys.stdout)
    for key in ("tottime", "cumulative"):
        print(f"\nDecodeStep.load and its callees by {key}:")
        stats.sort_stats(key).print_stats(args.top)
    return rc


if __name__ == "__main__":
    sys.exit(main())
