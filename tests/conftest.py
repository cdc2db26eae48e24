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
    without its CUDA check), a fake stream "stream", and `stand_in(op, placeholder_args)`
    in place of every compiled kernel."""
    from graphstep.kernels import catalog
    from graphstep.kernels.primitives import gmem_ptr

    from graphstep import launch

    def cpu_ptr(tensor, align=16):
        return gmem_ptr(launch._cutlass_dtype(tensor.dtype), tensor.data_ptr(), align)

    monkeypatch.setattr(launch, "ptr", cpu_ptr)
    monkeypatch.setattr(launch, "current_stream", lambda: "stream")
    monkeypatch.setattr(catalog, "compile_op", lambda op, args, arch=None, dump_dir=None: stand_in(op, args))
