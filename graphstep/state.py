"""Seeded weights, caches, step inputs and outputs in the real formats (docs/design.md §3).

Everything is random (never zeros) and drawn on the target device from a seeded
generator, so a state of many GB builds in seconds on a GPU and the same seed gives
the same state on the same device type.

Under DCP the caches are sharded by token: position p lives on rank p % dcp at local
index p // dcp. This state is the one rank `topology.rank` holds; block tables map
local indices to pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats
from .shapes import RankShape, check_batch


@dataclass
class LayerWeights:
    """One layer's weights on this rank (shapes and dtypes in the field comments): seeded
    random matrices and the model's RoPE tables, what the kernels and the reference share."""

    gamma_q: torch.Tensor  # [1536] bf16, q_a RMSNorm
    gamma_kv: torch.Tensor  # [512] bf16, kv_a RMSNorm
    w_qb: torch.Tensor  # [heads x 192, 1536] bf16 (out, in): per head 128 nope then 64 rope
    w_uk: torch.Tensor  # [heads, 128, 512] bf16: q_nope -> latent absorption
    wq_b_index: torch.Tensor  # [index_heads x index_dim, 1536] bf16, the indexer's wq_b
    index_norm_weight: torch.Tensor  # [index_dim] bf16, LayerNorm of the indexer key
    index_norm_bias: torch.Tensor  # [index_dim] bf16
    rope_cos: torch.Tensor  # [max_positions, 32] fp32, MLA (interleaved)
    rope_sin: torch.Tensor
    index_rope_cos: torch.Tensor  # [max_positions, index_rope_dim / 2] fp32, indexer (NeoX)
    index_rope_sin: torch.Tensor


@dataclass
class LayerCaches:
    """One rank's caches and mailbox, in the kernels' byte formats (docs/design.md section 3)."""

    index_cache: torch.Tensor  # uint8 [pages, 64 x 132]
    mla_cache: torch.Tensor  # bf16 [pages, 64, 576] or uint8 [pages, 64, 656]
    block_tables: torch.Tensor  # int32 [max_batch, pages per sequence]: local index // 64 -> page
    mailbox: torch.Tensor  # uint8 [max_batch, q_heads, 576 x q_bytes], armed


@dataclass
class StepInputs:
    """What a serving loop hands the query stage for one decode step of `batch` tokens, one
    new token per sequence. Contiguous tensors on the step's device.

    Fields (B = batch):
        qkv: (B, packed width = 2304), torch.bfloat16. The packed projection row of each
            new token: q_a 1536 | kv_a 512 | k_pe 64 | idx_k 128 | idx_w 64 columns.
        context_lens: (B,), torch.int32. Tokens of each sequence over all ranks, the new one
            included (its position, the RoPE position, is context_lens - 1).
        slot_mapping: (B,), torch.int32. This rank's cache slot (page x page_size + offset)
            of the new token, -1 when another DCP rank holds it (or to write nothing).
        block_tables: (B, pages per sequence), torch.int32. Each sequence's pages of this
            rank's caches: local index i is at page block_tables[b, i // page_size].
    """

    qkv: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor

    @property
    def batch(self) -> int:
        """B, the number of tokens."""
        return self.qkv.shape[0]

    @property
    def positions(self) -> torch.Tensor:
        """Global position of each new token (its RoPE position)."""
        return self.context_lens.long() - 1


@dataclass
class StepOutputs:
    """What one decode step of `batch` tokens returns (DecodeStep.step, reference_step).

    Fields (B = batch, H = heads per rank, G = gathered head rows = dcp x H, k = index_topk):
        q_c: (B, q_lora_rank = 1536), torch.bfloat16. The q_a RMSNorm, the input of the
            indexer's wq_b and of MlaQuery's Q_B.
        slots: (B, k), torch.int32. The cache slots (page x page_size + offset) this rank's
            sparse core attended: the top-k of the indexer (under DCP this rank's share of
            the global top-k, compacted to the front), -1 padded.
        q_rows: (B, G, 576). The query rows the sparse core read, [absorbed latent 512 |
            roped 64] per head, every rank's heads under DCP: DecodeStep returns them as
            stored (torch.bfloat16, or torch.float8_e4m3fn with Topology(q_format="fp8")),
            reference_step in torch.float32.
        out: (B, G, kv_lora_rank = 512), torch.float32. The attention over the selected
            slots per head row, in the latent space (before W_UV); 0 for a token with no slot.
        lse: (B, G), torch.float32. The natural-log sum of exp of the scaled scores per head
            row (the softmax denominator, to combine partial attentions); -inf with no slot.

    DecodeStep's outputs are views of its static buffers: valid until its next step."""

    q_c: torch.Tensor
    slots: torch.Tensor
    q_rows: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


