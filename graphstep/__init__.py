"""graphstep: a CUDA-graph-captured decode step of one DeepSeek-Sparse-Attention layer."""

from .policy import MODES, QUERY_OVERLAP, WIDE_MODES, batch_table, overlap_for, side_stream
from .shapes import PRESETS, ModelShape, RankShape, Topology, preset, tiled_from

__all__ = [
    "MODES",
    "WIDE_MODES",
    "QUERY_OVERLAP",
    "batch_table",
    "overlap_for",
    "side_stream",
    "PRESETS",
    "ModelShape",
    "RankShape",
    "Topology",
    "preset",
    "tiled_from",
]
