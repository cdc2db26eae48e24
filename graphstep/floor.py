"""Bytes and FLOPs of each stage and the time floor at a bandwidth (METHOD: the two numbers).

A stage's bytes are what its kernel must move at least: each input read once, each
output written once at the narrowest width the step's data path needs (SparseCore's out
as bf16, though the harness writes it in fp32 for the DCP combine; not the harness's own
copies: the query rows' copy to the returned rows and the mailbox's re-arm). The indexer
scores count for both scoring and top-k, since they are separate kernels. The step floor
is the stages' sum less the scores (an intermediate a fused indexer would not store);
the other intermediates (q_c, the indexer's queries, the slots, under DCP the top-k
candidates, the query rows) count once written and once read, and QueryNorm's q_a and gamma also under MlaQuery, which
reads them again on the side stream: together under 1 us at TP 8, B = 64. The floor is
bytes / bandwidth (4.3 TB/s, the H200's copy rate, unless given): the bar the issues'
step targets are set against.

Not every stage is memory-bound: at 128 heads (TP 1) the sparse core does 2 x 128 x 2048
x 1088 FLOP a token, 0.71 us at MMA_RATE against 0.38 / 0.62 us of bytes (fp8 / bf16
cache), so it is compute-bound at every batch (`StageCost.mma_us`; `graphstep info` shows
both). The step's bytes floor still bounds it: the main stream's stages one after another,
each at the larger of its two times, take less than the whole step's bytes at 4.3 TB/s,
since MlaQuery's weights on the side stream outweigh the sparse core's excess
(tests/test_floor.py checks it for both presets, TP 1 / 8 and DCP, 2K-128K, B = 1-64).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import RankShape, check_batch

H200_COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (KINDS.md)
# FLOP/s of dense bf16 / fp16 MMAs that issue 9 measures kernels against (the H200's datasheet
# peak is 989e12; cuBLAS's large GEMMs reach ~700-800e12)
MMA_RATE = 800e12


@dataclass(frozen=True)
class StageCost:
    """The bytes and FLOPs of one stage of a step: what its time floor is computed from."""

    name: str
    stream: str  # "main" or "side" in the fork mode
    weight_bytes: int  # read once per step whatever the batch
    io_bytes: int  # activations, cache reads and writes
    flops: int
    intermediate_bytes: int = 0  # part of io_bytes that a fused step would not move
    cache_bytes: int = 0  # part of io_bytes read from a KV or indexer cache

    @property
    def bytes(self) -> int:
        """Weights plus activations and cache traffic."""
        return self.weight_bytes + self.io_bytes

    def floor_us(self, bandwidth: float = H200_COPY_BW) -> float:
        """The stage's time if it moved its bytes at `bandwidth` (bytes/s) and did nothing else."""
        return self.bytes / bandwidth * 1e6

    def mma_us(self, rate: float = MMA_RATE) -> float:
        """The stage's time if it did its FLOPs at `rate` (FLOP/s) and did nothing else."""
        return self.flops / rate * 1e6


def stage_costs(shape: RankShape, batch: int, context: int) -> list[StageCost]:
    """Per-stage costs of one step of `batch` tokens at `context` cached tokens each."""
    check_batch(batch)
    check_batch(context, "context")
    m, topo = shape.model, shape.topology
    b, bf16 = batch, 2
    local = -(-context // topo.dcp)  # tokens of each sequence on this rank
    topk = min(m.index_topk, context)
    local_topk = -(-topk // topo.dcp)
    q_row_bytes = m.query_row * shape.q_bytes
    scores = b * local * 4
    index_q = b * m.index_heads * (m.index_dim + 4)  # fp8 queries + fp32 head weights
    costs = [
        StageCost("query_norm", "main", m.q_lora_rank * bf16, 2 * b * m.q_lora_rank * bf16, 3 * b * m.q_lora_rank),
        StageCost(
            "index_query",
            "main",
            m.index_heads * m.index_dim * m.q_lora_rank * bf16,
            b * (m.q_lora_rank + m.index_heads) * bf16 + index_q,
            2 * b * m.q_lora_rank * m.index_heads * m.index_dim,
        ),
        StageCost(
            "index_key",
            "main",
            2 * m.index_dim * bf16,
            b * (m.index_dim * bf16 + m.index_token_bytes),
            10 * b * m.index_dim,
        ),
        StageCost(
            "index_score",
            "main",
            0,
            b * local * m.index_token_bytes + index_q + scores,
            2 * b * local * m.index_heads * m.index_dim,
            intermediate_bytes=scores,
            cache_bytes=b * local * m.index_token_bytes,
        ),
        # the slots; under DCP the candidates' global positions and their fp32 scores
        StageCost(
            "top_k", "main", 0, scores + b * m.index_topk * (8 if topo.dcp > 1 else 4), 0, intermediate_bytes=scores
        ),
        StageCost(
            "mla_query",
            "side",
            shape.heads * m.qk_head_dim * m.q_lora_rank * bf16
            + shape.heads * m.qk_nope_dim * m.kv_lora_rank * bf16
            + (m.q_lora_rank + m.kv_lora_rank) * bf16,
            b * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim) * bf16
            + b * shape.heads * q_row_bytes * topo.dcp  # own rows, published to every rank's mailbox
            + b * shape.mla_token_bytes,
            2 * b * m.q_lora_rank * shape.heads * m.qk_head_dim + 2 * b * shape.heads * m.qk_nope_dim * m.kv_lora_rank,
        ),
    ]
    if topo.dcp > 1:
        costs.append(StageCost("query_wait", "side", 0, b * shape.gathered * q_row_bytes, 0))
        # every rank's candidates (positions and scores) read, this rank's slots written
        costs.append(StageCost("dcp_merge", "main", 0, b * topo.dcp * m.index_topk * 8 + b * m.index_topk * 4, 0))
    costs.append(
        StageCost(
            "sparse_core",
            "main",
            0,
            b * local_topk * (shape.mla_token_bytes + 4)
            + b * shape.gathered * (q_row_bytes + m.kv_lora_rank * bf16 + 4),
            2 * b * shape.gathered * local_topk * (m.query_row + m.kv_lora_rank),  # QK^T over 576, PV over 512
            cache_bytes=b * local_topk * shape.mla_token_bytes,
        )
    )
    return costs


@dataclass(frozen=True)
class StepFloor:
    """The bytes floor of a whole step: each tensor moved once at `bandwidth`, the bar the step's
    time is measured against."""

    costs: tuple[StageCost, ...]
    bandwidth: float

    @property
    def bytes(self) -> int:
        """Each tensor once across the step (intermediates left out)."""
        return sum(c.bytes - c.intermediate_bytes for c in self.costs)

    @property
    def us(self) -> float:
        """The step's floor in us."""
        return self.bytes / self.bandwidth * 1e6

    @property
    def indexer_bytes(self) -> int:
        """The indexer's bytes floor: the wq_b weights and the indexer cache, each read once."""
        by = {c.name: c for c in self.costs}
        return by["index_query"].weight_bytes + by["index_score"].cache_bytes

    @property
    def indexer_us(self) -> float:
        """The indexer's floor in us."""
        return self.indexer_bytes / self.bandwidth * 1e6


def step_floor(shape: RankShape, batch: int, context: int, bandwidth: float = H200_COPY_BW) -> StepFloor:
    """The StepFloor of one step of `batch` tokens at `context` cached tokens each."""
    return StepFloor(tuple(stage_costs(shape, batch, context)), bandwidth)