@dataclass
class PeerInputs:
    """Under DCP on one GPU, what the other ranks would contribute to this rank's step:
    the query rows they publish into its mailbox and their local top-k candidates
    (global positions, scores). This rank's own parts are ignored."""

    rows: torch.Tensor  # fp32 [B, gathered, 576]
    positions: torch.Tensor  # int32 [B, dcp, topk], -1 padded
    scores: torch.Tensor  # fp32 [B, dcp, topk], descending, -inf padded


def check_tensors(owner: str, expect: dict, device: torch.device, contiguous: bool = True) -> None:
    """expect: {name: (tensor, dtype, shape)}; raise naming `owner.name` and what was expected."""
    for name, (tensor, dtype, shape) in expect.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{owner}.{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != dtype:
            raise ValueError(f"{owner}.{name} must be {dtype}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{owner}.{name} must have shape {list(shape)}, got {list(tensor.shape)}")
        if tensor.device != device:
            raise ValueError(f"{owner}.{name} must be on {device}, got {tensor.device}")
        if contiguous and not tensor.is_contiguous():
            raise ValueError(f"{owner}.{name} must be contiguous")


def local_lens(context_lens: torch.Tensor, dcp: int, rank: int) -> torch.Tensor:
    """Tokens of each sequence held by `rank`: positions p < len with p % dcp == rank."""
    return torch.div(context_lens.long() - rank + dcp - 1, dcp, rounding_mode="floor").clamp_min(0)


def state_bytes(
    shape: RankShape, max_batch: int, max_context: int, reference: bool = False, building: bool = True
) -> int:
    """About how many bytes LayerState(shape, max_batch, max_context) takes while it is built
    (the caches, the fp32 draws they are made from, weights, RoPE tables, mailbox; building
    False: once built, without the draws); with reference=True, plus the working set of
    reference_step over max_batch full contexts (and its fp32 copies of the bf16 weights)."""
    model, topo = shape.model, shape.topology
    page = model.page_size
    local_max = -(-(max_context - topo.rank) // topo.dcp)
    pages = max_batch * max(1, -(-local_max // page)) + 1
    tokens = pages * page
    caches = tokens * (model.index_token_bytes + shape.mla_token_bytes)
    drawing = tokens * (model.query_row * 10 + model.index_dim * 16)  # fp32 draws, scaled copies, quantizing
    weights = 2 * model.q_lora_rank * (shape.heads * model.qk_head_dim + model.index_heads * model.index_dim)
    weights += 2 * shape.heads * model.qk_nope_dim * model.kv_lora_rank
    rope = 4 * max_context * (model.qk_rope_dim + model.index_rope_dim)
    mailbox = max_batch * shape.q_heads * model.query_row * shape.q_bytes
    total = caches + (drawing if building else 0) + weights + rope + mailbox
    if reference:  # dequantized keys and per-head dots of every cached token, a few copies each
        total += 3 * 4 * max_batch * local_max * (model.index_dim + model.index_heads) + 2 * weights
    return total


def _normal(shape, generator, device, scale=1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape, generator=generator, device=device) * scale).to(dtype)


class LayerState:
    """Weights and caches of one DSA layer on one rank, sized for max_batch x max_context."""

    def __init__(self, shape: RankShape, max_batch: int, max_context: int, seed: int = 0, device="cpu"):
        self.shape = shape
        self.max_batch = check_batch(max_batch, "max_batch")
        self.max_context = check_batch(max_context, "max_context")
        if max_context > shape.model.max_seq_len:
            raise ValueError(
                f"max_context {max_context}: more than {shape.model.name}'s max_seq_len {shape.model.max_seq_len}"
            )
        self.device = torch.device(device)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2^63) (torch.Generator's range), got {seed!r}")
        self.seed = seed
        model, topo = shape.model, shape.topology
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        dev = self.device

        cos, sin = formats.rope_table(max_context, model.qk_rope_dim, model.rope_theta, model.yarn)
        icos, isin = formats.rope_table(max_context, model.index_rope_dim, model.rope_theta, model.yarn)
        self.weights = LayerWeights(
            gamma_q=(1 + _normal(model.q_lora_rank, gen, dev, 0.1, torch.float32)).bfloat16(),
            gamma_kv=(1 + _normal(model.kv_lora_rank, gen, dev, 0.1, torch.float32)).bfloat16(),
            w_qb=_normal((shape.heads * model.qk_head_dim, model.q_lora_rank), gen, dev, model.q_lora_rank**-0.5),
            w_uk=_normal((shape.heads, model.qk_nope_dim, model.kv_lora_rank), gen, dev, model.qk_nope_dim**-0.5),
            wq_b_index=_normal(
                (model.index_heads * model.index_dim, model.q_lora_rank), gen, dev, model.q_lora_rank**-0.5
            ),
            index_norm_weight=(1 + _normal(model.index_dim, gen, dev, 0.1, torch.float32)).bfloat16(),
            index_norm_bias=_normal(model.index_dim, gen, dev, 0.1),
            rope_cos=cos.to(dev),
            rope_sin=sin.to(dev),
            index_rope_cos=icos.to(dev),
            index_rope_sin=isin.to(dev),
        )

        page = model.page_size
        local_max = int(local_lens(torch.tensor([max_context]), topo.dcp, topo.rank)[0])
        self.pages_per_seq = max(1, -(-local_max // page))
        # Each sequence owns pages scattered over the pool, as a paged allocator leaves them.
        # One more page, never in a block table, takes the writes of padded rows in graphs.
        owned = max_batch * self.pages_per_seq
        pages = owned + 1
        self.trash_page = owned
        order = torch.randperm(owned, generator=gen, device=dev).to(torch.int32)
        block_tables = order.view(max_batch, self.pages_per_seq)

        keys, scales = formats.quantize_fp8_rows(
            _normal((pages, page, model.index_dim), gen, dev), scale_format=model.fp8_scale_format
        )
        index_cache = torch.empty(pages, formats.index_page_bytes(page, model.index_dim), dtype=torch.uint8, device=dev)
        cache_keys, cache_scales = formats.index_cache_views(index_cache, page, model.index_dim)
        cache_keys.copy_(keys)
        cache_scales.copy_(scales)

        rows = _normal((pages, page, model.query_row), gen, dev)
        if topo.mla_cache == "bf16":
            mla_cache = rows
        else:
            mla_cache = formats.pack_mla_fp8(rows.float(), model.kv_lora_rank, model.fp8_scale_format)
        mailbox = torch.empty(max_batch, shape.q_heads, model.query_row * shape.q_bytes, dtype=torch.uint8, device=dev)
        self.caches = LayerCaches(index_cache, mla_cache, block_tables, formats.arm(mailbox))
        self._gen = gen

    def inputs(self, batch: int, context_lens=None, seed: int | None = None) -> StepInputs:
        """Fresh random inputs for `batch` tokens. context_lens: an int for every sequence,
        a list, or None for random lengths in [1, max_context]."""
        check_batch(batch)
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the state's max_batch {self.max_batch}")
        model, dev = self.shape.model, self.device
        gen = self._gen if seed is None else torch.Generator(device=dev).manual_seed(seed)
        if context_lens is None:
            lens = torch.randint(1, self.max_context + 1, (batch,), generator=gen, device=dev)
        elif isinstance(context_lens, int):
            lens = torch.full((batch,), context_lens, device=dev)
        else:
            given = list(context_lens)
            lens = torch.as_tensor(given, device=dev)
            if lens.is_floating_point() or lens.is_complex() or lens.dtype == torch.bool:
                raise ValueError(f"context_lens must be ints, got {given}")
        if lens.shape != (batch,):
            raise ValueError(f"context_lens must give {batch} lengths, got shape {tuple(lens.shape)}")
        if int(lens.min()) < 1 or int(lens.max()) > self.max_context:
            raise ValueError(f"context_lens must be in [1, {self.max_context}], got {lens.tolist()}")
        lens = lens.to(torch.int32)
        block_tables = self.caches.block_tables[:batch]
        qkv = _normal((batch, model.packed_width), gen, dev)
        return StepInputs(qkv, lens, self.new_token_slots(lens, block_tables), block_tables)

    def peer_inputs(self, inputs: StepInputs, seed: int | None = None) -> PeerInputs:
        """Random but well-formed peer contributions for a DCP step: each rank r offers
        min(topk, its local length) distinct positions p with p % dcp == r."""
        s, dev = self.shape, self.device
        topo, k, batch = s.topology, s.model.index_topk, inputs.batch
        gen = self._gen if seed is None else torch.Generator(device=dev).manual_seed(seed)
        rows = _normal((batch, s.gathered, s.model.query_row), gen, dev, dtype=torch.float32)
        positions = torch.full((batch, topo.dcp, k), -1, dtype=torch.int32, device=dev)
        scores = torch.full((batch, topo.dcp, k), float("-inf"), device=dev)
        for rank in range(topo.dcp):
            lens = local_lens(inputs.context_lens, topo.dcp, rank)
            width = max(1, int(lens.max()))
            shuffle = torch.rand((batch, width), generator=gen, device=dev)
            shuffle = shuffle.masked_fill(torch.arange(width, device=dev)[None] >= lens[:, None], 2.0)
            picks = shuffle.argsort(dim=1)[:, :k]
            count = lens.clamp(max=k)[:, None]
            keep = torch.arange(picks.shape[1], device=dev)[None] < count
            value = torch.randn((batch, picks.shape[1]), generator=gen, device=dev).sort(dim=1, descending=True).values
            n = picks.shape[1]
            positions[:, rank, :n] = torch.where(keep, picks * topo.dcp + rank, -1).to(torch.int32)
            scores[:, rank, :n] = torch.where(keep, value, float("-inf"))
        return PeerInputs(rows, positions, scores)

    def new_token_slots(self, context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """This rank's cache slot of each new token (position len - 1), -1 if another rank holds it."""
        topo, page = self.shape.topology, self.shape.model.page_size
        pos = context_lens.long() - 1
        local = torch.div(pos, topo.dcp, rounding_mode="floor")
        # a position another rank holds may lie past this rank's narrower table: clamped, not used
        column = torch.div(local, page, rounding_mode="floor").clamp(0, block_tables.shape[1] - 1)
        pages = block_tables.long().gather(1, column[:, None])[:, 0]
        slots = pages * page + local % page
        return torch.where(pos % topo.dcp == topo.rank, slots, -1).to(torch.int32)

    def load_shard(self, full: LayerState) -> None:
        """Make this state DCP rank `topology.rank`'s shard of `full`, one unsharded layer
        (dcp 1, this rank's gathered heads, the same max_batch and max_context): Q_B and W_UK
        of this rank's heads, the other weights as they are, and the cache rows of the
        positions p with p % dcp == rank at local index p // dcp, through this state's own
        block tables. In place, so a step's stages and graphs keep their tensors; the
        mailbox is re-armed."""
        s, f = self.shape, full.shape
        topo, page = s.topology, s.model.page_size
        if f.model != s.model or f.topology.dcp != 1 or f.heads != s.gathered:
            raise ValueError(
                f"load_shard needs the unsharded layer of {s.model.name} with {s.gathered} heads and dcp 1, "
                f"got {f.model.name} {f.topology.name} ({f.heads} heads)"
            )
        if (f.topology.q_format, f.topology.mla_cache) != (topo.q_format, topo.mla_cache):
            raise ValueError("load_shard: the unsharded layer's q_format and mla_cache must be this rank's")
        if (full.max_batch, full.max_context) != (self.max_batch, self.max_context):
            raise ValueError(
                f"load_shard: the unsharded layer holds {full.max_batch} x {full.max_context} tokens, "
                f"this rank's state {self.max_batch} x {self.max_context}"
            )
        heads = slice(topo.rank * s.heads, (topo.rank + 1) * s.heads)
        for name, mine in vars(self.weights).items():
            theirs = getattr(full.weights, name)
            if name == "w_qb":
                theirs = theirs.unflatten(0, (f.heads, -1))[heads].flatten(0, 1)
            elif name == "w_uk":
                theirs = theirs[heads]
            mine.copy_(theirs)
        dev = self.device
        local = torch.arange(self.pages_per_seq * page, device=dev)
        # positions past the unsharded tables (past max_context) are never read: any row will do
        position = (local * topo.dcp + topo.rank).clamp(max=full.pages_per_seq * page - 1)
        full_pages = full.caches.block_tables.long()[:, (position // page).to(full.device)].to(dev)
        pages = self.caches.block_tables.long()[:, local // page]
        full_offsets, offsets = (position % page).expand_as(pages), (local % page).expand_as(pages)
        source = full.caches.mla_cache.to(dev)  # (a copy only when the devices differ)
        self.caches.mla_cache[pages, offsets] = source[full_pages, full_offsets]
        keys, scales = formats.index_cache_views(self.caches.index_cache, page, s.model.index_dim)
        full_keys, full_scales = formats.index_cache_views(full.caches.index_cache.to(dev), page, s.model.index_dim)
        keys[pages, offsets] = full_keys[full_pages, full_offsets]
        scales[pages, offsets] = full_scales[full_pages, full_offsets]
        formats.arm(self.caches.mailbox)

    def clone_caches(self) -> LayerCaches:
        """A copy of the caches, so a reference run and a kernel run can start from the same state."""
        c = self.caches
        return LayerCaches(c.index_cache.clone(), c.mla_cache.clone(), c.block_tables.clone(), c.mailbox.clone())
