"""Row permutations of MoE token dispatch, with gather-only (deterministic) backward passes.

Every token is copied once per routing assignment (``top_k`` of them, assignment ``a`` of token
``a // top_k``) into expert order, and the expert outputs are read back into assignment order
and summed per token with the routing weights. Each forward gather has a backward that is a
gather too (through the inverse permutation) followed by one per-token reduction: no atomic
scatter-add, so gradients are bitwise reproducible.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ExpandTokens",
    "FillSlots",
    "PermuteRows",
    "ReadSlots",
    "capacity_slots",
    "count",
    "inverse_permutation",
    "run_padded",
    "weighted_sum",
]


def _sum_token_copies(
    grad: torch.Tensor, index: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """Gradient of the tokens: gather each assignment's row of ``grad`` through ``index``
    (assignment ``a`` of token ``a // top_k``) and sum every token's ``top_k`` rows at once."""
    rows = grad.index_select(0, index)
    return rows.view(num_tokens, top_k, grad.shape[-1]).sum(dim=1)


def count(indices: torch.Tensor, size: int) -> torch.Tensor:
    """int64 ``[size]`` occurrences of each index (``bincount`` without its host sync)."""
    counts = torch.zeros(size, dtype=torch.int64, device=indices.device)
    return counts.scatter_add_(0, indices, torch.ones_like(indices))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] == i`` (a scatter, no second sort)."""
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
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class ExpandTokens(torch.autograd.Function):
    """``x[order // top_k]``: one copy of each token per assignment, in ``order``.

    The backward gathers each token's ``top_k`` copies through the inverse of ``order`` and
    sums them in one reduction (``index_select``'s backward would scatter with atomic adds).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k, ctx.num_tokens = top_k, x.shape[0]
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        return _sum_token_copies(grad, inverse, ctx.num_tokens, ctx.top_k), None, None, None


def weighted_sum(per_assignment: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * per_assignment[t * top_k + k]``.

    Each token's ``top_k`` expert outputs are summed in one reduction (no atomics, so the
    result is deterministic and the same on every routing path).
    """
    num_tokens, top_k = weights.shape
    rows = per_assignment.view(num_tokens, top_k, per_assignment.shape[-1])
    return (rows * weights.unsqueeze(-1)).sum(dim=1)


def capacity_slots(
    experts: torch.Tensor,
    valid: torch.Tensor,
    num_experts: int,
    capacity: int,
    sources: int = 1,
) -> torch.Tensor:
    """Expert slot of each assignment under drop-and-pad routing; dropped ones get the last.

    The assignments are ``sources`` equal consecutive blocks, one per source rank; every
    expert has ``capacity`` slots per source, so its slots are ``[sources, capacity]`` and the
    slot of an assignment is ``(expert * sources + source) * capacity + position``, where
    ``position`` counts the earlier assignments of the same source to the same expert (in
    token order). An assignment whose position reaches ``capacity``, or that is not ``valid``,
    is dropped and gets slot ``num_experts * sources * capacity``.

    The running count is a scan along the assignments of a ``[sources, experts, assignments]``
    int32 indicator (an inner-dimension scan: a scan over the outer dimension of the transposed
    layout was 100x slower on the GPU at 65k assignments and 128 experts). No sort and no host
    sync, so the slots can be computed inside a CUDA graph.

    Args:
        experts: ``[A]`` int64 expert of each assignment (any value where not ``valid``).
        valid: ``[A]`` bool, False for assignments to skip.
        num_experts: Number of experts.
        capacity: Slots per expert and source.
        sources: Number of source blocks (``A`` must be divisible by it).

    Returns:
        ``[A]`` int64 slots.
    """
    per_source = experts.numel() // sources
    ids = torch.arange(num_experts, device=experts.device)
    blocks = experts.view(sources, 1, per_source)
    chosen = (blocks == ids[None, :, None]) & valid.view(sources, 1, per_source)
    running = chosen.to(torch.int32).cumsum(dim=2, dtype=torch.int32)
    position = running.gather(1, blocks).view(-1) - 1
    source = torch.arange(sources, device=experts.device).repeat_interleave(per_source)
    keep = valid & (position < capacity)
    slot = (experts * sources + source) * capacity + position
    return torch.where(keep, slot, num_experts * sources * capacity)


class FillSlots(torch.autograd.Function):
    """``buffer[s] = x[rows[s]]`` (a zero row where ``rows[s] == len(x)``): expert slots.

    The backward gathers each token's ``top_k`` slot gradients through ``slots`` (a dropped
    assignment reads a zero row) and sums them: no atomic scatter, deterministic.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(slots)
        ctx.top_k, ctx.num_tokens = top_k, x.shape[0]
        return torch.cat([x, x.new_zeros(1, x.shape[-1])]).index_select(0, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (slots,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros(1, grad.shape[-1])])
        return _sum_token_copies(padded, slots, ctx.num_tokens, ctx.top_k), None, None, None


class ReadSlots(torch.autograd.Function):
    """``out[a] = outputs[slots[a]]`` (a zero row for dropped assignments).

    ``filler[s]`` is the assignment that filled slot ``s`` (``len(slots)`` when empty), so the
    backward is a gather too.
    """

    @staticmethod
    def forward(
        ctx: Any, outputs: torch.Tensor, slots: torch.Tensor, filler: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(filler)
        return torch.cat([outputs, outputs.new_zeros(1, outputs.shape[-1])]).index_select(0, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (filler,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros(1, grad.shape[-1])])
        return padded.index_select(0, filler), None, None


def run_padded(
    x: torch.Tensor,
    top_k: int,
    slots: torch.Tensor,
    num_slots: int,
    run: Any,
) -> torch.Tensor:
    """Fill ``num_slots`` expert slots with tokens, run them, return per-assignment outputs.

    Args:
        x: ``[T, hidden]`` tokens.
        top_k: Assignments per token (assignment ``a`` belongs to token ``a // top_k``).
        slots: ``[T * top_k]`` slot of each assignment, ``num_slots`` when dropped.
        num_slots: Number of real slots.
        run: Maps the ``[num_slots, hidden]`` slot buffer to the experts' outputs.

    Returns:
        ``[T * top_k, hidden]`` output of each assignment (zero when dropped).
    """
    num_assignments = slots.shape[0]
    # Which assignment fills each slot (gathers both ways, no atomics). Dropped assignments
    # all land in one extra trash slot, so shapes never depend on the routing; empty slots
    # read a zero row appended to the tokens.
    filler = torch.full((num_slots + 1,), num_assignments, dtype=slots.dtype, device=x.device)
    filler.scatter_(0, slots, torch.arange(num_assignments, device=x.device))
    filler = filler[:num_slots]
    rows = torch.where(filler < num_assignments, filler // top_k, x.shape[0])
    outputs = run(FillSlots.apply(x, rows, slots, top_k))
    return ReadSlots.apply(outputs, slots, filler)
