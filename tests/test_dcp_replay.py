"""Issue 10, the DCP 2 bullet: a B = 1 replay of a DCP step took ~250 us more once the step
had also captured a size-64 graph.

What a replay of size 1 launches does not depend on the largest captured size (CPU: the
launch arguments and the rows the step's own copies and fills touch). The ~250 us was
DcpMerge counting ties for its k-th candidate with a serial scan of all dcp x k
candidates when the radix search had already taken that candidate's bin whole (need ==
ALL): data-dependent (~1 token in 15-20 of the step's random data), and the data of a B = 1
replay depends on the largest captured size because the seeded LayerState (block tables,
cache contents) is sized by it. The GPU test times DcpMerge on candidates built to take
that path; the CPU tests check the construction against a model of the search and that
the kernel's PTX skips the scan when need == ALL.
"""

import re
from dataclasses import replace

import pytest
import torch
from graphstep.kernels import catalog

from conftest import SMALL, launch_on_cpu
from graphstep.launch import DEFAULT_BUDGET_NS, Kernels
from graphstep.shapes import RankShape, Topology
from graphstep.stages import CuteStages
from graphstep.step import DecodeStep

K, DCP, ALL = 2048, 2, 2**31 - 1
ROUNDS = ((21, 11), (10, 11), (0, 10))  # kernels/top_k.py's radix digits


# -- a replay of size 1 on a step that captured [1, 8] ------------------------------------


class Recorder:
    calls: list = []

    def __init__(self, op):
        self.op = op

    def __call__(self, *args):
        Recorder.calls.append((type(self.op).__name__, [a.value for a in args if hasattr(a, "value")]))


@pytest.fixture
def recorded(monkeypatch):
    launch_on_cpu(monkeypatch, lambda op, args: Recorder(op))
    Recorder.calls = []
    return Recorder.calls


@pytest.mark.parametrize("mode", ["fork", "fork_poll", "serial"])
def test_a_size_1_replay_launches_and_touches_one_row_whatever_the_largest_size(recorded, mode):
    # the kernels' indexer geometry (Kernels rejects SMALL's 8 index heads)
    shape = RankShape(replace(SMALL, index_heads=64), Topology(tp=4, dcp=2, rank=1))
    step = DecodeStep(shape, capture_sizes=(8, 1), backend="torch", device="cpu", max_context=200)
    # the cute launchers, recording instead of launching
    step.stages = CuteStages(step.state, step.buffers, step.error, DEFAULT_BUDGET_NS)
    b, mailbox = step.buffers, step.caches.mailbox
    assert mailbox.shape[0] == step.transport.rows.shape[0] == 8
    mailbox[1:] = 0x5A
    step.transport.rows.fill_(0x11)
    b.q_out[1:] = 0x5A
    step.run_stages(1, mode)

    names = [name for name, _ in recorded]
    expect = {
        "fork": ["KeyAndNorm", "IndexQuery", "DsaIndex", "ClusterTopK", "MlaQuery", "QueryWait", "DcpMerge"],
        "fork_poll": ["KeyAndNorm", "IndexQuery", "DsaIndex", "ClusterTopK", "MlaQuery", "DcpMerge"],
        "serial": ["IndexKey", "MlaQuery", "IndexQuery", "DsaIndex", "ClusterTopK", "DcpMerge"],
    }[mode]
    assert names == expect + ["SparseCore"]
    for name, scalars in recorded:
        assert scalars[0] == 1, (name, scalars)  # the batch: the replayed size, never 8
    for name, scalars in recorded:
        if name == "QueryWait":
            assert scalars == [1, 1, DEFAULT_BUDGET_NS]  # batch, one CTA, the 200 ms budget
        if name == "MlaQuery":  # batch, eps, the budget, then the range guards' bounds
            assert scalars[2] == DEFAULT_BUDGET_NS
            assert scalars[3:] == [step.caches.mla_cache.shape[0] * 64, 200]  # MLA cache slots, RoPE rows
    # the peers' rows landed in row 0 only (the SparseCore launch then copies row 0 to q_out
    # and re-arms it: tests/test_sparse_core_gpu.py); rows 1.. never touched
    own = slice(shape.topology.rank * shape.heads, (shape.topology.rank + 1) * shape.heads)
    assert (mailbox[0, : own.start] == 0x11).all() and (mailbox[0, own.stop : shape.gathered] == 0x11).all()
    assert (mailbox[1:] == 0x5A).all() and (b.q_out[1:] == 0x5A).all()


# -- DcpMerge's tie count ---------------------------------------------------------------------


def _keys(scores: torch.Tensor) -> torch.Tensor:
    """kernels/top_k.py's order_key, as int64."""
    bits = scores.float().view(torch.int32).long() & 0xFFFFFFFF
    bits = torch.where(bits == 0x80000000, 0, bits)  # -0.0 keyed as +0.0
    flip = torch.where(bits >> 31 == 1, 0xFFFFFFFF, 0x80000000)
    return bits ^ flip


