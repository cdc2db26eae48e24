"""Where a serving step's host time goes: `graphstep serve` with cProfile on the loop's
DecodeStep.load calls only (the value checks with their one device-to-host read, and the
input copies), not on the compile, the capture, the replays, nor the warm-up's step() calls
(one a batch size, always checked).

Written when serve's checked step took ~0.7 ms more host time than its unchecked one and the
checks' device-op count turned out not to be why (sessions 42-43); session 44's run named ~40
host-side torch calls of 5-55 us each (bench/RESULTS.md).

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


def profiled(cls: type, name: str, profile: cProfile.Profile, not_inside: str | None = None):
    """Wrap method `name` of `cls` so that `profile` runs only inside it, except in calls made
    from inside method `not_inside` of `cls` (wrapped too); returns a function that puts the
    originals back."""
    originals = {m: getattr(cls, m) for m in (name, not_inside) if m}
    depth = [0]  # calls of not_inside in progress

    @functools.wraps(originals[name])
    def wrapper(*args, **kwargs):
        if depth[0]:
            return originals[name](*args, **kwargs)
        profile.enable()
        try:
            return originals[name](*args, **kwargs)
        finally:
            profile.disable()

    def outer(*args, **kwargs):
        depth[0] += 1
        try:
            return originals[not_inside](*args, **kwargs)
        finally:
            depth[0] -= 1

    def restore():
        for method, original in originals.items():
            setattr(cls, method, original)

    setattr(cls, name, wrapper)
    if not_inside:
        setattr(cls, not_inside, functools.wraps(originals[not_inside])(outer))
    return restore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="rows of each profile table")
    args, serve_args = parser.parse_known_args(argv)
    serve_args = serve_args or ["--steps", "200", "--batch", "1,4,16"]
    profile = cProfile.Profile()
    restore = profiled(DecodeStep, "load", profile, not_inside="step")  # serve warms each size by step()
    try:
        rc = graphstep_main(["serve", *serve_args])
    finally:
        restore()
    if rc:
        return rc  # serve refused its flags or failed: nothing was profiled
    stats = pstats.Stats(profile, stream=sys.stdout)
    for key in ("tottime", "cumulative"):
        print(f"\nDecodeStep.load and its callees by {key}:")
        stats.sort_stats(key).print_stats(args.top)
    return rc


if __name__ == "__main__":
    sys.exit(main())
