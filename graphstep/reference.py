"""Torch reference of every stage of the query stage, on CPU or CUDA.

Math is done in `acc` (float32 by default; tests run it in float64 too) and rounded
only where a kernel stores: q_c and the query rows to their format, the caches to
theirs. Kernels are checked against these functions; QueryNorm, which must be
bit-exact, is checked against the order model in `order.py` instead.

As DeepSeek-V3.2-Exp's inference/model.py (each can be turned off in ModelShape): YaRN
RoPE tables and softmax scale, the Hadamard rotation of the indexer q and k after RoPE and
before their FP8 quantization, and power-of-two (ue8m0) FP8 scales (the indexer's q and k,
the fp8 MLA cache). Unlike
model.py, nothing is rounded to bf16 between the indexer's RoPE, rotation and quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats
from .state import LayerCaches, LayerState, PeerInputs, StepInputs, StepOutputs, local_lens


def _cols(inputs: StepInputs, state: LayerState, name: str) -> torch.Tensor:
    start, end = state.shape.model.packed_columns[name]
    return inputs.qkv[:, start:end]


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, acc=torch.float32) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * gamma, in acc (not rounded)."""
    x = x.to(acc)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * gamma.to(acc)


def query_norm(state: LayerState, inputs: StepInputs, acc=torch.float32) -> torch.Tensor:
    """q_c [B, 1536] bf16: the q_a RMSNorm (plain formula; the kernels' order is in order.py)."""
    w, m = state.weights, state.shape.model
    return rms_norm(_cols(inputs, state, "q_a"), w.gamma_q, m.rms_eps, acc).to(torch.bfloat16)


