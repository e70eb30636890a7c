"""Autograd-aware communication between tensor-parallel ranks.

Each mapping is a pair of collectives, one for the forward pass and its adjoint for the
backward pass (the pairing follows Shoeybi et al., "Megatron-LM", arXiv:1909.08053, section 3,
and Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, for the sequence-parallel ones):

==================================================  ======================  =======================
mapping                                             forward                 backward
==================================================  ======================  =======================
:func:`copy_to_tensor_parallel_region`              identity                all-reduce
:func:`reduce_from_tensor_parallel_region`          all-reduce              identity
:func:`scatter_to_tensor_parallel_region`           split last dim          all-gather last dim
:func:`gather_from_tensor_parallel_region`          all-gather last dim     split last dim
:func:`scatter_to_sequence_parallel_region`         split sequence dim      all-gather sequence dim
:func:`gather_from_sequence_parallel_region`        all-gather sequence     reduce-scatter (or split)
:func:`reduce_scatter_to_sequence_parallel_region`  reduce-scatter seq.     all-gather sequence dim
==================================================  ======================  =======================

Every function takes the tensor-parallel process group; ``None`` or a group of one rank makes it
the identity, so layers built without parallelism run the same code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.errors import ParallelConfigError

__all__ = [
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]

Group = dist.ProcessGroup | None


def _world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _check_divisible(x: torch.Tensor, dim: int, world: int) -> None:
    if x.shape[dim] % world != 0:
        raise ParallelConfigError(
            f"tensor of shape {tuple(x.shape)}: dimension {dim} (size {x.shape[dim]}) must be "
            f"divisible by the tensor-parallel size {world}"
        )


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0; move dim there and back.
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: Group, reduce_grad: bool
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enters a tensor-parallel region: identity forward, gradient all-reduced backward.

    Args:
        x: Input replicated on every rank of ``group``.
        group: Tensor-parallel group, or None for no parallelism.

    Returns:
        ``x`` (a view), whose gradient is summed over ``group``.
    """
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leaves a tensor-parallel region: partial results all-reduced forward, identity backward.

    Args:
        x: Partial sum held by this rank.
        group: Tensor-parallel group, or None for no parallelism.

    Returns:
        The sum of ``x`` over ``group``.
    """
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keeps this rank's chunk of the last dimension; the gradient is all-gathered backward.

    Args:
        x: Input replicated on every rank of ``group``.
        group: Tensor-parallel group, or None for no parallelism.

    Returns:
        Chunk ``rank`` of ``world_size`` equal chunks of the last dimension.

    Raises:
        ParallelConfigError: If the last dimension is not divisible by the group size.
    """
    return _Scatter.apply(x, x.dim() - 1, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gathers the last dimension; the gradient is split back to this rank's chunk.

    Args:
        x: This rank's chunk of the last dimension.
        group: Tensor-parallel group, or None for no parallelism.

    Returns:
        The chunks of all ranks concatenated in rank order along the last dimension.
    """
    return _Gather.apply(x, x.dim() - 1, group, False)


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group, *, sequence_dim: int = 0
) -> torch.Tensor:
    """Keeps this rank's chunk of the sequence dimension; the gradient is all-gathered backward.

    Args:
        x: Input with the full sequence, replicated on every rank of ``group``.
        group: Tensor-parallel group, or None for no parallelism.
        sequence_dim: Index of the sequence dimension (0 for ``[s, b, h]``, 1 for ``[b, s, h]``).

    Returns:
        Chunk ``rank`` of ``world_size`` equal chunks of ``sequence_dim``.

    Raises:
        ParallelConfigError: If the sequence length is not divisible by the group size.
    """
    return _Scatter.apply(x, sequence_dim, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor,
    group: Group,
    *,
    sequence_dim: int = 0,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """All-gathers the sequence dimension.

    Args:
        x: This rank's chunk of the sequence.
        group: Tensor-parallel group, or None for no parallelism.
        sequence_dim: Index of the sequence dimension.
        tensor_parallel_output_grad: Whether the consumer of the output runs tensor-parallel
            (e.g. a column-parallel linear), so each rank's gradient is a partial sum that the
            backward pass reduce-scatters; with False the gradient is only split.

    Returns:
        The full sequence, chunks concatenated in rank order.
    """
    return _Gather.apply(x, sequence_dim, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group, *, sequence_dim: int = 0
) -> torch.Tensor:
    """Sums partial results over ``group`` and keeps this rank's chunk of the sequence.

    Args:
        x: Partial sum over the full sequence held by this rank.
        group: Tensor-parallel group, or None for no parallelism.
        sequence_dim: Index of the sequence dimension.

    Returns:
        Chunk ``rank`` of the summed tensor along ``sequence_dim``; the gradient is all-gathered.

    Raises:
        ParallelConfigError: If the sequence length is not divisible by the group size.
    """
    return _ReduceScatter.apply(x, sequence_dim, group)
