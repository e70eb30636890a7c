"""Rows of the routing assignments in expert order, from the stable sort by expert: one Triton
kernel each, no host synchronisation. The torch references are in
:mod:`mcore_kernels.moe.reference` (re-exported here); while ``torch.compile`` traces a call it
becomes the ``torch.library`` op ``torch.ops.mcore_kernels.moe_<name>`` (registered at the end of
this module, with a fake implementation), which runs the same dispatch when the graph runs.

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

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe._launch import launch
from mcore_kernels.moe.reference import (
    aligned_rows_reference,
    capacity_rows_reference,
    dropless_rows_reference,
    padded_slots_reference,
)

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


@jit
def _capacity_rows_kernel(
    order_ptr,
    experts_ptr,
    counts_ptr,
    ends_ptr,
    kept_ptr,
    kept_ends_ptr,
    compact_ptr,
    inverse_ptr,
    offsets_ptr,
    total,
    num_experts,
    capacity,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Sorted positions ``i`` of one block: assignment ``a = order[i]`` of expert ``e`` is the
    ``i - (ends[e] - counts[e])``-th of its expert; kept below ``capacity``, in row
    ``kept_ends[e] - kept[e]`` plus that rank. Writes ``inverse[a]`` (-1 when dropped),
    ``compact[row] = a`` and -1 in ``compact[i]`` past the last kept row: every element once,
    no atomics. Program 0 also writes the int32 ``offsets`` (``kept_ends``)."""
    _int32_offsets(kept_ends_ptr, offsets_ptr, num_experts, E_PAD)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    assignment = tl.load(order_ptr + i, mask=ok, other=0)
    expert = tl.load(experts_ptr + assignment, mask=ok, other=0)
    start = tl.load(ends_ptr + expert, mask=ok, other=0) - tl.load(
        counts_ptr + expert, mask=ok, other=0
    )
    kept_start = tl.load(kept_ends_ptr + expert, mask=ok, other=0) - tl.load(
        kept_ptr + expert, mask=ok, other=0
    )
    rank = i - start
    row = tl.where(rank < capacity, kept_start + rank, -1)
    tl.store(inverse_ptr + assignment, row, mask=ok)
    tl.store(compact_ptr + row, assignment, mask=ok & (row >= 0))
    kept_total = tl.load(kept_ends_ptr + num_experts - 1)
    tl.store(compact_ptr + i, tl.full((BLOCK,), -1, tl.int64), mask=ok & (i >= kept_total))


@jit
def _int32_offsets(ends_ptr, offsets_ptr, num_experts, E_PAD: tl.constexpr):
    """Program 0 copies the int64 ``ends`` into the int32 ``offsets``."""
    if tl.program_id(0) == 0:
        ids = tl.arange(0, E_PAD)
        ends = tl.load(ends_ptr + ids, mask=ids < num_experts, other=0)
        tl.store(offsets_ptr + ids, ends.to(tl.int32), mask=ids < num_experts)


