import torch

from graphstep import formats
from graphstep import reference as ref
from graphstep.state import LayerState


def test_no_encoded_query_word_is_the_sentinel():
    x = torch.randn(64, 576) * 1000
    x[0, :5] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e30])
    for fmt in ("bf16", "fp8"):
        words = formats.encode_q_rows(x, fmt).contiguous().view(torch.int32)
        assert not (words == -1).any()


def test_mailbox_landing_and_first_missing(small):
    state = LayerState(small.with_topology(dcp=2, rank=0), max_batch=3, max_context=64)
    caches = state.clone_caches()
    assert not formats.chunk_landed(caches.mailbox, 3, 8).any()
    assert formats.first_missing(caches.mailbox, 3, 8) == (0, 0, 0)
    rows = torch.randn(3, 4, 576)
    ref.publish(state, caches, rows)  # rank 0: head rows 0..3
    assert formats.chunk_landed(caches.mailbox, 3, 8)[:, :4].all()
    assert formats.first_missing(caches.mailbox, 3, 8) == (0, 4, 0)
    ref.publish(state, caches, rows, rank=1)
    assert formats.first_missing(caches.mailbox, 3, 8) is None
    # a torn chunk: one word still the sentinel
    caches.mailbox[2, 6, 17 * 16 + 4 : 17 * 16 + 8] = formats.SENTINEL_BYTE
    assert formats.first_missing(caches.mailbox, 3, 8) == (2, 6, 17)
    # pad rows beyond `gathered` are never polled
    assert state.shape.q_heads == 16 and formats.first_missing(caches.mailbox, 3, 8) == (2, 6, 17)


def test_mla_fp8_round_trip():
    rows = torch.randn(10, 576) * 3
    packed = formats.pack_mla_fp8(rows, 512)
    assert packed.shape == (10, 656) and packed.dtype == torch.uint8
    back = formats.unpack_mla_fp8(packed, 512)
    assert torch.equal(back[:, 512:], rows[:, 512:].bfloat16().float())
    err = (back[:, :512] - rows[:, :512]).norm() / rows[:, :512].norm()
    assert 0 < err < 0.05


def test_index_cache_views_share_storage():
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    keys, scales = formats.index_cache_views(cache, 64, 128)
    scales[1, 3] = 2.5
    keys[1, 3, 0] = 7
    assert cache[1, 3 * 128] == 7 and cache[1, 8192 + 12 : 8192 + 16].view(torch.float32).item() == 2.5
