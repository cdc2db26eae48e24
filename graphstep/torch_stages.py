"""Graph-capturable torch versions of the stages the reference writes with data-dependent
shapes: fixed shapes per captured batch, no host synchronization, and the padded rows'
writes (slot -1) sent to the state's spare page instead of being masked out.

graphstep.stages.TorchStages runs them as DecodeStep's torch backend (the plain-torch
baseline: cuBLAS bf16 GEMMs, an fp32 bmm over the dequantized FP8 indexer cache, torch.topk).

`guard_inputs` is the torch backend's side of the kernels' range guards: it records in the
step's error word what the CuTe DSL kernels would (kernels/guards.py: the same lowest
(check, token, value)) and makes the ids safe in place, so the stages after it write and
read in bounds: a bad slot becomes -1 (written to the spare page), a bad page the spare
page (scored -inf by index_scores: a hole), a bad length is clamped to the RoPE table.
Nothing is raised here (a stage never synchronizes); DecodeStep.check() raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import formats
from . import reference as ref
from .kernels import guards
from .launch import guard_bounds
from .state import LayerCaches, LayerState, StepInputs, local_lens


def _write_slots(state: LayerState, slots: torch.Tensor) -> torch.Tensor:
    """slot -1 -> a slot of the spare page (writes land where nothing reads)."""
    trash = state.trash_page * state.shape.model.page_size
    return torch.where(slots >= 0, slots, trash).long()


def _records(check: int, values: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """The smallest record (kernels/guards.py) of the `bad` entries of `values` ([B] or
    [B, n], row = token), EMPTY if none: int64 []. `check` stays a Python scalar: a host
    tensor copied to the GPU would be a pageable copy, illegal inside a graph capture."""
    token = torch.arange(values.shape[0], device=values.device)
    if values.dim() == 2:
        token = token[:, None]
    packed = ((token << 32) | (values.long() & 0xFFFFFFFF)) | (check << 56)
    return torch.where(bad, packed, guards.EMPTY).min()


def guard_inputs(state: LayerState, inputs: StepInputs, record: torch.Tensor) -> None:
    """Record the inputs' out-of-range ids in `record` (the error word's int64 [1] view, a
    running minimum) as the kernels would, and make them safe in place (module docstring).
    Graph-capturable: elementwise ops and reductions over the batch, no synchronization."""
    page, topo = state.shape.model.page_size, state.shape.topology
    lens, slots, tables = inputs.context_lens, inputs.slot_mapping, inputs.block_tables
    bounds = guard_bounds(state)  # the kernels' bounds: [lo, hi) per check
    index_slots, mla_slots = bounds[guards.INDEX_KEY_SLOT][1], bounds[guards.MLA_QUERY_SLOT][1]
    index_rows, mla_rows = bounds[guards.INDEX_KEY_LENGTH][1] - 1, bounds[guards.MLA_QUERY_LENGTH][1] - 1
    index_pages = bounds[guards.DSA_INDEX_PAGE][1]
    index_ok = (slots >= 0) & (slots < index_slots)
    mla_ok = (slots >= 0) & (slots < mla_slots)
    # the pages DsaIndex reads: the used part of each table, by the raw lengths
    used = torch.div(local_lens(lens, topo.dcp, topo.rank) + page - 1, page, rounding_mode="floor")
    columns = torch.arange(tables.shape[1], device=tables.device)[None]
    page_ok = (tables >= 0) & (tables < index_pages)
    found = torch.stack(
        [
            _records(guards.INDEX_KEY_SLOT, slots, ~index_ok & (slots != -1)),
            _records(guards.INDEX_KEY_LENGTH, lens, index_ok & ((lens < 1) | (lens > index_rows))),
            _records(guards.MLA_QUERY_SLOT, slots, ~mla_ok & (slots != -1)),
            _records(guards.MLA_QUERY_LENGTH, lens, (lens < 1) | (lens > mla_rows)),
            _records(guards.INDEX_QUERY_LENGTH, lens, (lens < 1) | (lens > index_rows)),
            _records(guards.DSA_INDEX_PAGE, tables, ~page_ok & (columns < used[:, None])),
        ]
    ).min()
    torch.minimum(record, found, out=record)
    slots.copy_(torch.where(index_ok & mla_ok, slots, -1))
    lens.clamp_(1, min(index_rows, mla_rows))
    tables.copy_(torch.where(page_ok, tables, state.trash_page))


def index_key_insert(state: LayerState, inputs: StepInputs, caches: LayerCaches) -> None:
    """IndexKey in torch: the reference's keys, pad rows' writes sent to the spare page."""
    keys, scales = ref.index_key(state, inputs)
    ref.store_index_keys(state, caches, _write_slots(state, inputs.slot_mapping), keys, scales)


def index_scores(
    state: LayerState, caches: LayerCaches, inputs: StepInputs, q_fp8, head_w, out: torch.Tensor | None = None
) -> torch.Tensor:
    """DsaIndex over every local position a block table can hold: an fp32 bmm over the
    dequantized cache (torch's bf16 bmm would round the dot products to bf16), -inf past
    each length. fp32 [B, pages per sequence x page size], into `out` if given."""
    m, topo = state.shape.model, state.shape.topology
    width = state.pages_per_seq * m.page_size
    keys, scales = formats.index_cache_views(caches.index_cache, m.page_size, m.index_dim)
    tables = inputs.block_tables.long()
    k = keys[tables].view(formats.FP8).float().flatten(1, 2)  # [B, width, dim]
    k_scale = scales[tables].flatten(1)  # [B, width]
    q = q_fp8.view(formats.FP8).float()  # [B, heads, dim]
    dots = torch.relu(torch.bmm(q, k.transpose(1, 2)))  # [B, heads, width]
    score = torch.mul(torch.bmm(head_w.unsqueeze(1), dots).squeeze(1), k_scale, out=out)
    lens = local_lens(inputs.context_lens, topo.dcp, topo.rank)
    past = torch.arange(width, device=score.device)[None] >= lens[:, None]
    # the spare page is never a sequence's: guard_inputs put it where a page was out of range
    hole = (inputs.block_tables == state.trash_page).repeat_interleave(m.page_size, dim=1)
    return score.masked_fill_(past | hole, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk (ties in no defined order), -1 past the finite scores. int32 [B, k].
    NaN and inf scores are never selected (torch.topk would rank NaN first)."""
    scores = scores.masked_fill(~torch.isfinite(scores), float("-inf"))
    if scores.shape[1] < k:
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[1]), value=float("-inf"))
    values, indices = torch.topk(scores, k, dim=1)
    return torch.where(torch.isfinite(values), indices, -1).to(torch.int32)


