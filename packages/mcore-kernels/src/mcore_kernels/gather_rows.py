"""Rows of two tables gathered in one launch (a decode step's embedding and RoPE rows).

A decode step of one or two tokens starts with two gathers: the token embeddings and the
rotary cosines and sines of the positions. As torch ops they are two launches of a few
microseconds each, and the first projection can only start (and, under programmatic dependent
launch, request its weights) once both are done. :func:`gather_row_pairs` copies both in one
launch, one program per row; under :func:`mcore_kernels.pdl.programmatic_dependent_launch` it
lets the next kernel start at once and waits for the previous one before it reads anything.

Exact copies: the results are ``a.index_select(0, a_index)`` and ``b.index_select(0,
b_index)``. Dispatch: Triton on CUDA, the torch ops elsewhere (with ``TRITON_INTERPRET=1`` the
Triton path runs on CPU tensors).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    tl,
)
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import gather_row_pairs_reference

__all__ = ["gather_row_pairs"]


@jit
def _copy_row(src_ptr, index_ptr, out_ptr, row, stride, cols, BLOCK: tl.constexpr):
    source = src_ptr + tl.load(index_ptr + row).to(tl.int64) * stride
    target = out_ptr + row.to(tl.int64) * cols
    offsets = tl.arange(0, BLOCK)
    for start in range(0, cols, BLOCK):
        mask = start + offsets < cols
        tl.store(target + start + offsets, tl.load(source + start + offsets, mask=mask), mask=mask)


@jit
def _gather_row_pairs_kernel(
    a_ptr,
    a_index_ptr,
    a_out_ptr,
    a_stride,
    a_cols,
    b_ptr,
    b_index_ptr,
    b_out_ptr,
    b_stride,
    b_cols,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # The next kernel may start (and request its weights) now; the reads wait for the
        # previous kernel.
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    _copy_row(a_ptr, a_index_ptr, a_out_ptr, row, a_stride, a_cols, BLOCK_A)
    _copy_row(b_ptr, b_index_ptr, b_out_ptr, row, b_stride, b_cols, BLOCK_B)


def _check(name: str, table: torch.Tensor, index: torch.Tensor) -> None:
    if table.dim() != 2 or index.dim() != 1:
        raise KernelShapeError(
            f"{name} {tuple(table.shape)} with index {tuple(index.shape)}; expected a [rows, "
            "cols] table and a [T] index"
        )
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise KernelDtypeError(f"index of {name} is {index.dtype}; expected an integer dtype")


def gather_row_pairs(
    a: torch.Tensor,
    a_index: torch.Tensor,
    b: torch.Tensor,
    b_index: torch.Tensor,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a.index_select(0, a_index), b.index_select(0, b_index))`` in one launch.

    Args:
        a: ``[rows_a, cols_a]`` table (last dimension contiguous).
        a_index: Integer ``[T]`` rows of ``a`` (in range: not checked on the device).
        b: ``[rows_b, cols_b]`` table (last dimension contiguous).
        b_index: Integer ``[T]`` rows of ``b``.
        pdl: Launch with programmatic dependent launch where supported (None: inside
            :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).

    Returns:
        The gathered rows, ``[T, cols_a]`` and ``[T, cols_b]``, contiguous.

    Raises:
        KernelShapeError: If a table is not 2-D, an index not 1-D, or the indices differ in
            length.
        KernelDtypeError: If an index is not an integer tensor.
    """
    _check("a", a, a_index)
    _check("b", b, b_index)
    if a_index.shape != b_index.shape:
        raise KernelShapeError(
            f"a_index {tuple(a_index.shape)} and b_index {tuple(b_index.shape)}; expected one "
            "length"
        )
    if not use_triton(a, a_index, b, b_index) or a.stride(1) != 1 or b.stride(1) != 1:
        return gather_row_pairs_reference(a, a_index, b, b_index)
    count = a_index.shape[0]
    a_out = torch.empty((count, a.shape[1]), dtype=a.dtype, device=a.device)
    b_out = torch.empty((count, b.shape[1]), dtype=b.dtype, device=b.device)
    if count == 0:
        return a_out, b_out
    use_pdl = pdl_enabled(a.device) if pdl is None else pdl and pdl_supported(a.device)
    _gather_row_pairs_kernel[(count,)](
        a,
        a_index.contiguous(),
        a_out,
        a.stride(0),
        a.shape[1],
        b,
        b_index.contiguous(),
        b_out,
        b.stride(0),
        b.shape[1],
        BLOCK_A=min(1024, next_power_of_2(max(a.shape[1], 1))),
        BLOCK_B=min(1024, next_power_of_2(max(b.shape[1], 1))),
        USE_PDL=use_pdl,
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return a_out, b_out
