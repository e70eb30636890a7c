"""Batch-invariant GEMMs: every output row is computed the same way whatever the batch.

cuBLAS (and CPU BLAS) pick a different algorithm for a different number of rows ``M``: split-K
for a skinny matrix, another tile shape, a matrix-vector path for ``M = 1``. Each changes the
order in which a row's dot products are summed, so one row's result depends on how many other
rows share the call. Here one Triton kernel serves dense, batched (``bmm``) and grouped (MoE
experts) products with tile sizes fixed by the dtype alone: a row is reduced over ``K`` in
``BLOCK_K`` chunks in ascending order into a float32 accumulator, never split across programs,
and its value does not depend on which tile or group it shares with other rows.

On the GPU a tile product is one ``tl.dot`` (tensor cores; each output element is reduced by
the same instruction sequence wherever its row sits in the tile). The Triton interpreter runs
``tl.dot`` through numpy's BLAS, whose edge micro-kernels make a row's rounding depend on its
position inside the tile, so under ``TRITON_INTERPRET=1`` the tile product is an explicit
broadcast-multiply and sum over ``K`` instead (same tiles, same order over the K blocks).

All three take the second operand as ``b[G, K, N]`` (any strides) and the rows of ``a[M, K]``
in ``G`` consecutive groups; group ``g`` is multiplied by ``b[g]``:

- dense: ``G = 1``;
- batched: ``G`` groups of ``M / G`` rows (``torch.bmm``);
- grouped: group ends ``offsets[G]`` on the device (``torch._grouped_mm``), no host sync.

The torch reference (the CPU path) reaches the same property a different way: CPU BLAS takes
another path for fewer than 4 to 8 rows, so it multiplies fixed 16-row chunks (the last one
zero-padded); every BLAS call then has the same shape and a row's value depends on its own data
only. The two paths are each batch-invariant; they agree with each other to rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels._backend import _interpreting, use_triton
from mcore_kernels._triton_utils import jit, round_to, tl, triton
from mcore_kernels.errors import KernelDtypeError, KernelShapeError

__all__ = [
    "REFERENCE_CHUNK_ROWS",
    "bmm_batch_invariant",
    "grouped_mm_batch_invariant",
    "linear_batch_invariant",
    "matmul_reference",
    "mm_batch_invariant",
]

REFERENCE_CHUNK_ROWS = 16
"""Rows per BLAS call of the torch reference (every call has this many rows)."""

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


@jit
def _batch_invariant_matmul_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    group_ends_ptr,
    rows_per_group,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_om,
    stride_on,
    VARIABLE_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    DOT: tl.constexpr,
):
    group = tl.program_id(0)
    tile_m = tl.program_id(1)
    tile_n = tl.program_id(2)
    if VARIABLE_GROUPS:
        end = tl.load(group_ends_ptr + group).to(tl.int64)
        previous = tl.load(group_ends_ptr + tl.maximum(group - 1, 0)).to(tl.int64)
        start = tl.where(group > 0, previous, 0)
    else:
        start = group.to(tl.int64) * rows_per_group
        end = start + rows_per_group
    first_row = start + tile_m * BLOCK_M
    if first_row < end:
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < end
        col_mask = cols < N
        depth = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_base = b_ptr + group.to(tl.int64) * stride_bg
        # NOTE: the reduction over K is one ascending loop with a fixed BLOCK_K (no split-K):
        # a row's order of additions is the same in every launch.
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + depth
            k_mask = ks < K
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if not DOT:
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
            round_to(acc, out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


def _tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)``: a function of the dtype only, never of M."""
    if dtype == torch.float32:
        return 32, 64, 32, 4, 2
    return 64, 128, 64, 4, 3