def kv_insert(state: LayerState, inputs: StepInputs, caches: LayerCaches) -> None:
    """The new tokens' MLA cache rows, pad rows' writes sent to the spare page."""
    ref.store_kv_rows(state, caches, _write_slots(state, inputs.slot_mapping), ref.kv_row(state, inputs))


def mla_query(state: LayerState, inputs: StepInputs, caches: LayerCaches, q_c: torch.Tensor) -> None:
    """MlaQuery in torch: Q_B as a cuBLAS bf16 GEMM, W_UK as a bf16 bmm, RoPE; the query
    rows published at this rank's head rows; the KV insert."""
    s, w = state.shape, state.weights
    kv_insert(state, inputs, caches)
    q = F.linear(q_c, w.w_qb).view(-1, s.heads, s.model.qk_head_dim)
    latent = torch.bmm(q[..., : s.model.qk_nope_dim].transpose(0, 1), w.w_uk).transpose(0, 1)
    ref.publish(state, caches, ref.query_rows_from(state, inputs, latent, q[..., s.model.qk_nope_dim :]))


def sparse_core(
    state: LayerState, caches: LayerCaches, slots: torch.Tensor, batch: int, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """The reference's sparse attention over `slots` of the mailbox's query rows, into `out` and
    `lse`."""
    attention, log_sum_exp = ref.sparse_attention(state, caches, ref.query_rows(state, caches, batch), slots)
    out.copy_(attention)
    lse.copy_(log_sum_exp)
