"""graphstep: a CUDA-graph-captured decode step of one DeepSeek-Sparse-Attention layer.

    from graphstep import DecodeStep, RankShape, Topology, preset

The shapes and the overlap policy import without torch; DecodeStep, StepInputs,
StepOutputs and LayerState load torch on first use (module __getattr__), so `import
graphstep` stays cheap (the command line's --help, shape arithmetic).
"""

from importlib import import_module
from importlib.metadata import version

from .policy import (
    MODES,
    QUERY_OVERLAP,
    WIDE_MODES,
    UnusedPolicyEntries,
    batch_table,
    modes_for,
    overlap_for,
    side_stream,
)
from .shapes import PRESETS, ModelShape, RankShape, Topology, preset, tiled_from

__version__ = version("graphstep")

_LAZY = {
    "DecodeStep": "step",
    "StepInputs": "state",
    "StepOutputs": "state",
    "LayerState": "state",
    "InputRangeError": "launch",
}

__all__ = [
    "DecodeStep",
    "StepInputs",
    "StepOutputs",
    "LayerState",
    "InputRangeError",
    "MODES",
    "WIDE_MODES",
    "QUERY_OVERLAP",
    "batch_table",
    "modes_for",
    "UnusedPolicyEntries",
    "overlap_for",
    "side_stream",
    "PRESETS",
    "ModelShape",
    "RankShape",
    "Topology",
    "preset",
    "tiled_from",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
