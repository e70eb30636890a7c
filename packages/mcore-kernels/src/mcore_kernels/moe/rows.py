"""Rows of the routing assignments in expert order, from the stable sort by expert: one Triton
kernel each, with its torch reference, no host synchronisation.

- :func:`dropless_rows`: the row of every assignment (the inverse of the sort) and the int32
  end row of every expert, which the grouped GEMMs take;
- :func:`capacity_rows`: the same under capacity (drop-and-pad) routing. The kept assignments
  of every expert (its first ``capacity`` ones in token order) are packed with no padding rows
  between experts, so that grouped GEMMs run only the kept rows while every shape still
  depends on the token count alone;
- :func:`aligned_rows`: dropless rows with every expert's rows padded to a multiple of
  ``align`` by empty rows (assignment -1), so that weight-gradient kernels reduce over whole
  row chunks;
- :func:`padded_slots`: the slots of capacity routing with padding: ``capacity`` slots per key
  (an expert, or an expert and a source rank), the kept assignments of key ``k`` in slots
  ``k * capacity`` onwards.
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels.errors import KernelDtypeError, KernelShapeError

__all__ = [
    "aligned_rows",
    "aligned_rows_reference",
    "capacity_rows",
    "capacity_rows_reference",
    "dropless_rows",
    "dropless_rows_reference",
    "padded_slots",
    "padded_slots_reference",
]

BLOCK = 1024
"""Sorted positions per program."""


def _e_pad(num_experts: int) -> int:
    import triton

    return max(16, triton.next_power_of_2(num_experts))


def _check(order: torch.Tensor, counts: torch.Tensor, **more: torch.Tensor) -> None:
    shapes = {"order": order, **more}
    if (
        order.dim() != 1
        or counts.dim() != 1
        or any(t.shape != order.shape for t in shapes.values())
    ):
        described = ", ".join(f"{name}.shape={tuple(t.shape)}" for name, t in shapes.items())
        raise KernelShapeError(
            f"{described} and counts.shape={tuple(counts.shape)} must be [A] each and [E]"
        )
    for name, index in (*shapes.items(), ("counts", counts)):
        if index.dtype != torch.int64:
            raise KernelDtypeError(f"{name}.dtype={index.dtype} must be torch.int64")


def dropless_rows_reference(
    order: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`dropless_rows`.

    Args:
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.

    Returns:
        ``(inverse, offsets)`` as :func:`dropless_rows`.
    """
    positions = torch.arange(order.numel(), device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, positions)
    return inverse, counts.cumsum(0).to(torch.int32)


def dropless_rows(order: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row of every assignment and end row of every expert, from the sort by expert.

    Args:
        order: ``[A]`` int64 stable sort of the assignments by expert (a permutation).
        counts: ``[E]`` int64 assignments per expert (summing to ``A``).

    Returns:
        ``(inverse, offsets)``: ``[A]`` int64 row of each assignment (``inverse[order[i]] ==
        i``) and ``[E]`` int32 end row of each expert (the running sum of ``counts``).

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index is not int64.
    """
    _check(order, counts)
    if not use_triton(order, counts):
        return dropless_rows_reference(order, counts)
    import triton

    from mcore_kernels.moe._rows_triton import dropless_rows_kernel

    total, experts = order.numel(), counts.numel()
    inverse = torch.empty_like(order)
    offsets = torch.empty(experts, dtype=torch.int32, device=counts.device)
    if experts:
        dropless_rows_kernel[(max(1, triton.cdiv(total, BLOCK)),)](
            order, counts, inverse, offsets, total, experts, BLOCK=BLOCK, E_PAD=_e_pad(experts)
        )
    return inverse, offsets


def capacity_rows_reference(
    experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`capacity_rows`.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.
        capacity: Rows each expert keeps at most.

    Returns:
        ``(compact, inverse, kept, offsets)`` as :func:`capacity_rows`.
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
    return compact[:total], inverse, kept, kept.cumsum(0).to(torch.int32)


def _place_rows(
    experts: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    rows_per_expert: torch.Tensor,
    capacity: int,
    compact: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`~mcore_kernels.moe._rows_triton.capacity_rows_kernel`: expert ``e`` keeps its
    first ``capacity`` assignments, placed from row ``sum(rows_per_expert[:e])`` on and written
    into ``compact``; returns ``(inverse, offsets)`` (the int32 running sum of
    ``rows_per_expert``)."""
    import triton

    from mcore_kernels.moe._rows_triton import capacity_rows_kernel

    total, num_experts = experts.numel(), counts.numel()
    inverse = torch.empty_like(order)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=counts.device)
    if num_experts:
        capacity_rows_kernel[(max(1, triton.cdiv(total, BLOCK)),)](
            order,
            experts,
            counts,
            counts.cumsum(0),
            rows_per_expert,
            rows_per_expert.cumsum(0),
            compact,
            inverse,
            offsets,
            total,
            num_experts,
            capacity,
            BLOCK=BLOCK,
            E_PAD=_e_pad(num_experts),
        )
    return inverse, offsets


