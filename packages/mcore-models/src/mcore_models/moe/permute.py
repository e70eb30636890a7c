"""Row permutations of MoE token dispatch, with gather-only (deterministic) backward passes.

Every token is copied once per routing assignment (``top_k`` of them, assignment ``a`` of token
``a // top_k``) into expert order, and the expert outputs are read back and summed per token
with the routing weights, by the fused kernels of :mod:`mcore_kernels.moe`. Every forward
gather has a backward that is a gather too (through the inverse index) followed by one
per-token reduction: no atomic scatter-add, so gradients are bitwise reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mcore_kernels.moe import permute_tokens, unpermute_combine
from mcore_kernels.moe.rows import capacity_rows as capacity_rows_kernel
from mcore_kernels.moe.rows import padded_slots

__all__ = [
    "GatherOrZero",
    "PermuteRows",
    "capacity_fillers",
    "capacity_rows",
    "capacity_slots",
    "count",
    "expert_order",
    "inverse_permutation",
    "padded_capacity",
    "padded_index",
    "run_padded",
    "sorted_slots",
]

PADDING_LIMIT = 1.25
"""Most rows, relative to the routing assignments, that :func:`padded_capacity` accepts. At
DeepSeek-V3's layer shape with 8192 tokens (256 rows per expert) the batched GEMMs over 304 /
320 / 352 / 384 slots per expert took 37.9 / 39.2 / 43.2 / 47.0 ms per step against 44.4 ms
for the grouped plan (one H200): padding past about 1.35x loses."""


def count(indices: torch.Tensor, size: int) -> torch.Tensor:
    """Occurrences of each index (``bincount`` without its host sync).

    Args:
        indices: int64 indices in ``[0, size)``.
        size: Number of bins.

    Returns:
        int64 ``[size]`` counts.
    """
    counts = torch.zeros(size, dtype=torch.int64, device=indices.device)
    return counts.scatter_add_(0, indices, torch.ones_like(indices))


def expert_order(experts: torch.Tensor, largest: int) -> torch.Tensor:
    """Assignments sorted by expert, each expert's in token order (a stable sort).

    The keys are cast to the narrowest integer type that holds ``num_experts`` first: the GPU
    sort is a radix sort with one pass per key byte, eight for int64 keys, one for uint8.

    Args:
        experts: ``[A]`` int64 expert of each assignment, in ``[0, largest]``.
        largest: Largest key (the last expert, or an extra key past the experts).

    Returns:
        ``[A]`` int64 assignment of each sorted position.
    """
    if largest <= torch.iinfo(torch.uint8).max:
        experts = experts.to(torch.uint8)
    elif largest <= torch.iinfo(torch.int16).max:
        experts = experts.to(torch.int16)
    return torch.argsort(experts, stable=True)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation (a scatter, no second sort).

    Args:
        order: int64 permutation of ``range(len(order))``.

    Returns:
        ``inverse`` with ``inverse[order[i]] == i``.
    """
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


