"""Token dispatch of a MoE layer: permute tokens to their experts and combine the results.

Two dispatchers move tokens over the expert-parallel (EP) group, after Megatron-Core's
``MoEAllGatherTokenDispatcher`` and ``MoEAlltoAllTokenDispatcher``:

- all-to-all (general): each rank sorts its ``T * top_k`` routing assignments by expert and
  sends every EP rank the tokens of the experts it holds; outputs travel back the same way.
- all-gather (small EP): every rank gathers all tokens and routing decisions of the group,
  runs its own experts on the assignments that chose them, and the partial outputs are
  reduce-scattered back.

Both run dropless (variable group sizes; the all-to-all exchanges its split sizes on the host)
or drop-and-pad (every expert gets ``capacity`` slots per source rank; fixed shapes, no host
sync, as CUDA graphs need). Assignments past an expert's capacity are dropped in token order.

Dropless routing accepts a different number of tokens on every EP rank, zero included (the
all-gather pads to the group's largest count first). Drop-and-pad routing derives the capacity
from the local token count, so every EP rank must bring the same number of tokens; the
inference engine pads its steps to the group's largest count for that.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_models.moe.experts import GroupedExperts
from mcore_parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["all_to_all", "dispatch_and_combine"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dimension 0.

    Args:
        x: Rows to send, grouped by destination rank.
        group: Process group.
        output_splits: Rows received from each rank; None splits evenly.
        input_splits: Rows sent to each rank; None splits evenly.

    Returns:
        The received rows, grouped by source rank. The backward pass sends gradients back.
    """
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _sum_token_copies(
    grad: torch.Tensor, index: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """Gradient of the tokens: gather each assignment's row of ``grad`` through ``index``
    (assignment ``a`` of token ``a // top_k``) and sum every token's ``top_k`` rows at once."""
    rows = grad.index_select(0, index)
    return rows.view(num_tokens, top_k, grad.shape[-1]).sum(dim=1)


def _count(indices: torch.Tensor, size: int) -> torch.Tensor:
    """int64 ``[size]`` occurrences of each index (``bincount`` without its host sync)."""
    counts = torch.zeros(size, dtype=torch.int64, device=indices.device)
    return counts.scatter_add_(0, indices, torch.ones_like(indices))


def _inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] == i`` (a scatter, no second sort)."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


class _PermuteRows(torch.autograd.Function):
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


class _ExpandTokens(torch.autograd.Function):
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


def _weighted_sum(per_assignment: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * per_assignment[t * top_k + k]``.

    Each token's ``top_k`` expert outputs are summed in one reduction (no atomics, so the
    result is deterministic and the same on every routing path).
    """
    num_tokens, top_k = weights.shape
    rows = per_assignment.view(num_tokens, top_k, per_assignment.shape[-1])
    return (rows * weights.unsqueeze(-1)).sum(dim=1)


def _capacity_slots(experts: torch.Tensor, valid: torch.Tensor, num_experts: int, capacity: int):
    """Slot ``expert * capacity + position`` of each assignment; dropped ones get the last slot.

    ``position`` counts earlier assignments (in token order) to the same expert. The running
    count is a scan along the assignments of an ``[experts, assignments]`` int32 indicator
    (an inner-dimension scan: a scan over the outer dimension of the transposed layout was
    100x slower on the GPU at 65k assignments and 128 experts). No sort and no host sync, so
    the slots can be computed inside a CUDA graph.
    """
    ids = torch.arange(num_experts, device=experts.device)
    chosen = (experts[None, :] == ids[:, None]) & valid[None, :]
    running = chosen.to(torch.int32).cumsum(dim=1, dtype=torch.int32)
    position = running.gather(0, experts[None, :]).squeeze(0) - 1
    keep = valid & (position < capacity)
    return torch.where(keep, experts * capacity + position, num_experts * capacity)


class _FillSlots(torch.autograd.Function):
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


class _ReadSlots(torch.autograd.Function):
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


def _run_padded(
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
    outputs = run(_FillSlots.apply(x, rows, slots, top_k))
    return _ReadSlots.apply(outputs, slots, filler)


def _padded_local(experts_module: GroupedExperts, capacity: int):
    def run(buffer: torch.Tensor) -> torch.Tensor:
        local = experts_module.num_experts
        return experts_module.forward_padded(buffer.view(local, capacity, -1)).flatten(0, 1)

    return run


def _regroup_index(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row order turning ``[source, expert]``-major rows into ``[expert, source]``-major rows."""
    # ``counts`` lives on the host; the index is built there in a few vectorised ops.
    flat = counts.flatten()
    starts = (flat.cumsum(0) - flat).view_as(counts)
    block_starts = starts.t().flatten()
    lengths = counts.t().flatten()
    out_starts = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    shift = torch.repeat_interleave(block_starts - out_starts, lengths, output_size=total)
    return (torch.arange(total) + shift).to(device)