def capacity_rows(
    experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows of the assignments that each expert keeps (its first ``capacity``).

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert (each expert's in token
            order).
        counts: ``[E]`` int64 assignments per expert.
        capacity: Rows each expert keeps at most.

    Returns:
        ``(compact, inverse, kept, offsets)``: ``[A]`` int64 assignment in each row (-1 past
        the kept rows), ``[A]`` int64 row of each assignment (-1 when dropped), ``[E]`` int64
        kept rows of each expert and ``[E]`` int32 end row of each expert's kept rows.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index is not int64.
    """
    _check(order, counts, experts=experts)
    if not use_triton(experts, order, counts):
        return capacity_rows_reference(experts, order, counts, capacity)
    kept = counts.clamp(max=capacity)
    compact = torch.empty_like(order)
    inverse, offsets = _place_rows(experts, order, counts, kept, capacity, compact)
    return compact, inverse, kept, offsets


def aligned_rows_reference(
    experts: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    align: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`aligned_rows`.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert.
        counts: ``[E]`` int64 assignments per expert.
        align: Row multiple of every expert.
        capacity: Assignments each expert keeps at most (None: all).

    Returns:
        ``(compact, inverse, offsets)`` as :func:`aligned_rows`.
    """
    total, num_experts = experts.numel(), counts.numel()
    kept = counts if capacity is None else counts.clamp(max=capacity)
    padded = (kept + align - 1) // align * align
    sorted_experts = experts.index_select(0, order)
    rank = torch.arange(total, device=experts.device) - (counts.cumsum(0) - counts).index_select(
        0, sorted_experts
    )
    rows = (padded.cumsum(0) - padded).index_select(0, sorted_experts) + rank
    if capacity is not None:
        rows = torch.where(rank < capacity, rows, -1)
    inverse = torch.empty_like(order).scatter_(0, order, rows)
    # Dropped assignments all land in one extra trash row, which is cut off.
    size = total + num_experts * (align - 1)
    compact = torch.full((size + 1,), -1, dtype=torch.int64, device=experts.device)
    compact.scatter_(0, torch.where(rows < 0, size, rows), order)
    return compact[:size], inverse, padded.cumsum(0).to(torch.int32)


def aligned_rows(
    experts: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    align: int,
    *,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of the assignments with every expert's rows padded to a multiple of ``align``
    (no host synchronisation: the row count is the bound ``A + E * (align - 1)``).

    Expert ``e`` holds rows ``offsets[e - 1]`` to ``offsets[e]``: its (kept) assignments in
    order, then empty rows (assignment -1) up to the next multiple of ``align``. The rows past
    ``offsets[-1]`` are empty too. The kernel of :func:`capacity_rows` with the padded kept
    counts.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        order: ``[A]`` int64 stable sort of the assignments by expert (each expert's in token
            order).
        counts: ``[E]`` int64 assignments per expert.
        align: Row multiple of every expert (>= 1).
        capacity: Capacity routing: each expert keeps its first ``capacity`` assignments, the
            others get no row. None: dropless.

    Returns:
        ``(compact, inverse, offsets)``: ``[A + E * (align - 1)]`` int64 assignment in each
        row (-1 for an empty one), ``[A]`` int64 row of each assignment (-1 when dropped) and
        ``[E]`` int32 end row of each expert's padded rows.

    Raises:
        KernelShapeError: If the shapes do not match or ``align < 1``.
        KernelDtypeError: If an index is not int64.
    """
    _check(order, counts, experts=experts)
    if align < 1:
        raise KernelShapeError(f"align={align} must be >= 1")
    if not use_triton(experts, order, counts):
        return aligned_rows_reference(experts, order, counts, align, capacity)
    total, num_experts = experts.numel(), counts.numel()
    kept = counts if capacity is None else counts.clamp(max=capacity)
    padded = (kept + align - 1) // align * align
    compact = torch.full(
        (total + num_experts * (align - 1),), -1, dtype=torch.int64, device=order.device
    )
    keep_all = max(total, 1) if capacity is None else capacity
    inverse, offsets = _place_rows(experts, order, counts, padded, keep_all, compact)
    return compact, inverse, offsets


def padded_slots_reference(
    keys: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`padded_slots`.

    Args:
        keys: ``[A]`` int64 key of each assignment, in ``[0, K]``.
        order: ``[A]`` int64 stable sort of the assignments by key.
        counts: ``[K + 1]`` int64 assignments per key.
        capacity: Slots per key.

    Returns:
        ``(fillers, kept)`` as :func:`padded_slots`.
    """
    num_slots = (counts.numel() - 1) * capacity
    sorted_keys = keys.index_select(0, order)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(keys.numel(), device=keys.device) - starts.index_select(0, sorted_keys)
    keep = (rank < capacity) & (sorted_keys < counts.numel() - 1)
    slots = torch.where(keep, sorted_keys * capacity + rank, -1)
    kept = torch.empty_like(order).scatter_(0, order, slots)
    # Dropped assignments all land in one extra trash slot, which is cut off.
    fillers = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=keys.device)
    fillers.scatter_(0, torch.where(slots < 0, num_slots, slots), order)
    return fillers[:num_slots], kept


def padded_slots(
    keys: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of capacity routing with padding: each of ``K`` keys keeps its first ``capacity``
    assignments (in the order of ``order``) in slots ``k * capacity`` onwards; key ``K`` marks
    assignments to skip.

    Args:
        keys: ``[A]`` int64 key of each assignment, in ``[0, K]``.
        order: ``[A]`` int64 stable sort of the assignments by key.
        counts: ``[K + 1]`` int64 assignments per key (the skipped ones last).
        capacity: Slots per key.

    Returns:
        ``(fillers, kept)``: ``[K * capacity]`` int64 assignment in each slot (-1 for an empty
        one) and ``[A]`` int64 slot of each assignment (-1 when dropped or skipped).

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index is not int64.
    """
    _check(order, counts, keys=keys)
    if counts.numel() == 0:
        raise KernelShapeError("counts.shape=(0,): expected [K + 1] with the skipped key last")
    if not use_triton(keys, order, counts):
        return padded_slots_reference(keys, order, counts, capacity)
    import triton

    from mcore_kernels.moe._rows_triton import padded_slots_kernel

    total, num_keys = keys.numel(), counts.numel() - 1
    fillers = torch.full((num_keys * capacity,), -1, dtype=torch.int64, device=keys.device)
    kept = torch.empty_like(order)
    if total:
        padded_slots_kernel[(triton.cdiv(total, BLOCK),)](
            order,
            keys,
            counts,
            counts.cumsum(0),
            fillers,
            kept,
            total,
            num_keys,
            capacity,
            BLOCK=BLOCK,
        )
    return fillers, kept