class PermuteRows(torch.autograd.Function):
    """``rows[index]`` for a permutation ``index``; the backward gathers with its inverse.

    Equal to ``index_select``, whose backward scatters with atomic adds; a gather is
    deterministic and cheaper.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        """Selects ``rows[index]``.

        Args:
            ctx: Autograd context; keeps ``inverse`` for the backward.
            rows: ``[N, ...]`` rows to permute.
            index: ``[N]`` int64 permutation.
            inverse: ``[N]`` int64 inverse permutation of ``index``.

        Returns:
            ``[N, ...]`` permuted rows.
        """
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        """Gathers the gradient back through the inverse permutation.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[N, ...]`` gradient of the permuted rows.

        Returns:
            ``(grad_rows [N, ...], None, None)``.
        """
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class GatherOrZero(torch.autograd.Function):
    """``values[index]`` (zero where ``index < 0``) for an injective ``index``; the backward
    gathers through ``inverse`` (``inverse[index[i]] == i``, -1 for values never read)."""

    @staticmethod
    def forward(
        ctx: Any, values: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        """Selects ``values[index]``, zero where ``index < 0``.

        Args:
            ctx: Autograd context; keeps ``inverse`` for the backward.
            values: ``[N, ...]`` values to read.
            index: ``[M]`` int64 injective index into ``values``, -1 for a zero row.
            inverse: ``[N]`` int64 position that reads each value (``inverse[index[i]] == i``), -1
                for a value never read.

        Returns:
            ``[M, ...]`` gathered rows.
        """
        ctx.save_for_backward(inverse)
        return _gather_or_zero(values, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        """Gathers the gradient through ``inverse`` (zero for values never read).

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[M, ...]`` gradient of the gathered rows.

        Returns:
            ``(grad_values [N, ...], None, None)``.
        """
        (inverse,) = ctx.saved_tensors
        return _gather_or_zero(grad, inverse), None, None


def _gather_or_zero(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if values.numel() == 0:
        return values.new_zeros(index.shape)
    picked = values.index_select(0, index.clamp(min=0))
    return torch.where(index >= 0, picked, torch.zeros_like(picked))


def capacity_fillers(
    experts: torch.Tensor,
    valid: torch.Tensor | None,
    num_experts: int,
    capacity: int,
    sources: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert slots of drop-and-pad routing: the assignment in each slot and the slot of each
    assignment.

    The assignments are ``sources`` equal consecutive blocks, one per source rank; every
    expert has ``capacity`` slots per source, so its slots are ``[sources, capacity]`` and the
    slot of an assignment is ``(expert * sources + source) * capacity + position``, where
    ``position`` counts the earlier assignments of the same source to the same expert (in
    token order). An assignment whose position reaches ``capacity``, or that is not ``valid``,
    is dropped.

    The positions come from one stable sort by ``(expert, source)`` and one kernel
    (:func:`mcore_kernels.moe.rows.padded_slots`): no host sync, so the slots can be computed
    inside a CUDA graph. (A running count along a ``[sources, experts, assignments]``
    indicator did the same with a scan over ``experts`` times more elements: 0.25 ms of a
    DeepSeek-V3-shaped step at 8192 tokens on one H200.)

    Args:
        experts: ``[A]`` int64 expert of each assignment (any value where not ``valid``).
        valid: ``[A]`` bool, False for assignments to skip; None keeps them all.
        num_experts: Number of experts.
        capacity: Slots per expert and source.
        sources: Number of source blocks (``A`` must be divisible by it).

    Returns:
        ``(fillers, kept)``: ``[num_experts * sources * capacity]`` int64 assignment in each
        slot (-1 for an empty one) and ``[A]`` int64 slot of each assignment (-1 when dropped).
    """
    total = experts.numel()
    keys = experts * sources if sources > 1 else experts
    if sources > 1:
        per_source = total // sources
        keys = keys + torch.arange(total, device=experts.device) // per_source
    skip = num_experts * sources
    if valid is not None:
        keys = torch.where(valid, keys, skip)
    order = expert_order(keys, skip)
    return padded_slots(keys, order, count(keys, skip + 1), capacity)


def capacity_slots(
    experts: torch.Tensor,
    valid: torch.Tensor | None,
    num_experts: int,
    capacity: int,
    sources: int = 1,
) -> torch.Tensor:
    """Expert slot of each assignment under drop-and-pad routing; dropped ones get the last.

    As :func:`capacity_fillers` (same arguments), with every dropped assignment in slot
    ``num_experts * sources * capacity``.

    Args:
        experts: ``[A]`` int64 expert of each assignment (any value where not ``valid``).
        valid: ``[A]`` bool, False for assignments to skip; None keeps them all.
        num_experts: Number of experts.
        capacity: Slots per expert and source.
        sources: Number of source blocks (``A`` must be divisible by it).

    Returns:
        ``[A]`` int64 slots.
    """
    _, kept = capacity_fillers(experts, valid, num_experts, capacity, sources)
    return torch.where(kept < 0, num_experts * sources * capacity, kept)


