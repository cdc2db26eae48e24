import pytest
import torch

from graphstep.shapes import ModelShape, RankShape, Topology


# A small layer with the real row formats (1536 q_a, 576 query rows, 132 B indexer
# tokens) but few heads and a short top-k, so CPU tests run in seconds.
SMALL = ModelShape(name="small", heads=16, index_heads=8, index_topk=64)


@pytest.fixture
def small():
    return RankShape(SMALL, Topology(tp=4))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
