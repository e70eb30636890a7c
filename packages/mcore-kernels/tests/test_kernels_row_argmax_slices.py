"""SlicedRowArgmax: the Triton kernel (interpreted on CPU) and the torch path against
``torch.argmax`` over the whole matrix, slices reduced in any order, rounds repeated."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.row_argmax_slices import SlicedRowArgmax

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _matrix(columns: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(columns)
    x = torch.randn(5, columns, generator=generator).to(dtype)
    # Row 0: a tie across slices and programs: the first index wins.
    x[0, columns - 3] = x[0, 7] = x[0, columns // 2] = x[0].max() + 1
    x[1] = -x[1].abs()  # every value negative, -0.0 and 0.0 equal: the first of them wins
    x[1, columns // 3] = -0.0
    x[1, columns - 1] = 0.0
    x[2, columns - 1] = x[2, columns // 2] = float("nan")  # NaN is the largest: first wins
    x[3] = float("-inf")  # every value -inf: index 0
    x[4, columns - 1] = float("inf")
    return x.to(_device())


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    ("columns", "bounds", "programs", "dtype"),
    [
        (9000, (0, 3000, 9000), 2, torch.bfloat16),
        (9000, (0, 1, 4097, 9000), 3, torch.float32),
        (5000, (0, 5000), 4, torch.float16),
        (20000, (0, 2048, 4096, 6144, 8192, 20000), 8, torch.bfloat16),
    ],
)
def test_matches_torch_argmax_in_any_slice_order(
    monkeypatch, backend, columns, bounds, programs, dtype
):
    if backend == "triton" and not _RUNS_TRITON:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
    x = _matrix(columns, dtype)
    expected = x.argmax(dim=-1)
    reducer = SlicedRowArgmax(5, bounds, x.device, programs_per_slice=programs)
    slices = list(range(reducer.slices))
    for order in (slices, slices[::-1], slices[1:] + slices[:1]):
        reducer.out.fill_(-1)
        for index in order:
            result = reducer.reduce(x, index)
        assert result is reducer.out and result.dtype == torch.int64
        assert torch.equal(result, expected), order


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(KernelShapeError, match="rows=0"):
        SlicedRowArgmax(0, (0, 10), "cpu")
    with pytest.raises(KernelShapeError, match="bounds"):
        SlicedRowArgmax(2, (0, 10, 10), "cpu")
    with pytest.raises(KernelShapeError, match="bounds"):
        SlicedRowArgmax(2, (1, 10), "cpu")
    with pytest.raises(KernelShapeError, match="programs_per_slice=0"):
        SlicedRowArgmax(2, (0, 10), "cpu", programs_per_slice=0)
    with pytest.raises(KernelShapeError, match="at most 1024"):
        SlicedRowArgmax(2, (0, 2048 * 1100), "cpu", programs_per_slice=1100)
    reducer = SlicedRowArgmax(2, (0, 4, 10), "cpu")
    with pytest.raises(KernelShapeError, match=r"\[2, 10\]"):
        reducer.reduce(torch.zeros(2, 11), 0)
    with pytest.raises(KernelShapeError, match="index=2"):
        reducer.reduce(torch.zeros(2, 10), 2)
    with pytest.raises(KernelDtypeError, match="int32"):
        reducer.reduce(torch.zeros(2, 10, dtype=torch.int32), 0)