def capacity_rows(
    experts: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact expert-sorted rows of the assignments that capacity routing keeps (no host sync).

    The same drop rule as :func:`capacity_slots` (an expert keeps its first ``capacity``
    assignments in token order) from one stable sort, but the kept assignments are packed
    expert after expert with no padding rows between them: a grouped GEMM then runs only the
    kept rows, while every shape still depends on the token count alone. After the sort, one
    kernel (:func:`mcore_kernels.moe.rows.capacity_rows`).

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        counts: ``[num_experts]`` assignments per expert.
        capacity: Rows each expert keeps at most.

    Returns:
        ``(order, inverse, kept, offsets)``: ``[A]`` int64 assignment in each row (-1 past the
        kept rows), ``[A]`` int64 row of each assignment (-1 when dropped), ``[num_experts]``
        int64 kept rows of each expert and their int32 running sum (end row of each expert).
    """
    order = expert_order(experts, counts.shape[0] - 1)
    return capacity_rows_kernel(experts, order, counts, capacity)


def padded_capacity(
    counts: torch.Tensor, assignments: int, largest: int | None = None
) -> int | None:
    """Capacity that holds every expert's rows: the largest count rounded up to 8 (one host sync).

    Dropless routing on batched GEMMs pads every expert to the largest expert's rows; that pays
    only while the padding stays small, so None is returned when ``num_experts * capacity``
    exceeds :data:`PADDING_LIMIT` times the ``assignments`` (routing too uneven).

    Args:
        counts: ``[num_experts]`` assignments per expert.
        assignments: Total assignments (tokens times top-k).
        largest: The largest count when already on the host (then ``counts`` is not read).

    Returns:
        The capacity, or None.
    """
    if largest is None:
        largest = int(counts.max()) if counts.numel() else 0
    capacity = max(8, -(-largest // 8) * 8)
    if counts.numel() * capacity > PADDING_LIMIT * max(assignments, 1):
        return None
    return capacity


def sorted_slots(experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Slot ``expert * capacity + position`` of every assignment when no expert overflows.

    ``position`` counts the earlier assignments to the same expert in token order (as
    :func:`capacity_slots`), here without the drop test.

    Args:
        experts: ``[A]`` int64 expert of each assignment.
        counts: ``[num_experts]`` assignments per expert, each at most ``capacity``.
        capacity: Slots per expert.

    Returns:
        ``[A]`` int64 slots.
    """
    order = expert_order(experts, counts.shape[0] - 1)
    position = inverse_permutation(order)
    starts = counts.cumsum(0) - counts
    return experts * capacity + position - starts.index_select(0, experts)


def padded_index(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignment filling each slot and slot of each kept assignment (no host sync).

    Args:
        slots: ``[A]`` int64 slot of each assignment, ``num_slots`` when dropped.
        num_slots: Number of real slots.

    Returns:
        ``(fillers, kept)``: ``[num_slots]`` int64 assignment in each slot (-1 for an empty
        one) and ``[A]`` int64 slot of each assignment (-1 when dropped).
    """
    # Dropped assignments all land in one extra trash slot, so shapes never depend on the
    # routing.
    filler = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=slots.device)
    filler.scatter_(0, slots, torch.arange(slots.shape[0], device=slots.device))
    kept = torch.where(slots < num_slots, slots, -1)
    return filler[:num_slots], kept


def run_padded(
    x: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    num_slots: int,
    run: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Fill ``num_slots`` expert slots with tokens, run them, combine the weighted outputs.

    The fill and the combine are the fused kernels of :mod:`mcore_kernels.moe` (torch
    references on the CPU): gathers in both directions, no atomics.

    Args:
        x: ``[T, hidden]`` tokens.
        weights: ``[T, top_k]`` routing weights (assignment ``a`` is token ``a // top_k``).
        slots: ``[T * top_k]`` slot of each assignment, ``num_slots`` when dropped.
        num_slots: Number of real slots.
        run: Maps the ``[num_slots, hidden]`` slot buffer to the experts' outputs.

    Returns:
        ``[T, hidden]`` weighted sum of each token's expert outputs (dropped ones count zero).
    """
    top_k = weights.shape[1]
    filler, kept = padded_index(slots, num_slots)
    rows = torch.where(filler < 0, -1, filler // top_k)
    outputs = run(permute_tokens(x, rows, kept, top_k))
    return unpermute_combine(outputs, weights, kept, filler)
