"""decode_rms_norm: the Triton kernel (interpreted on CPU) against the torch reference, the
argument checks, and on a GPU under programmatic dependent launch in a CUDA graph."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_rms_norm import decode_rms_norm
from mcore_kernels.errors import KernelShapeError
from mcore_kernels.reference import rms_norm_reference

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _rows(rows, k, dtype, device):
    generator = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=generator) * 3).to(dtype).to(device)
    weight = (1 + 0.2 * torch.randn(k, generator=generator)).to(dtype).to(device)
    return x, weight


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize(("rows", "k"), [(1, 896), (2, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rms_norm_matches_reference(monkeypatch, rows, k, dtype):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, weight = _rows(rows, k, dtype, device)
    got = decode_rms_norm(x, weight, 1e-6)
    expected = rms_norm_reference(x, weight, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        # float32 sums in another order: at most one bfloat16 rounding step apart.
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2**-7)


def test_decode_rms_norm_rejects_bad_shapes():
    x, weight = _rows(2, 8, torch.float32, "cpu")
    with pytest.raises(KernelShapeError, match="weight"):
        decode_rms_norm(x, weight[:-1])
    with pytest.raises(KernelShapeError, match="x"):
        decode_rms_norm(x[0], weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_rms_norm_in_a_graph_with_pdl():
    from mcore_kernels.pdl import programmatic_dependent_launch

    x, weight = _rows(2, 896, torch.bfloat16, "cuda")
    eager = decode_rms_norm(x, weight)
    expected = rms_norm_reference(x, weight, 1e-6).float()
    torch.testing.assert_close(eager.float(), expected, rtol=2**-7, atol=2**-7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with programmatic_dependent_launch(), torch.cuda.graph(graph, stream=stream):
        doubled = x * 2  # the previous kernel writes the rows
        normed = decode_rms_norm(doubled, weight)
    x.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(normed, eager)