def _dropless_alltoall(
    x: torch.Tensor,
    experts: torch.Tensor,
    top_k: int,
    experts_module: GroupedExperts,
    num_experts: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert outputs of the assignments sorted by expert, the sort order, its inverse, and the
    counts per expert."""
    order = torch.argsort(experts, stable=True)
    inverse = _inverse_permutation(order)
    permuted = _ExpandTokens.apply(x, order, inverse, top_k)
    counts = _count(experts, num_experts)
    if group is None:
        return experts_module(permuted, counts), order, inverse, counts
    ep = dist.get_world_size(group)
    local = num_experts // ep
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    host = torch.stack([counts, received_counts]).cpu()
    send_splits = host[0].view(ep, local).sum(1).tolist()
    received_matrix = host[1].view(ep, local)
    receive_splits = received_matrix.sum(1).tolist()
    received = all_to_all(permuted, group, receive_splits, send_splits)
    regroup = _regroup_index(received_matrix, x.device)
    ungroup = _inverse_permutation(regroup)
    grouped = _PermuteRows.apply(received, regroup, ungroup)
    outputs = experts_module(grouped, received_matrix.sum(0).to(x.device))
    restored = _PermuteRows.apply(outputs, ungroup, regroup)
    outputs = all_to_all(restored, group, send_splits, receive_splits)
    return outputs, order, inverse, counts


def dispatch_and_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    experts_module: GroupedExperts,
    *,
    num_experts: int,
    capacity: int | None,
    dispatcher: str,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send every token to its experts, run them, and sum their weighted outputs per token.

    Args:
        x: ``[T, hidden]`` this rank's tokens.
        weights: ``[T, top_k]`` routing weights.
        experts: ``[T, top_k]`` chosen (global) expert indices.
        experts_module: This rank's experts (``num_experts / ep`` of them, consecutive).
        num_experts: Total number of experts.
        capacity: Slots per expert and source rank (drop-and-pad), or None (dropless).
        dispatcher: "alltoall" or "allgather".
        group: Expert-parallel group, or None without expert parallelism.

    Returns:
        ``([T, hidden]`` combined output, ``[num_experts]`` int64 assignments per expert of
        this rank's tokens before any drop).
    """
    top_k = experts.shape[1]
    if group is not None and dispatcher == "allgather":
        return _allgather(
            x,
            weights,
            experts,
            experts_module,
            num_experts=num_experts,
            capacity=capacity,
            group=group,
        )
    flat_experts = experts.reshape(-1)
    if capacity is None:
        outputs, order, inverse, counts = _dropless_alltoall(
            x, flat_experts, top_k, experts_module, num_experts, group
        )
        # Back from expert order to assignment order.
        per_assignment = _PermuteRows.apply(outputs, inverse, order)
        return _weighted_sum(per_assignment, weights), counts
    counts = _count(flat_experts, num_experts)
    valid = torch.ones_like(flat_experts, dtype=torch.bool)
    slots = _capacity_slots(flat_experts, valid, num_experts, capacity)
    if group is None:
        run = _padded_local(experts_module, capacity)
    else:
        run = _padded_alltoall(experts_module, capacity, group)
    per_assignment = _run_padded(x, top_k, slots, num_experts * capacity, run)
    return _weighted_sum(per_assignment, weights), counts


def _padded_alltoall(experts_module: GroupedExperts, capacity: int, group: dist.ProcessGroup):
    def run(buffer: torch.Tensor) -> torch.Tensor:
        ep, local, hidden = dist.get_world_size(group), experts_module.num_experts, buffer.shape[-1]
        received = all_to_all(buffer, group).view(ep, local, capacity, hidden)
        grouped = received.transpose(0, 1).reshape(local, ep * capacity, hidden)
        outputs = experts_module.forward_padded(grouped).view(local, ep, capacity, hidden)
        return all_to_all(outputs.transpose(0, 1).reshape(-1, hidden), group)

    return run


def _allgather(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    experts_module: GroupedExperts,
    *,
    num_experts: int,
    capacity: int | None,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = experts.shape[1]
    counts = _count(experts.reshape(-1), num_experts)
    num_tokens = x.shape[0]
    if capacity is None:
        x, weights, experts = _pad_to_group_max(x, weights, experts, num_experts, group)
    # Each rank's gradient of the gathered tensors covers its own experts only: reduce-scatter.
    all_x = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True)
    all_weights = gather_from_sequence_parallel_region(
        weights, group, tensor_parallel_output_grad=True
    )
    all_experts = gather_from_sequence_parallel_region(experts, group)
    local = experts_module.num_experts
    first = dist.get_rank(group) * local
    flat_experts = all_experts.reshape(-1) - first
    valid = (flat_experts >= 0) & (flat_experts < local)
    flat_experts = torch.where(valid, flat_experts, 0)
    if capacity is None:
        # Non-local assignments sort after the local ones and are cut off; they read the
        # zero row appended to the outputs.
        keys = torch.where(valid, flat_experts, local)
        order = torch.argsort(keys, stable=True)
        local_counts = _count(keys, local + 1)
        num_kept = int(local_counts[:local].sum())
        kept = order[:num_kept]
        outputs = experts_module(all_x.index_select(0, kept // top_k), local_counts[:local])
        position = _inverse_permutation(order)
        rows = torch.where(position < num_kept, position, num_kept)
        outputs = torch.cat([outputs, outputs.new_zeros(1, outputs.shape[-1])])
        per_assignment = outputs.index_select(0, rows)
    else:
        ep = dist.get_world_size(group)
        slots = _capacity_slots(flat_experts, valid, local, ep * capacity)
        run = _padded_local(experts_module, ep * capacity)
        per_assignment = _run_padded(all_x, top_k, slots, local * ep * capacity, run)
    combined = _weighted_sum(per_assignment, all_weights)
    return reduce_scatter_to_sequence_parallel_region(combined, group)[:num_tokens], counts


def _pad_to_group_max(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad this rank's tokens to the most tokens of any EP rank (the gathers need equal sizes).

    Padding rows choose expert ``num_experts``, which no rank holds, so they are never run.
    Dropless routing only: it syncs with the host anyway, drop-and-pad must not (CUDA graphs),
    so there every rank must bring the same number of tokens.
    """
    size = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(sizes, size, group=group)
    missing = int(sizes.max()) - x.shape[0]
    if missing == 0:
        return x, weights, experts
    x = torch.cat([x, x.new_zeros(missing, x.shape[1])])
    weights = torch.cat([weights, weights.new_zeros(missing, weights.shape[1])])
    experts = torch.cat([experts, experts.new_full((missing, experts.shape[1]), num_experts)])
    return x, weights, experts
