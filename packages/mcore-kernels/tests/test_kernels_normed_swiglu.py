"""SwiGLU of a norm-folded gate/up product (interpreted on CPU) against torch."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel modules' import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe.swiglu import swiglu
from mcore_kernels.normed_swiglu import normed_swiglu
from mcore_kernels.reference import normed_swiglu_reference
from mcore_kernels.rms_norm import rms_norm

pytestmark = pytest.mark.interpreter


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(rows: int, hidden: int, ffn: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (3.0 * torch.randn(rows, hidden, generator=g)).to(torch.bfloat16)
    weight = torch.randn(2 * ffn, hidden, generator=g) / hidden**0.5
    norm_weight = 1.0 + 0.3 * torch.randn(hidden, generator=g)
    return x, weight, norm_weight


def test_folded_weight_and_row_scale_give_swiglu_of_the_normed_product():
    # float32 throughout: the fold is exact up to the order of the float32 sums.
    x, weight, norm_weight = _inputs(5, 48, 40)
    x = x.float()
    expected = swiglu(rms_norm(x, norm_weight, 1e-6) @ weight.T)
    actual = normed_swiglu_reference(x @ (weight * norm_weight).T, x, 1e-6)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("rows", "hidden", "ffn"), [(3, 48, 40), (1, 40, 1100), (6, 64, 16)])
def test_kernel_matches_reference(triton_backend, rows, hidden, ffn):
    x, weight, norm_weight = _inputs(rows, hidden, ffn, seed=rows)
    gate_up = (x.float() @ (weight * norm_weight).T).to(torch.bfloat16)
    actual = normed_swiglu(gate_up, x, 1e-5)
    expected = normed_swiglu_reference(gate_up, x, 1e-5)
    assert actual.shape == (rows, ffn) and actual.dtype == torch.bfloat16
    # Triton's exp against torch's: at most one bf16 ulp apart.
    torch.testing.assert_close(actual, expected, atol=4 * 2**-6, rtol=1.6e-2)


def test_bf16_result_is_close_to_the_unfolded_path():
    x, weight, norm_weight = _inputs(4, 64, 32, seed=3)
    w_bf16, norm_bf16 = weight.to(torch.bfloat16), norm_weight.to(torch.bfloat16)
    unfolded = swiglu(rms_norm(x, norm_bf16, 1e-6) @ w_bf16.T)
    folded_weight = (w_bf16.float() * norm_bf16.float()).to(torch.bfloat16)
    folded = normed_swiglu(x @ folded_weight.T, x, 1e-6)
    torch.testing.assert_close(folded.float(), unfolded.float(), atol=3e-2, rtol=3e-2)


def test_shape_and_dtype_errors_name_the_argument():
    x = torch.zeros(2, 8)
    with pytest.raises(KernelShapeError, match="gate_up"):
        normed_swiglu(torch.zeros(2, 7), x, 1e-6)
    with pytest.raises(KernelShapeError, match=r"x\.shape"):
        normed_swiglu(torch.zeros(2, 8), torch.zeros(3, 8), 1e-6)
    with pytest.raises(KernelDtypeError, match=r"gate_up\.dtype"):
        normed_swiglu(torch.zeros(2, 8, dtype=torch.int32), x, 1e-6)
