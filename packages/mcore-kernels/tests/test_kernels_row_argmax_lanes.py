"""row_argmax_lanes: the Triton kernel (interpreted on CPU) against ``torch.argmax``, index for index."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.row_argmax_lanes import row_argmax_lanes

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize(
    ("rows", "columns", "dtype", "chunks"),
    [
        (4, 5000, torch.bfloat16, None),
        (4, 3079, torch.float32, 3),  # a partial last tile in every chunk
        (4, 2048, torch.float16, 1),  # one program per row: no workspace
        (4, 151, torch.bfloat16, 7),  # more chunks asked than tiles: capped
    ],
)
def test_matches_torch_argmax_with_ties_negatives_zeros_infinities_and_nan(
    rows, columns, dtype, chunks
):
    generator = torch.Generator().manual_seed(rows * columns)
    x = torch.randn(rows, columns, generator=generator).to(dtype)
    x[0, columns - 3] = x[0, 5] = x[0, 1030 % columns] = x[0].max() + 1  # ties: first wins
    x[1] = -x[1].abs()  # every value negative
    x[1, columns // 2] = -0.0
    x[1, columns - 1] = 0.0  # -0.0 == 0.0: the first of them wins
    x[2, columns - 1] = x[2, 40] = float("nan")  # NaN is the largest: the first NaN wins
    x[3] = float("-inf")  # all -inf: index 0
    x = x.to(_device())
    expected = x.argmax(dim=-1)
    actual = row_argmax_lanes(x, chunks=chunks)
    assert actual.dtype == torch.int64
    assert torch.equal(actual, expected)
    # The tickets are left zeroed: a second launch gives the same indices.
    assert torch.equal(row_argmax_lanes(x, chunks=chunks), expected)


def test_bad_input_raises_typed_errors():
    with pytest.raises(KernelShapeError, match="expected"):
        row_argmax_lanes(torch.randn(9))
    with pytest.raises(KernelDtypeError, match="int64"):
        row_argmax_lanes(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(KernelShapeError, match="chunks=0"):
        row_argmax_lanes(torch.randn(2, 3), chunks=0)
