"""Fused token permutation of MoE dispatch and the fused weighted combine, gathers only.

:func:`permute_tokens` copies every token into the expert-buffer rows of its assignments
(zero rows for padding); its backward sums each token's ``top_k`` row gradients in one
kernel. :func:`unpermute_combine` reads each token's ``top_k`` expert outputs back and sums
them with the routing weights in float32; its backward gathers the scaled output gradient
into the buffer rows and takes one dot product per assignment for the weight gradient. Every
pass reads through an index and writes each output element once: no atomics, so forward and
backward are bitwise reproducible. See :mod:`mcore_kernels.moe.reference` for the index
conventions.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._compile import register_function
from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe._launch import cdiv, launch, next_power_of_2
from mcore_kernels.moe.reference import (
    permute_tokens_reference,
    unpermute_combine_reference,
    unpermute_sum_reference,
)

__all__ = ["permute_tokens", "unpermute_combine", "unpermute_sum"]


@jit
def gather_rows_kernel(
    src_ptr,
    index_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    hidden,
    INDEX_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[r] = src[index[r] // INDEX_DIV] (* scale[index[r]])``, zero where index < 0, for
    ``ROWS`` rows and ``BLOCK_H`` columns."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    col_ok = cols < hidden
    index = tl.load(index_ptr + rows, mask=row_ok, other=-1)
    valid = index >= 0
    source = tl.where(valid, index // INDEX_DIV, 0).to(tl.int64)
    values = tl.load(
        src_ptr + source[:, None] * hidden + cols[None, :],
        mask=valid[:, None] & col_ok[None, :],
        other=0.0,
    )
    if HAS_SCALE:
        # Index 0 always exists; invalid rows are zero already.
        scale = tl.load(scale_ptr + tl.where(valid, index, 0), mask=row_ok, other=0.0)
        values = (values.to(tl.float32) * scale.to(tl.float32)[:, None]).to(values.dtype)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
        values,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@jit
def sum_rows_kernel(
    src_ptr,
    slots_ptr,
    weights_ptr,
    out_ptr,
    num_tokens,
    hidden,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_j (w[t, j] *) src[slots[t * TOP_K + j]]`` over valid slots, in float32,
    for ``ROWS`` tokens and ``BLOCK_H`` columns."""
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < num_tokens
    col_ok = cols < hidden
    acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + tokens * TOP_K + j, mask=token_ok, other=-1)
        valid = slot >= 0
        row = tl.where(valid, slot, 0).to(tl.int64)
        values = tl.load(
            src_ptr + row[:, None] * hidden + cols[None, :],
            mask=valid[:, None] & col_ok[None, :],
            other=0.0,
        )
        values = values.to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + tokens * TOP_K + j, mask=token_ok, other=0.0)
            values = values * weight.to(tl.float32)[:, None]
        acc += values
    tl.store(
        out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_ok[:, None] & col_ok[None, :],
    )


