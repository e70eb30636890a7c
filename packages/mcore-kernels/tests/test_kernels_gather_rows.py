"""gather_row_pairs: the Triton kernel (interpreted on CPU) against ``index_select``, the
argument checks, and on a GPU the same under programmatic dependent launch in a CUDA graph."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.gather_rows import gather_row_pairs

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _tables(device):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(50, 1100, generator=generator).to(torch.bfloat16).to(device)
    b = torch.randn(40, 2, 24, generator=generator).to(device).flatten(1)
    return a, b


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("count", [0, 1, 3])
def test_gather_row_pairs_equals_index_select(monkeypatch, count):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = _tables(device)
    a_index = torch.tensor([49, 0, 7][:count], dtype=torch.long, device=device)
    b_index = torch.tensor([3, 39, 3][:count], dtype=torch.int32, device=device)
    rows_a, rows_b = gather_row_pairs(a, a_index, b, b_index)
    assert torch.equal(rows_a, a.index_select(0, a_index))
    assert torch.equal(rows_b, b.index_select(0, b_index))


def test_gather_row_pairs_rejects_bad_arguments():
    a, b = _tables("cpu")
    index = torch.tensor([1, 2])
    with pytest.raises(KernelShapeError, match="a_index"):
        gather_row_pairs(a, index, b, index[:1])
    with pytest.raises(KernelShapeError, match="table"):
        gather_row_pairs(a[0], index, b, index)
    with pytest.raises(KernelDtypeError, match="integer"):
        gather_row_pairs(a, index.float(), b, index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gather_row_pairs_in_a_graph_with_pdl():
    from mcore_kernels.pdl import programmatic_dependent_launch

    a, b = _tables("cuda")
    index = torch.tensor([5, 9], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with programmatic_dependent_launch(), torch.cuda.graph(graph, stream=stream):
        rows_a, rows_b = gather_row_pairs(a, index, b, index)
        # A dependent launch after it reads what it wrote.
        doubled = rows_b * 2
    index.copy_(torch.tensor([1, 30], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows_a, a[[1, 30]])
    assert torch.equal(doubled, b[[1, 30]] * 2)