@jit
def _dropless_rows_kernel(
    order_ptr,
    counts_ptr,
    inverse_ptr,
    offsets_ptr,
    total,
    num_experts,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """``inverse[order[i]] = i`` for one block of sorted positions; program 0 also writes the
    int32 end row of every expert (``offsets``, the running sum of ``counts``)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    assignment = tl.load(order_ptr + i, mask=ok, other=0)
    tl.store(inverse_ptr + assignment, i, mask=ok)
    if tl.program_id(0) == 0:
        ids = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + ids, mask=ids < num_experts, other=0)
        ends = tl.cumsum(counts, axis=0)
        tl.store(offsets_ptr + ids, ends.to(tl.int32), mask=ids < num_experts)


@jit
def _padded_slots_kernel(
    order_ptr,
    keys_ptr,
    counts_ptr,
    ends_ptr,
    fillers_ptr,
    kept_ptr,
    total,
    num_keys,
    capacity,
    BLOCK: tl.constexpr,
):
    """Sorted positions ``i`` of one block: assignment ``a = order[i]`` of key ``k`` is the
    ``i - (ends[k] - counts[k])``-th of its key; kept below ``capacity`` (and for a key below
    ``num_keys``) in slot ``k * capacity`` plus that rank. Writes ``kept[a]`` (-1 when
    dropped) and ``fillers[slot] = a``: every element once, no atomics."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    assignment = tl.load(order_ptr + i, mask=ok, other=0)
    key = tl.load(keys_ptr + assignment, mask=ok, other=0)
    start = tl.load(ends_ptr + key, mask=ok, other=0) - tl.load(counts_ptr + key, mask=ok, other=0)
    rank = i - start
    slot = tl.where((rank < capacity) & (key < num_keys), key * capacity + rank, -1)
    tl.store(kept_ptr + assignment, slot, mask=ok)
    tl.store(fillers_ptr + slot, assignment, mask=ok & (slot >= 0))


def _e_pad(num_experts: int) -> int:
    return max(16, next_power_of_2(num_experts))


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
    if _compile.compiling():
        return _dropless_rows_op(order, counts)
    if not use_triton(order, counts):
        return dropless_rows_reference(order, counts)
    total, experts = order.numel(), counts.numel()
    inverse = torch.empty_like(order)
    offsets = torch.empty(experts, dtype=torch.int32, device=counts.device)
    if experts:
        launch(
            _dropless_rows_kernel,
            (max(1, -(-total // BLOCK)),),
            (order, counts, inverse, offsets, total, experts),
            dict(BLOCK=BLOCK, E_PAD=_e_pad(experts)),
            device=order.device,
        )
    return inverse, offsets


def _place_rows(
    experts: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    rows_per_expert: torch.Tensor,
    capacity: int,
    compact: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``_capacity_rows_kernel``: expert ``e`` keeps its
    first ``capacity`` assignments, placed from row ``sum(rows_per_expert[:e])`` on and written
    into ``compact``; returns ``(inverse, offsets)`` (the int32 running sum of
    ``rows_per_expert``)."""
    total, num_experts = experts.numel(), counts.numel()
    inverse = torch.empty_like(order)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=counts.device)
    if num_experts:
        launch(
            _capacity_rows_kernel,
            (max(1, -(-total // BLOCK)),),
            (
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
            ),
            dict(BLOCK=BLOCK, E_PAD=_e_pad(num_experts)),
            device=order.device,
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
    if _compile.compiling():
        return _capacity_rows_op(experts, order, counts, capacity)
    if not use_triton(experts, order, counts):
        return capacity_rows_reference(experts, order, counts, capacity)
    kept = counts.clamp(max=capacity)
    compact = torch.empty_like(order)
    inverse, offsets = _place_rows(experts, order, counts, kept, capacity, compact)
    return compact, inverse, kept, offsets


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
    if _compile.compiling():
        return _aligned_rows_op(experts, order, counts, align, capacity)
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
    if _compile.compiling():
        return _padded_slots_op(keys, order, counts, capacity)
    if not use_triton(keys, order, counts):
        return padded_slots_reference(keys, order, counts, capacity)
    total, num_keys = keys.numel(), counts.numel() - 1
    fillers = torch.full((num_keys * capacity,), -1, dtype=torch.int64, device=keys.device)
    kept = torch.empty_like(order)
    if total:
        _padded_slots_kernel[(-(-total // BLOCK),)](
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


# --- torch.library ops: what torch.compile traces (eager calls never go through them) -----------


@_compile.custom_op("moe_dropless_rows", "(Tensor order, Tensor counts) -> (Tensor, Tensor)")
def _dropless_rows_op(
    order: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return dropless_rows(order, counts)


@_dropless_rows_op.register_fake
def _dropless_rows_fake(order, counts):
    return order.new_empty(order.shape), counts.new_empty(counts.shape, dtype=torch.int32)


@_compile.custom_op(
    "moe_capacity_rows",
    "(Tensor experts, Tensor order, Tensor counts, int capacity) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _capacity_rows_op(
    experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return capacity_rows(experts, order, counts, capacity)


@_capacity_rows_op.register_fake
def _capacity_rows_fake(experts, order, counts, capacity):
    return (
        order.new_empty(order.shape),
        order.new_empty(order.shape),
        counts.new_empty(counts.shape),
        counts.new_empty(counts.shape, dtype=torch.int32),
    )


@_compile.custom_op(
    "moe_aligned_rows",
    "(Tensor experts, Tensor order, Tensor counts, int align, int? capacity) "
    "-> (Tensor, Tensor, Tensor)",
)
def _aligned_rows_op(
    experts: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    align: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return aligned_rows(experts, order, counts, align, capacity=capacity)


@_aligned_rows_op.register_fake
def _aligned_rows_fake(experts, order, counts, align, capacity):
    rows = order.shape[0] + counts.shape[0] * (align - 1)
    return (
        order.new_empty(rows),
        order.new_empty(order.shape),
        counts.new_empty(counts.shape, dtype=torch.int32),
    )


@_compile.custom_op(
    "moe_padded_slots",
    "(Tensor keys, Tensor order, Tensor counts, int capacity) -> (Tensor, Tensor)",
)
def _padded_slots_op(
    keys: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_slots(keys, order, counts, capacity)


@_padded_slots_op.register_fake
def _padded_slots_fake(keys, order, counts, capacity):
    return order.new_empty((counts.shape[0] - 1) * capacity), order.new_empty(order.shape)