def search(keys: torch.Tensor, k: int) -> tuple[int, int, int]:
    """RadixSelect.find_threshold on the valid keys -> (threshold, need, rounds run)."""
    if keys.numel() < k:
        return 0, ALL, 1
    prefix, need = 0, k
    for r, (shift, bits) in enumerate(ROUNDS):
        pool = keys if r == 0 else keys[keys >> (shift + bits) == prefix]
        hist = torch.bincount(((pool >> shift) & ((1 << bits) - 1)), minlength=1 << bits).flip(0)
        above = hist.cumsum(0) - hist
        b = int(((above < need) & (above + hist >= need)).nonzero()[0])
        prefix = (prefix << bits) | ((1 << bits) - 1 - b)
        need -= int(above[b])
        if int(hist[b]) == need:
            return prefix << shift, ALL, r + 1
    return prefix, need, len(ROUNDS)


def tied_kth_candidates(batch: int, device="cpu", tied: bool = True):
    """Rank 0's and rank 1's candidates (TopK's form: ascending positions, -inf never) for
    which the global k-th best is rank 0's and the search resolves in its last round with
    need == ALL (a rank-1 score one ulp below it shares its first two digits): the case
    that ran DcpMerge's tie scan for nothing. tied=False moves that rank-1 score away (the
    search ends in its first round): the baseline."""
    gen = torch.Generator().manual_seed(3)
    low = torch.tensor([2.3], dtype=torch.float32).view(torch.int32)
    low = ((low & ~0x3FF) | 0x200).view(torch.float32)  # its last 10 bits are not all zero
    own = (low + 4e-4 * torch.arange(K)).float()  # 2048 distinct scores in [2.3, 3.12)
    peer = torch.rand(K, generator=gen) * 1.9  # below every own score
    peer[0] = (low.view(torch.int32) - 1).view(torch.float32) if tied else 1.0
    own_scores = torch.stack([own[torch.randperm(K, generator=gen)] for _ in range(batch)])
    peer_scores = torch.stack([peer[torch.randperm(K, generator=gen)] for _ in range(batch)])
    own_positions = (torch.arange(K) * 4 * DCP).int().expand(batch, K).contiguous()  # rank 0: even
    peer_positions = (torch.arange(K) * 4 * DCP + 1).int().expand(batch, K).contiguous()  # rank 1: odd
    return [t.to(device) for t in (own_positions, own_scores, peer_positions, peer_scores)]


@pytest.mark.parametrize("tied", [True, False])
def test_the_constructed_candidates_take_the_path_the_gpu_test_times(tied):
    own_positions, own_scores, _, peer_scores = tied_kth_candidates(1, tied=tied)
    own, peer = _keys(own_scores[0]), _keys(peer_scores[0])
    threshold, need, rounds = search(torch.cat([own, peer]), K)
    assert need == ALL and rounds == (3 if tied else 1)
    if tied:  # the k-th is rank 0's: before the fix it counted ties over all dcp x k
        assert int((own == threshold).sum()) == 1 and int((own > threshold).sum()) == K - 1


def test_dcp_merge_counts_ties_only_when_need_is_not_all(tmp_path):
    from graphstep.kernels import dcp_merge

    catalog.compile_op(dcp_merge.DcpMerge(K, DCP, 0), dcp_merge.compile_args(), "sm_90a", str(tmp_path))
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    assert re.search(r"setp\.(eq|ne)\.(b|s)32\s+%p\d+, %r\d+, 2147483647;", ptx), "need == ALL decides the tie count"


# -- on the GPU -------------------------------------------------------------------------------


def _merge_us(kernels, tables, candidates, out, batch: int, launches: int = 20) -> float:
    own_positions, own_scores, peer_positions, peer_scores = candidates
    peers_p = torch.stack([own_positions, peer_positions], dim=1).contiguous()  # [B, dcp, k]; rank 0's unused
    peers_s = torch.stack([own_scores, peer_scores], dim=1).contiguous()
    run = lambda: kernels.dcp_merge(own_positions, own_scores, peers_p, peers_s, tables, out, batch)  # noqa: E731
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / launches


@pytest.mark.gpu
def test_dcp_merge_takes_a_whole_threshold_bin_without_counting_ties():
    from graphstep import reference as ref
    from graphstep.shapes import preset
    from graphstep.state import LayerState

    state = LayerState(
        RankShape(preset("deepseek-v3.2"), Topology(tp=8, dcp=DCP, rank=0)),
        max_batch=4,
        max_context=32768,
        seed=5,
        device="cuda",
    )
    kernels, tables = Kernels(state.shape, state.weights), state.caches.block_tables
    times = {}
    for tied in (False, True):
        candidates = tied_kth_candidates(4, "cuda", tied)
        out = torch.full((4, K), -9, dtype=torch.int32, device="cuda")
        times[tied] = _merge_us(kernels, tables, candidates, out, 4)
        own_positions, own_scores, peer_positions, peer_scores = candidates
        ranks = [ref.Candidates(own_positions, own_scores), ref.Candidates(peer_positions, peer_scores)]
        merged = ref.dcp_merge(ranks, K)
        assert torch.equal(out, ref.local_slots(merged, tables, 64, DCP, 0)), tied
    # before the fix the tied case added a 4096-load serial scan: ~100-250 us
    assert times[True] < 2 * times[False] + 10, times