def _check(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.dtype not in _SUPPORTED or b.dtype != a.dtype:
        raise KernelDtypeError(
            f"{name}: a.dtype={a.dtype}, b.dtype={b.dtype}; expected one float dtype of "
            f"{_SUPPORTED}"
        )
    if a.device != b.device:
        raise KernelShapeError(f"{name}: a is on {a.device} and b on {b.device}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise KernelShapeError(
            f"{name}: a{tuple(a.shape)} and b{tuple(b.shape)}; expected a[M, K] and b[G, K, N]"
        )


def _launch(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    num_rows, depth = a.shape
    groups, _, width = b.shape
    out = a.new_empty((num_rows, width))
    if num_rows == 0 or width == 0:
        return out
    if depth == 0:
        return out.zero_()
    block_m, block_n, block_k, warps, stages = _tiles(a.dtype)
    rows_bound = num_rows if group_ends is not None else rows_per_group
    grid = (groups, triton.cdiv(rows_bound, block_m), triton.cdiv(width, block_n))
    ends = group_ends if group_ends is not None else out
    _batch_invariant_matmul_kernel[grid](
        a,
        b,
        out,
        ends,
        rows_per_group,
        width,
        depth,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        VARIABLE_GROUPS=group_ends is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=a.dtype == torch.float32,
        DOT=not _interpreting(),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _chunked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fixed ``REFERENCE_CHUNK_ROWS``-row BLAS calls (the CPU-invariant product)."""
    rows = a.shape[0]
    pad = -rows % REFERENCE_CHUNK_ROWS
    if pad:
        a = torch.cat([a, a.new_zeros((pad, a.shape[1]))])
    chunks = [chunk @ b for chunk in a.split(REFERENCE_CHUNK_ROWS)]
    out = torch.cat(chunks) if chunks else a.new_empty((0, b.shape[1]))
    return out[:rows]


def matmul_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None = None,
    rows_per_group: int | None = None,
) -> torch.Tensor:
    """Torch reference of the grouped batch-invariant product.

    Args:
        a: ``[M, K]`` rows.
        b: ``[G, K, N]`` one matrix per group.
        group_ends: ``[G]`` end row of each group (variable groups), or None.
        rows_per_group: Rows of every group when ``group_ends`` is None (default ``M / G``).

    Returns:
        ``[M, N]`` in ``a.dtype``.
    """
    groups = b.shape[0]
    if group_ends is None:
        size = rows_per_group if rows_per_group is not None else a.shape[0] // max(groups, 1)
        ends = [size * (g + 1) for g in range(groups)]
    else:
        ends = [int(e) for e in group_ends.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        pieces.append(_chunked_mm(a[start:end], b[g]))
        start = end
    if start < a.shape[0]:
        pieces.append(a.new_zeros((a.shape[0] - start, b.shape[2])))
    return torch.cat(pieces) if pieces else a.new_empty((0, b.shape[2]))


def _grouped_forward(
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None,
    rows_per_group: int,
) -> torch.Tensor:
    if use_triton(a, b):
        return _launch(a, b, group_ends, rows_per_group)
    return matmul_reference(a, b, group_ends, rows_per_group)


class _InvariantMatmul(torch.autograd.Function):
    """Forward through the invariant kernel; backward with ordinary GEMMs (any order is fine:
    only the forward values have to match between training and inference)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        group_ends: torch.Tensor | None,
        rows_per_group: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(a, b, group_ends)
        ctx.rows_per_group = rows_per_group
        return _grouped_forward(a, b, group_ends, rows_per_group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        a, b, group_ends = ctx.saved_tensors
        groups = b.shape[0]
        if group_ends is None:
            size = ctx.rows_per_group
            ends = [size * (g + 1) for g in range(groups)]
        else:
            ends = [int(e) for e in group_ends.tolist()]
        grad_a = torch.zeros_like(a) if ctx.needs_input_grad[0] else None
        grad_b = torch.zeros_like(b) if ctx.needs_input_grad[1] else None
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                if grad_a is not None:
                    grad_a[start:end] = grad[start:end] @ b[g].transpose(0, 1)
                if grad_b is not None:
                    grad_b[g] = a[start:end].transpose(0, 1) @ grad[start:end]
            start = end
        return grad_a, grad_b, None, None


def grouped_mm_batch_invariant(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """Grouped GEMM ``a[rows of g] @ b[g]`` with a batch-invariant reduction order.

    The semantics of ``torch._grouped_mm(a, b, offs=group_ends)`` for 2-D ``a`` and 3-D ``b``.

    Args:
        a: ``[M, K]`` rows sorted by group.
        b: ``[G, K, N]``.
        group_ends: ``[G]`` integer end row (exclusive) of each group, non-decreasing.

    Returns:
        ``[M, N]``; rows after the last group end are zero.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    _check(a, b, "grouped_mm_batch_invariant")
    if group_ends.dim() != 1 or group_ends.shape[0] != b.shape[0]:
        raise KernelShapeError(
            f"group_ends.shape={tuple(group_ends.shape)}; expected [{b.shape[0]}] (one per group)"
        )
    out = _InvariantMatmul.apply(a, b, group_ends.contiguous(), 0)
    return out


def mm_batch_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands with a batch-invariant reduction order.

    Args:
        a: ``[M, K]``.
        b: ``[K, N]``.

    Returns:
        ``[M, N]`` in ``a.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if b.dim() != 2:
        raise KernelShapeError(f"b.shape={tuple(b.shape)}; expected [K, N]")
    _check(a, b[None], "mm_batch_invariant")
    return _InvariantMatmul.apply(a, b[None], None, a.shape[0])


def bmm_batch_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` with a batch-invariant reduction order.

    Args:
        a: ``[G, M, K]``.
        b: ``[G, K, N]``.

    Returns:
        ``[G, M, N]`` in ``a.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise KernelShapeError(
            f"a{tuple(a.shape)} and b{tuple(b.shape)}; expected a[G, M, K] and b[G, K, N]"
        )
    groups, rows, _ = a.shape
    flat = a.reshape(groups * rows, a.shape[2])
    _check(flat, b, "bmm_batch_invariant")
    out = _InvariantMatmul.apply(flat, b, None, rows)
    return out.view(groups, rows, b.shape[2])


def linear_batch_invariant(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a batch-invariant reduction order.

    Args:
        x: ``[..., K]`` input.
        weight: ``[N, K]`` weight.
        bias: Optional ``[N]`` bias, added after the product.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)}; expected x[..., K] "
            "and weight[N, K]"
        )
    flat = x.reshape(-1, x.shape[-1])
    out = mm_batch_invariant(flat, weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
