"""Split-K partials and their sum + residual add + RMSNorm (interpreted on CPU) against torch."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.reference import split_sum_add_rms_norm_reference
from mcore_kernels.rms_norm import rms_norm
from mcore_kernels.split_sum_rms_norm import split_k_partials, split_sum_add_rms_norm

pytestmark = pytest.mark.interpreter


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(rows: int, hidden: int, splits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    partials = torch.randn(splits, rows, hidden, generator=g)
    residual = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    weight = (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    return partials, residual, weight


def test_partials_sum_to_the_product():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 24, generator=g), torch.randn(7, 24, generator=g)
    partials = split_k_partials(x, w, 3)
    assert partials.shape == (3, 5, 7) and partials.dtype == torch.float32
    for s in range(3):
        torch.testing.assert_close(partials[s], x[:, 8 * s : 8 * s + 8] @ w[:, 8 * s : 8 * s + 8].T)
    torch.testing.assert_close(partials.sum(0), x @ w.T, atol=1e-5, rtol=1e-5)


def test_reference_is_rms_norm_of_the_rounded_sum():
    partials, residual, weight = _inputs(4, 48, 3)
    normed, hidden = split_sum_add_rms_norm_reference(partials, residual, weight, 1e-6)
    total = (partials[0] + partials[1] + partials[2]).to(torch.bfloat16)
    expected_normed, expected_hidden = rms_norm(total, weight, 1e-6, residual=residual)
    assert torch.equal(hidden, expected_hidden)
    torch.testing.assert_close(normed, expected_normed, atol=0, rtol=8e-3)


@pytest.mark.parametrize(("rows", "hidden", "splits"), [(3, 48, 4), (1, 40, 1), (6, 64, 2)])
def test_kernel_matches_reference(triton_backend, rows, hidden, splits):
    partials, residual, weight = _inputs(rows, hidden, splits, seed=rows)
    normed, new_residual = split_sum_add_rms_norm(partials, residual, weight, 1e-5)
    expected_normed, expected_residual = split_sum_add_rms_norm_reference(
        partials, residual, weight, 1e-5
    )
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(normed, expected_normed, atol=0, rtol=8e-3)


def test_rejects_bad_arguments():
    partials, residual, weight = _inputs(2, 16, 2)
    with pytest.raises(KernelShapeError, match=r"partials\.shape"):
        split_sum_add_rms_norm(partials[0], residual, weight, 1e-5)
    with pytest.raises(KernelShapeError, match=r"weight\.shape"):
        split_sum_add_rms_norm(partials, residual, weight[:8], 1e-5)
    with pytest.raises(KernelDtypeError, match=r"partials\.dtype"):
        split_sum_add_rms_norm(partials.double(), residual, weight, 1e-5)
    with pytest.raises(KernelValueError, match="splits"):
        split_k_partials(residual, residual, 0)
    with pytest.raises(KernelShapeError, match="does not divide"):
        split_k_partials(residual, residual, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_down_projection_path_matches_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 4864, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.02 * torch.randn(896, 4864, device="cuda", generator=g)).to(torch.bfloat16)
    residual = torch.randn(64, 896, device="cuda", generator=g).to(torch.bfloat16)
    norm = (1.0 + 0.1 * torch.randn(896, device="cuda", generator=g)).to(torch.bfloat16)
    partials = split_k_partials(x, w, 4)
    torch.testing.assert_close(partials.sum(0), x.float() @ w.float().T, atol=2e-3, rtol=2e-3)
    normed, new_residual = split_sum_add_rms_norm(partials, residual, norm, 1e-6)
    expected = split_sum_add_rms_norm_reference(partials, residual, norm, 1e-6)
    assert torch.equal(new_residual, expected[1])
    torch.testing.assert_close(normed, expected[0], atol=0, rtol=8e-3)