# -- indexer ---------------------------------------------------------------------------


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a power of two) times the Sylvester Hadamard matrix scaled by n^-0.5
    (fast_hadamard_transform's order: row i, column j is (-1)^popcount(i & j)), as a fast
    Walsh-Hadamard transform: butterflies (a + b, a - b) over pairs h apart, h = 1, 2, 4, ...,
    the order the kernels add in, then the scale."""
    n = x.shape[-1]
    h = 1
    while h < n:
        pairs = x.unflatten(-1, (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return x * n**-0.5


def _rotate_and_quantize(x: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's q and k after RoPE: model.py's rotate_activation (when index_rotation),
    then act_quant in the model's scale format."""
    if model.index_rotation:
        x = hadamard(x)
    return formats.quantize_fp8_rows(x, scale_format=model.fp8_scale_format)


def index_key(state: LayerState, inputs: StepInputs, acc=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The new token's indexer key: LayerNorm(128, weight, bias), NeoX RoPE on the first
    index_rope_dim dims, the Hadamard rotation, per-token e4m3 quantization.
    Returns (uint8 [B, 128], fp32 scale [B])."""
    w, m = state.weights, state.shape.model
    k = _cols(inputs, state, "idx_k").to(acc)
    k = torch.nn.functional.layer_norm(
        k, (m.index_dim,), w.index_norm_weight.to(acc), w.index_norm_bias.to(acc), m.index_norm_eps
    )
    pos = inputs.positions
    rope = formats.rope_neox(k[:, : m.index_rope_dim], w.index_rope_cos[pos].to(acc), w.index_rope_sin[pos].to(acc))
    return _rotate_and_quantize(torch.cat([rope, k[:, m.index_rope_dim :]], dim=-1), m)


def index_key_insert(state: LayerState, inputs: StepInputs, caches: LayerCaches, acc=torch.float32) -> None:
    """Write the new tokens' indexer keys at their slots (slot -1: nothing)."""
    keys, scales = index_key(state, inputs, acc)
    here = inputs.slot_mapping >= 0
    store_index_keys(state, caches, inputs.slot_mapping[here].long(), keys[here], scales[here])


def store_index_keys(
    state: LayerState, caches: LayerCaches, slots: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor
) -> None:
    """Indexer keys (uint8 [n, 128]) and their scales (fp32 [n]) at cache slots (int64 [n], all >= 0)."""
    m = state.shape.model
    cache_keys, cache_scales = formats.index_cache_views(caches.index_cache, m.page_size, m.index_dim)
    page, offset = torch.div(slots, m.page_size, rounding_mode="floor"), slots % m.page_size
    cache_keys[page, offset] = keys
    cache_scales[page, offset] = scales


def index_query(
    state: LayerState, inputs: StepInputs, q_c: torch.Tensor, acc=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """wq_b: q_c -> indexer queries, NeoX RoPE on each head's first dims, the Hadamard
    rotation of each head, per-head e4m3 quantization; per-head weights with DeepSeek-V3.2's folding:
    w = weights_proj * heads^-0.5 * q_scale * dim^-0.5.
    Returns (uint8 [B, heads, dim], fp32 [B, heads])."""
    return index_query_from(state, inputs, q_c.to(acc) @ state.weights.wq_b_index.to(acc).T, acc)


def index_query_from(state: LayerState, inputs: StepInputs, q: torch.Tensor, acc=torch.float32):
    """index_query after the wq_b projection q [B, heads x dim]."""
    w, m = state.weights, state.shape.model
    q = q.to(acc).view(-1, m.index_heads, m.index_dim)
    pos = inputs.positions
    cos, sin = w.index_rope_cos[pos].to(acc)[:, None], w.index_rope_sin[pos].to(acc)[:, None]
    q = torch.cat([formats.rope_neox(q[..., : m.index_rope_dim], cos, sin), q[..., m.index_rope_dim :]], dim=-1)
    q_fp8, q_scale = _rotate_and_quantize(q, m)
    head_w = _cols(inputs, state, "idx_w").to(acc) * m.index_heads**-0.5 * q_scale.to(acc) * m.index_dim**-0.5
    return q_fp8, head_w.float()


def index_scores(
    state: LayerState, caches: LayerCaches, inputs: StepInputs, q_fp8, head_w, acc=torch.float32
) -> torch.Tensor:
    """DsaIndex: score[b, i] = k_scale[i] * sum_h w[b, h] * relu(q[b, h] . k[i]) over the
    local cached tokens i of sequence b (fp8 values exact in acc), -inf past its length.
    Returns fp32 [B, local max]."""
    m, topo = state.shape.model, state.shape.topology
    lens = local_lens(inputs.context_lens, topo.dcp, topo.rank)
    width = max(1, int(lens.max()))
    keys, scales = formats.index_cache_views(caches.index_cache, m.page_size, m.index_dim)
    idx = torch.arange(width, device=lens.device)
    pages = inputs.block_tables.long()[:, idx // m.page_size]  # [B, width]
    k = formats.fp8_to_float(keys[pages, idx % m.page_size]).to(acc)  # [B, width, dim]
    k_scale = scales[pages, idx % m.page_size].to(acc)
    q = formats.fp8_to_float(q_fp8).to(acc)
    dots = torch.relu(torch.einsum("bhd,btd->bht", q, k))
    score = torch.einsum("bh,bht->bt", head_w.to(acc), dots) * k_scale
    return torch.where(idx[None, :] < lens[:, None], score, float("-inf")).float()


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the indices of the k highest finite scores (equal scores: the lower index
    is chosen first), in ascending index order, -1 padded past the row's finite count.
    int32 [B, k]. The order is a contract, not a ranking: the sparse core does not depend
    on it, and a select-then-compact kernel (kernels/top_k.py) produces it with no sort.
    A NaN or infinite score is never selected (it ranks below every finite one)."""
    finite_mask = torch.isfinite(scores)
    scores = scores.masked_fill(~finite_mask, float("-inf"))
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    finite = finite_mask.sum(-1, keepdim=True)
    if by_score.shape[-1] < k:
        by_score = torch.nn.functional.pad(by_score, (0, k - by_score.shape[-1]), value=0)
    keep = torch.arange(k, device=scores.device)[None, :] < finite
    chosen = torch.sort(torch.where(keep, by_score, torch.iinfo(torch.int64).max), dim=-1).values
    return torch.where(keep, chosen, -1).to(torch.int32)


def to_slots(indices: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """Local token indices -> cache slots (page x 64 + offset); -1 stays -1."""
    safe = indices.clamp_min(0).long()
    pages = block_tables.long().gather(1, torch.div(safe, page_size, rounding_mode="floor"))
    return torch.where(indices >= 0, pages * page_size + safe % page_size, -1).to(torch.int32)


@dataclass
class Candidates:
    """One rank's local top-k, in global positions."""

    positions: torch.Tensor  # int32 [B, k], -1 padded
    scores: torch.Tensor  # fp32 [B, k], -inf where padded


def local_candidates(scores: torch.Tensor, k: int, dcp: int, rank: int) -> Candidates:
    """This rank's top-k of its local scores as candidates for the DCP merge."""
    return candidates_at(scores, topk_indices(scores, k), dcp, rank)


def candidates_at(scores: torch.Tensor, local: torch.Tensor, dcp: int, rank: int) -> Candidates:
    """The chosen local indices (int32 [B, k], -1 padded) of `rank` and their scores as
    candidates in global positions (local index i is position i x dcp + rank)."""
    picked = scores.gather(1, local.clamp_min(0).long())
    return Candidates(
        torch.where(local >= 0, local * dcp + rank, -1).to(torch.int32),
        torch.where(local >= 0, picked, float("-inf")),
    )


def dcp_merge(candidates: list[Candidates], k: int) -> torch.Tensor:
    """Merge every rank's candidates into the global top-k positions (equal scores: the
    lower global position first), in ascending position order, -1 padded. int32 [B, k]."""
    positions = torch.cat([c.positions for c in candidates], dim=1).long()
    scores = torch.cat([c.scores for c in candidates], dim=1)
    # Order by position first so the stable score sort breaks ties by position.
    by_pos = torch.sort(
        torch.where(positions >= 0, positions, torch.iinfo(torch.int64).max), dim=1, stable=True
    ).indices
    positions, scores = positions.gather(1, by_pos), scores.gather(1, by_pos)
    pick = topk_indices(scores, k)
    return torch.where(pick >= 0, positions.gather(1, pick.clamp_min(0).long()), -1).to(torch.int32)


def local_slots(
    global_positions: torch.Tensor, block_tables: torch.Tensor, page_size: int, dcp: int, rank: int
) -> torch.Tensor:
    """The selected positions that live on `rank`, as its cache slots, in selection
    order, compacted to the front and -1 padded. int32 [B, k]."""
    mine = (global_positions >= 0) & (global_positions % dcp == rank)
    local = torch.where(mine, torch.div(global_positions, dcp, rounding_mode="floor"), -1)
    slots = to_slots(local, block_tables, page_size)
    # Stable sort on "not mine" moves mine to the front, keeping their order.
    order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices
    return slots.gather(1, order)


def merge_ranks(
    state: LayerState, own: Candidates, positions: torch.Tensor, scores: torch.Tensor, block_tables: torch.Tensor
) -> torch.Tensor:
    """DcpMerge: this rank's candidates and every rank's (positions int32, scores fp32
    [B, dcp, topk]; this rank's row is ignored) -> this rank's share of the global top-k
    as its cache slots (local_slots). int32 [B, topk]."""
    m, topo = state.shape.model, state.shape.topology
    candidates = [
        own if rank == topo.rank else Candidates(positions[:, rank], scores[:, rank]) for rank in range(topo.dcp)
    ]
    return local_slots(dcp_merge(candidates, m.index_topk), block_tables, m.page_size, topo.dcp, topo.rank)


def indexer(
    state: LayerState,
    caches: LayerCaches,
    inputs: StepInputs,
    q_c: torch.Tensor,
    peers: PeerInputs | None = None,
    acc=torch.float32,
):
    """The main-stream indexer path of this rank: key insert, wq_b, scoring, top-k and,
    under DCP, the merge with the peers' candidates and this rank's local slots.
    Returns (slots int32 [B, topk], scores fp32 [B, local max])."""
    m, topo = state.shape.model, state.shape.topology
    index_key_insert(state, inputs, caches, acc)
    q_fp8, head_w = index_query(state, inputs, q_c, acc)
    scores = index_scores(state, caches, inputs, q_fp8, head_w, acc)
    if topo.dcp == 1:
        return to_slots(topk_indices(scores, m.index_topk), inputs.block_tables, m.page_size), scores
    if peers is None:
        raise ValueError("a DCP step needs the peers' inputs (LayerState.peer_inputs)")
    own = local_candidates(scores, m.index_topk, topo.dcp, topo.rank)
    return merge_ranks(state, own, peers.positions, peers.scores, inputs.block_tables), scores


# -- MLA query ----------------------------------------------------------------------------


def mla_query(state: LayerState, inputs: StepInputs, q_c: torch.Tensor, acc=torch.float32) -> torch.Tensor:
    """Q_B, W_UK absorption and interleaved RoPE -> query rows [B, heads, 576] in acc."""
    w, s = state.weights, state.shape
    m = s.model
    q = (q_c.to(acc) @ w.w_qb.to(acc).T).view(-1, s.heads, m.qk_head_dim)
    latent = torch.einsum("bhd,hdc->bhc", q[..., : m.qk_nope_dim], w.w_uk.to(acc))
    return query_rows_from(state, inputs, latent, q[..., m.qk_nope_dim :], acc)


def query_rows_from(
    state: LayerState, inputs: StepInputs, latent: torch.Tensor, q_rope: torch.Tensor, acc=torch.float32
):
    """[latent | interleaved-RoPE(q_rope)] -> query rows [B, heads, 576] in acc."""
    w, pos = state.weights, inputs.positions
    rope = formats.rope_interleaved(q_rope.to(acc), w.rope_cos[pos].to(acc)[:, None], w.rope_sin[pos].to(acc)[:, None])
    return torch.cat([latent.to(acc), rope], dim=-1)


def kv_row(state: LayerState, inputs: StepInputs, acc=torch.float32) -> torch.Tensor:
    """The new token's MLA cache row [B, 576]: kv_a RMSNorm (512) then roped k_pe (64)."""
    w, m = state.weights, state.shape.model
    latent = rms_norm(_cols(inputs, state, "kv_a"), w.gamma_kv, m.rms_eps, acc)
    pos = inputs.positions
    rope = formats.rope_interleaved(
        _cols(inputs, state, "k_pe").to(acc), w.rope_cos[pos].to(acc), w.rope_sin[pos].to(acc)
    )
    return torch.cat([latent, rope], dim=-1)


def kv_insert(state: LayerState, inputs: StepInputs, caches: LayerCaches, acc=torch.float32) -> None:
    """Store the new rows at slot_mapping in the cache's format (slot -1: nothing)."""
    rows = kv_row(state, inputs, acc)
    here = inputs.slot_mapping >= 0
    store_kv_rows(state, caches, inputs.slot_mapping[here].long(), rows[here])


def store_kv_rows(state: LayerState, caches: LayerCaches, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """MLA cache rows ([n, 576], any float dtype) at cache slots (int64 [n], all >= 0), in the cache's format."""
    m, topo = state.shape.model, state.shape.topology
    flat = caches.mla_cache.view(-1, caches.mla_cache.shape[-1])
    if topo.mla_cache == "bf16":
        flat[slots] = rows.to(torch.bfloat16)
    else:
        flat[slots] = formats.pack_mla_fp8(rows.float(), m.kv_lora_rank, m.fp8_scale_format)


def publish(state: LayerState, caches: LayerCaches, rows: torch.Tensor, rank: int | None = None) -> None:
    """Write `rank`'s query rows [B, heads, 576] into the mailbox at head rows
    [rank x heads, (rank + 1) x heads) of each token, in the q format."""
    s = state.shape
    rank = s.topology.rank if rank is None else rank
    encoded = formats.encode_q_rows(rows, s.topology.q_format)
    caches.mailbox[: rows.shape[0], rank * s.heads : (rank + 1) * s.heads] = encoded.view(rows.shape[0], s.heads, -1)


def query_rows(state: LayerState, caches: LayerCaches, batch: int) -> torch.Tensor:
    """The gathered query rows [B, gathered, 576] fp32 as the sparse core reads them."""
    s = state.shape
    return formats.decode_q_rows(caches.mailbox[:batch, : s.gathered], s.topology.q_format)


# -- sparse core ------------------------------------------------------------------------


def sparse_attention(state: LayerState, caches: LayerCaches, q: torch.Tensor, slots: torch.Tensor, acc=torch.float32):
    """Sparse MLA decode over the selected slots of this rank.

    q [B, G, 576]; slots int32 [B, k] (-1 ignored). Scores are q . row (576 wide),
    values the first 512 of each row. Returns (out [B, G, 512] in acc, lse [B, G] in
    acc, natural log, -inf and out 0 for a token with no slot)."""
    m, topo = state.shape.model, state.shape.topology
    flat = caches.mla_cache.view(-1, caches.mla_cache.shape[-1])
    valid = slots >= 0
    picked = flat[slots.clamp_min(0).long()]  # gather first: never convert the whole cache
    kv = formats.mla_rows(picked, topo.mla_cache, m.kv_lora_rank).to(acc)  # [B, k, 576]
    logits = torch.einsum("bgd,bkd->bgk", q.to(acc), kv) * m.softmax_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    out = torch.einsum("bgk,bkc->bgc", probs, kv[..., : m.kv_lora_rank])
    return out, lse


def combine_ranks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The DCP combine: each rank's attention (out [B, G, 512], lse [B, G]) over its own
    slots -> the attention over all of them, each rank's out weighted by exp(lse_r - lse)
    with lse = logsumexp_r lse_r. A rank with no slot (lse -inf) weighs 0; a row no rank
    attended gives out 0, lse -inf (as sparse_attention does)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    base = torch.where(torch.isfinite(lse), lse, 0)
    out = sum(torch.exp(rank_lse - base)[..., None] * out for out, rank_lse in zip(outs, lses))
    return out, lse


# -- the whole stage ----------------------------------------------------------------------


def reference_step(
    state: LayerState,
    inputs: StepInputs,
    caches: LayerCaches | None = None,
    peers: PeerInputs | None = None,
    acc=torch.float32,
) -> StepOutputs:
    """One decode step of this rank, updating `caches` (default: the state's own).

    Under DCP, `peers` stands in for the other ranks: the query rows they publish into
    this rank's mailbox and their local top-k candidates."""
    caches = caches or state.caches
    s, batch = state.shape, inputs.batch
    q_c = query_norm(state, inputs, acc)
    slots, _ = indexer(state, caches, inputs, q_c, peers, acc)
    kv_insert(state, inputs, caches, acc)
    own = mla_query(state, inputs, q_c, acc)
    if s.topology.dcp > 1:
        for rank in range(s.topology.dcp):
            if rank != s.topology.rank:
                publish(state, caches, peers.rows[:, rank * s.heads : (rank + 1) * s.heads], rank)
    publish(state, caches, own)
    q = query_rows(state, caches, batch)
    out, lse = sparse_attention(state, caches, q, slots, acc)
    formats.arm(caches.mailbox[:batch])  # the step's last reader re-arms for the next step
    return StepOutputs(q_c, slots, q, out.float(), lse.float())