@jit
def weight_grad_kernel(
    grad_ptr,
    y_ptr,
    slots_ptr,
    out_ptr,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t, j] = dot(grad[t], y[slots[t * TOP_K + j]])`` (zero for dropped slots)."""
    token = tl.program_id(0)
    base = tl.arange(0, BLOCK_H)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slots_ptr + token * TOP_K + j)
        valid = slot >= 0
        row = tl.where(valid, slot, 0).to(tl.int64)
        limit = tl.where(valid, hidden, 0)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + base
            col_ok = cols < hidden
            g = tl.load(grad_ptr + token.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0)
            y = tl.load(y_ptr + row * hidden + cols, mask=cols < limit, other=0.0)
            acc += g.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + token * TOP_K + j, tl.sum(acc, axis=0))


def _block(hidden: int) -> int:
    return min(2048, next_power_of_2(max(hidden, 1)))


GATHER_TILE = (8, 256, 4)
"""Rows, columns and warps per program of the row gather (permutation) kernel. On one H200 at
65536 x 2048 and 65536 x 7168 bf16 rows, 8 rows of 256 columns ran at 2.8 and 3.2 TB/s of
written rows against 2.3 and 2.4 TB/s for one row of 2048 columns (a write alone: 3.3 TB/s)."""
SUM_TILE = (1, 2048, 4)
"""Rows, columns and warps per program of the row-sum (combine) kernel (one token's full row
per program was the fastest measured: 3.4 and 3.8 TB/s of read rows on one H200)."""


def _tiles(
    rows: int, hidden: int, tile: tuple[int, int, int]
) -> tuple[tuple[int, int], int, int, int]:
    """Grid, rows, columns and warps per program of a row gather or row sum."""
    per_program, columns, warps = tile
    block = min(columns, next_power_of_2(max(hidden, 1)))
    grid = (cdiv(rows, per_program), cdiv(hidden, block))
    return grid, per_program, block, warps


def _device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _gather_rows(
    src: torch.Tensor, index: torch.Tensor, divisor: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """``out[r] = src[index[r] // divisor] (* scale[index[r]])``, zero where ``index < 0``."""
    hidden = src.shape[1]
    out = src.new_empty(index.shape[0], hidden)
    if index.numel() and hidden:
        grid, rows, block, warps = _tiles(index.shape[0], hidden, GATHER_TILE)
        with _device(src):
            launch(
                gather_rows_kernel,
                grid,
                (src, index, scale if scale is not None else src, out, index.shape[0], hidden),
                dict(INDEX_DIV=divisor, HAS_SCALE=scale is not None, ROWS=rows, BLOCK_H=block),
                device=src.device,
                num_warps=warps,
            )
    return out


def _sum_rows(
    src: torch.Tensor, slots: torch.Tensor, top_k: int, weights: torch.Tensor | None
) -> torch.Tensor:
    """``out[t] = sum_j (w[t, j] *) src[slots[t * top_k + j]]`` over valid slots."""
    hidden = src.shape[1]
    num_tokens = slots.shape[0] // top_k
    out = src.new_empty(num_tokens, hidden)
    if num_tokens and hidden:
        grid, rows, block, warps = _tiles(num_tokens, hidden, SUM_TILE)
        with _device(src):
            launch(
                sum_rows_kernel,
                grid,
                (src, slots, weights if weights is not None else src, out, num_tokens, hidden),
                dict(TOP_K=top_k, HAS_WEIGHTS=weights is not None, ROWS=rows, BLOCK_H=block),
                device=src.device,
                num_warps=warps,
            )
    return out


class PermuteTokensFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`permute_tokens`."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        """Copies every token into the buffer rows of its assignments.

        Args:
            ctx: Autograd context; keeps ``slots`` and ``top_k`` for the backward.
            x: ``[T, H]`` tokens.
            rows: ``[R]`` int64 token of each buffer row, -1 for a zero padding row.
            slots: ``[T * top_k]`` int64 buffer row of each assignment, -1 when dropped.
            top_k: Assignments per token.

        Returns:
            ``[R, H]`` buffer in the dtype of ``x``.
        """
        ctx.save_for_backward(slots)
        ctx.top_k = top_k
        ctx.triton = use_triton(x, rows, slots)
        if not ctx.triton:
            return permute_tokens_reference(x, rows)
        return _gather_rows(x, rows, 1, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """Sums each token's ``top_k`` buffer-row gradients through ``slots``.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[R, H]`` gradient of the buffer.

        Returns:
            ``(grad_x [T, H], None, None, None)``: no gradient for the indices or ``top_k``.
        """
        (slots,) = ctx.saved_tensors
        grad = grad.contiguous()
        if not ctx.triton:
            rows = permute_tokens_reference(grad, slots).view(
                slots.shape[0] // ctx.top_k, ctx.top_k, grad.shape[-1]
            )
            return rows.sum(dim=1), None, None, None
        return _sum_rows(grad, slots, ctx.top_k, None), None, None, None


class UnpermuteCombineFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`unpermute_combine`."""

    @staticmethod
    def forward(
        ctx: Any,
        y: torch.Tensor,
        weights: torch.Tensor,
        slots: torch.Tensor,
        fillers: torch.Tensor,
    ) -> torch.Tensor:
        """Sums every token's expert outputs with its routing weights (float32 sums).

        Args:
            ctx: Autograd context; keeps all four inputs for the backward.
            y: ``[R, H]`` expert outputs, one row per buffer row.
            weights: ``[T, top_k]`` routing weights.
            slots: ``[T * top_k]`` int64 buffer row of each assignment, -1 when dropped.
            fillers: ``[R]`` int64 assignment held by each buffer row, -1 for padding.

        Returns:
            ``[T, H]`` in the dtype of ``y``.
        """
        ctx.save_for_backward(y, weights, slots, fillers)
        ctx.triton = use_triton(y, weights, slots, fillers)
        if not ctx.triton:
            return unpermute_combine_reference(y, weights, slots)
        return _sum_rows(y, slots, weights.shape[1], weights)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        """Gradients of the expert outputs (the token's gradient scaled by the row's weight,
        zero for padding rows) and of the weights (dot products of each row with its token's
        gradient), each only when needed.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[T, H]`` gradient of the combined tokens.

        Returns:
            ``(grad_y [R, H] or None, grad_weights [T, top_k] or None, None, None)``.
        """
        y, weights, slots, fillers = ctx.saved_tensors
        grad = grad.contiguous()
        top_k = weights.shape[1]
        grad_y = grad_w = None
        if not ctx.triton:
            flat_w = weights.reshape(-1)
            if ctx.needs_input_grad[0]:
                tokens = torch.where(fillers < 0, -1, fillers // top_k)
                padded_w = torch.cat([flat_w, flat_w.new_zeros(1)])
                scale = padded_w[torch.where(fillers < 0, flat_w.shape[0], fillers)]
                grad_y = permute_tokens_reference(grad, tokens) * scale.unsqueeze(-1).to(grad.dtype)
            if ctx.needs_input_grad[1]:
                rows = permute_tokens_reference(y, slots).float().view(*weights.shape, y.shape[-1])
                grad_w = (rows * grad.float().unsqueeze(1)).sum(-1).to(weights.dtype)
            return grad_y, grad_w, None, None
        if ctx.needs_input_grad[0]:
            if weights.numel():
                grad_y = _gather_rows(grad, fillers, top_k, weights.reshape(-1))
            else:
                # No assignment: every row is padding.
                grad_y = torch.zeros_like(y)
        if ctx.needs_input_grad[1]:
            out = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
            if weights.numel():
                with _device(y):
                    weight_grad_kernel[(weights.shape[0],)](
                        grad, y, slots, out, y.shape[1], TOP_K=top_k, BLOCK_H=_block(y.shape[1])
                    )
            grad_w = out.to(weights.dtype)
        return grad_y, grad_w, None, None


class UnpermuteSumFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`unpermute_sum`."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, slots: torch.Tensor, fillers: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        """Sums every token's expert outputs, already weighted (float32 sums).

        Args:
            ctx: Autograd context; keeps ``fillers`` and ``top_k`` for the backward.
            y: ``[R, H]`` expert outputs, one row per buffer row.
            slots: ``[T * top_k]`` int64 buffer row of each assignment, -1 when dropped.
            fillers: ``[R]`` int64 assignment held by each buffer row, -1 for padding.
            top_k: Assignments per token.

        Returns:
            ``[T, H]`` in the dtype of ``y``.
        """
        ctx.save_for_backward(fillers)
        ctx.top_k = top_k
        ctx.triton = use_triton(y, slots, fillers)
        if not ctx.triton:
            return unpermute_sum_reference(y, slots, top_k)
        return _sum_rows(y, slots, top_k, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """Gathers each buffer row's gradient from its token (zero for padding rows).

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[T, H]`` gradient of the summed tokens.

        Returns:
            ``(grad_y [R, H], None, None, None)``.
        """
        (fillers,) = ctx.saved_tensors
        grad = grad.contiguous()
        if not ctx.triton:
            tokens = torch.where(fillers < 0, -1, fillers // ctx.top_k)
            return permute_tokens_reference(grad, tokens), None, None, None
        return _gather_rows(grad, fillers, ctx.top_k, None), None, None, None


def _check_index(name: str, index: torch.Tensor, length: int | None = None) -> None:
    if index.dim() != 1 or index.dtype != torch.int64:
        raise KernelDtypeError(
            f"{name} must be a 1-D int64 tensor, got shape {tuple(index.shape)} and dtype "
            f"{index.dtype}"
        )
    if length is not None and index.shape[0] != length:
        raise KernelShapeError(f"{name}.shape={tuple(index.shape)} must be ({length},)")


def permute_tokens(
    x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Copy tokens into the expert-buffer rows of their routing assignments.

    Args:
        x: ``[T, H]`` tokens.
        rows: ``[R]`` int64 token of each buffer row, -1 for a zero padding row.
        slots: ``[T * top_k]`` int64 buffer row of each assignment, -1 when dropped (the
            inverse of ``rows``; the backward sums each token's rows through it).
        top_k: Assignments per token.

    Returns:
        ``[R, H]`` buffer in the dtype of ``x``.

    Raises:
        KernelShapeError: If ``x`` is not 2-D or ``slots`` does not have ``T * top_k`` entries.
        KernelDtypeError: If an index is not a 1-D int64 tensor.
    """
    if x.dim() != 2:
        raise KernelShapeError(f"x.shape={tuple(x.shape)} must be [tokens, hidden]")
    _check_index("rows", rows)
    _check_index("slots", slots, x.shape[0] * top_k)
    if _compile.compiling():
        return torch.ops.mcore_kernels.moe_permute_tokens(x.contiguous(), rows, slots, top_k)
    return PermuteTokensFunction.apply(x.contiguous(), rows, slots, top_k)


def unpermute_combine(
    y: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, fillers: torch.Tensor
) -> torch.Tensor:
    """Sum every token's expert outputs with its routing weights (float32 accumulation).

    Args:
        y: ``[R, H]`` expert outputs, one row per buffer row.
        weights: ``[T, top_k]`` routing weights.
        slots: ``[T * top_k]`` int64 buffer row of each assignment, -1 when dropped.
        fillers: ``[R]`` int64 assignment held by each buffer row, -1 for padding (the
            inverse of ``slots``; used by the backward).

    Returns:
        ``[T, H]`` in the dtype of ``y``; differentiable in ``y`` and ``weights``.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index is not a 1-D int64 tensor.
    """
    if y.dim() != 2 or weights.dim() != 2:
        raise KernelShapeError(
            f"y.shape={tuple(y.shape)} and weights.shape={tuple(weights.shape)} must be 2-D"
        )
    _check_index("slots", slots, weights.numel())
    _check_index("fillers", fillers, y.shape[0])
    if _compile.compiling():
        return torch.ops.mcore_kernels.moe_unpermute_combine(
            y.contiguous(), weights.contiguous(), slots, fillers
        )
    return UnpermuteCombineFunction.apply(y.contiguous(), weights.contiguous(), slots, fillers)


def unpermute_sum(
    y: torch.Tensor, slots: torch.Tensor, fillers: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Sum every token's expert outputs, already scaled by their routing weights (float32 sums).

    The combine of a layer that applies the routing weights inside the experts (see
    :func:`~mcore_kernels.moe.weighted_swiglu`): its backward is one gather, with no weight
    gradient and no saved expert outputs.

    Args:
        y: ``[R, H]`` expert outputs, one row per buffer row.
        slots: ``[T * top_k]`` int64 buffer row of each assignment, -1 when dropped.
        fillers: ``[R]`` int64 assignment held by each buffer row, -1 for padding (the
            inverse of ``slots``; used by the backward).
        top_k: Assignments per token.

    Returns:
        ``[T, H]`` in the dtype of ``y``; differentiable in ``y``.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index is not a 1-D int64 tensor.
    """
    if y.dim() != 2 or top_k < 1 or slots.numel() % top_k:
        raise KernelShapeError(
            f"y.shape={tuple(y.shape)} must be 2-D and slots ({slots.numel()} entries) a "
            f"multiple of top_k={top_k} >= 1"
        )
    _check_index("slots", slots)
    _check_index("fillers", fillers, y.shape[0])
    if _compile.compiling():
        return torch.ops.mcore_kernels.moe_unpermute_sum(y.contiguous(), slots, fillers, top_k)
    return UnpermuteSumFunction.apply(y.contiguous(), slots, fillers, top_k)


# --- torch.library: the op torch.compile traces (forward, and its backward through the
# Function's own gradients; see mcore_kernels._compile.register_function) ---------------

register_function(
    "moe_permute_tokens",
    PermuteTokensFunction,
    "Tensor x, Tensor rows, Tensor slots, int top_k",
    1,
    (0,),
    lambda x, rows, slots, top_k: x.new_empty((rows.shape[0], x.shape[1])),
)
register_function(
    "moe_unpermute_combine",
    UnpermuteCombineFunction,
    "Tensor y, Tensor weights, Tensor slots, Tensor fillers",
    1,
    (0, 1),
    lambda y, weights, slots, fillers: y.new_empty((weights.shape[0], y.shape[1])),
)
register_function(
    "moe_unpermute_sum",
    UnpermuteSumFunction,
    "Tensor y, Tensor slots, Tensor fillers, int top_k",
    1,
    (0,),
    lambda y, slots, fillers, top_k: y.new_empty((slots.shape[0] // top_k, y.shape[1])),
)
