"""Rows of the assignments that capacity (drop-and-pad) routing keeps, packed expert after
expert: one Triton kernel after the sort, with its torch reference.

The kept assignments of every expert (its first ``capacity`` ones in token order) are packed
with no padding rows between experts, so that grouped GEMMs run only the kept rows while every
shape still depends on the token count alone (no host synchronisation).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels.errors import KernelDtypeError, KernelShapeError

__all__ = ["capacity_rows", "capacity_rows_reference"]

BLOCK = 1024
"""Sorted positions per program."""


def capacity_rows_reference(
    experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`capacity_rows`.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.
        capacity: Rows each expert keeps at most.

    Returns:
        ``(compact, inverse, kept)`` as :func:`capacity_rows`.
    """
    total = experts.numel()
    sorted_experts = experts.index_select(0, order)
    starts = counts.cumsum(0) - counts
    position = torch.arange(total, device=experts.device) - starts.index_select(0, sorted_experts)
    kept = counts.clamp(max=capacity)
    kept_starts = kept.cumsum(0) - kept
    rows = torch.where(
        position < capacity, kept_starts.index_select(0, sorted_experts) + position, -1
    )
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    # Dropped assignments all land in one extra trash row, which is cut off.
    compact = torch.full((total + 1,), -1, dtype=torch.int64, device=experts.device)
    compact.scatter_(0, torch.where(rows < 0, total, rows), order)
    return compact[:total], inverse, kept


def capacity_rows(
    experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows of the assignments that each expert keeps (its first ``capacity``).

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert (each expert's in token
            order).
        counts: ``[E]`` int64 assignments per expert.
        capacity: Rows each expert keeps at most.

    Returns:
        ``(compact, inverse, kept)``: ``[A]`` int64 assignment in each row (-1 past the kept
        rows), ``[A]`` int64 row of each assignment (-1 when dropped) and ``[E]`` int64 kept
        rows of each expert.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index is not int64.
    """
    if experts.dim() != 1 or order.shape != experts.shape or counts.dim() != 1:
        raise KernelShapeError(
            f"experts.shape={tuple(experts.shape)}, order.shape={tuple(order.shape)} and "
            f"counts.shape={tuple(counts.shape)} must be [A], [A] and [E]"
        )
    for name, index in (("experts", experts), ("order", order), ("counts", counts)):
        if index.dtype != torch.int64:
            raise KernelDtypeError(f"{name}.dtype={index.dtype} must be torch.int64")
    if not use_triton(experts, order, counts):
        return capacity_rows_reference(experts, order, counts, capacity)
    import triton

    from mcore_kernels.moe._capacity_triton import capacity_rows_kernel

    total = experts.numel()
    kept = counts.clamp(max=capacity)
    compact = torch.empty_like(order)
    inverse = torch.empty_like(order)
    if total and counts.numel():
        capacity_rows_kernel[(triton.cdiv(total, BLOCK),)](
            order,
            experts,
            counts,
            counts.cumsum(0),
            kept,
            kept.cumsum(0),
            compact,
            inverse,
            total,
            counts.numel(),
            capacity,
            BLOCK=BLOCK,
        )
    return compact, inverse, kept
