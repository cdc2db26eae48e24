import math

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


def launch_on_cpu(monkeypatch, stand_in) -> None:
    """graphstep.launch's launchers without a GPU: pointers to CPU tensors (launch.ptr
    without its CUDA check, its alignment and dtype checks kept), a fake stream "stream",
    and `stand_in(op, placeholder_args)` in place of every compiled kernel."""
    from graphstep.kernels import catalog
    from graphstep.kernels.primitives import gmem_ptr

    from graphstep import launch

    def cpu_ptr(tensor, align=16):
        return gmem_ptr(launch._cutlass_dtype(tensor.dtype), launch.aligned_address(tensor, align), align)

    monkeypatch.setattr(launch, "ptr", cpu_ptr)
    monkeypatch.setattr(launch, "current_stream", lambda: "stream")
    monkeypatch.setattr(catalog, "compile_op", lambda op, args, arch=None, dump_dir=None: stand_in(op, args))


def yarn_inv_freq(model, dim: int) -> torch.Tensor:
    """float64 [dim / 2]: the RoPE inverse frequencies of `model`, written from DeepSeek-V3.2-Exp
    inference/model.py's precompute_freqs_cis in Python floats, not through graphstep.formats."""
    base, scaling = model.rope_theta, model.rope_scaling
    plain = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    if scaling is None or model.max_seq_len <= scaling.original_positions:
        return torch.tensor(plain, dtype=torch.float64)

    def correction(rotations):
        return dim * math.log(scaling.original_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(scaling.beta_fast)), 0)
    high = min(math.ceil(correction(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, freq in enumerate(plain):
        smooth = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(freq / scaling.factor * (1 - smooth) + freq * smooth)
    return torch.tensor(out, dtype=torch.float64)


def hadamard_matrix(n: int) -> torch.Tensor:
    """float64 [n, n]: the Sylvester Hadamard matrix (entry (i, j) = (-1)^popcount(i & j)) / sqrt(n)."""
    signs = [[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]
    return torch.tensor(signs, dtype=torch.float64) / math.sqrt(n)
