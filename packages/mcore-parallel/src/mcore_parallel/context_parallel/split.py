"""Splitting a batch into this rank's load-balanced chunks, and gathering it back.

A model under context parallelism runs on ``T / cp`` tokens per rank: the inputs (token ids,
labels, loss masks) are split with :func:`split_sequence`, RoPE needs the original positions
from :func:`position_ids`, packed sequences need the local boundaries from
:func:`local_cu_seqlens`, and :func:`gather_sequence` restores the full order (differentiably)
when a full-length tensor is needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.context_parallel.layout import ChunkLayout
from mcore_parallel.errors import ParallelConfigError

__all__ = ["split_sequence", "gather_sequence", "position_ids", "local_cu_seqlens"]


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def split_sequence(
    tensor: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    dim: int = 1,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns this rank's load-balanced part of a full-length tensor.

    Args:
        tensor: A tensor whose dimension ``dim`` is the (packed) sequence, e.g. token ids
            ``[B, T]`` or hidden states ``[B, T, H]``.
        cp_size: Context-parallel size.
        cp_rank: This rank's index in the context-parallel group.
        dim: The sequence dimension.
        cu_seqlens: Cumulative lengths of packed sequences along ``dim`` (each a multiple of
            ``2 * cp_size``), or None for one sequence.

    Returns:
        The ``T / cp_size`` tokens of chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of
        every sequence, in that order (a copy).

    Raises:
        ParallelConfigError: If ``cp_rank`` is out of range or a length is not a multiple of
            ``2 * cp_size``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ParallelConfigError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    layout = ChunkLayout(tensor.shape[dim], cp_size, cu_seqlens, tensor.device)
    return tensor.index_select(dim, layout.tokens(cp_rank)["index"])


def position_ids(
    seq_len: int,
    cp_size: int,
    cp_rank: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Positions (within their sequence) of this rank's tokens, for RoPE.

    Args:
        seq_len: Length of the full (packed) sequence.
        cp_size: Context-parallel size.
        cp_rank: This rank's index in the context-parallel group.
        cu_seqlens: Cumulative lengths of packed sequences, or None for one sequence.
        device: Device of the result.

    Returns:
        int64 ``[seq_len / cp_size]``; positions restart at 0 in each packed sequence.

    Raises:
        ParallelConfigError: If a length is not a multiple of ``2 * cp_size``.
    """
    layout = ChunkLayout(seq_len, cp_size, cu_seqlens)
    return layout.tokens(cp_rank)["pos"].to(device)


def local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Boundaries of the packed sequences in this rank's local tokens.

    Each sequence contributes ``L / cp_size`` tokens to every rank, contiguous, so the local
    boundaries are the global ones divided by ``cp_size`` (the same on every rank).

    Args:
        cu_seqlens: Cumulative lengths of the full packed sequence.
        cp_size: Context-parallel size.

    Returns:
        ``cu_seqlens // cp_size`` (same dtype and device).

    Raises:
        ParallelConfigError: If a length is not a multiple of ``2 * cp_size``.
    """
    ChunkLayout(int(cu_seqlens[-1]), cp_size, cu_seqlens)
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        group: dist.ProcessGroup | None,
        dim: int,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        size, rank = _group_size_rank(group)
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        total = local.shape[dim] * size
        layout = ChunkLayout(total, size, cu_seqlens, local.device)
        order = torch.cat([layout.tokens(r)["index"] for r in range(size)])
        full = torch.empty(
            (*local.shape[:dim], total, *local.shape[dim + 1 :]),
            dtype=local.dtype,
            device=local.device,
        )
        full.index_copy_(dim, order, torch.cat(pieces, dim=dim))
        ctx.dim, ctx.local_index = dim, layout.tokens(rank)["index"]
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # Every rank computes the same function of the gathered tensor: keep this rank's part.
        return grad.index_select(ctx.dim, ctx.local_index), None, None, None


def gather_sequence(
    local: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    dim: int = 1,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gathers the load-balanced parts of every rank back into the full sequence order.

    Differentiable: the backward pass keeps this rank's part of the gradient (every rank is
    expected to compute the same function of the full tensor, as with tensor-parallel gathers).

    Args:
        local: This rank's part, from :func:`split_sequence` (same ``dim`` and ``cu_seqlens``).
        group: The context-parallel group.
        dim: The sequence dimension.
        cu_seqlens: Cumulative lengths of the FULL packed sequence, or None.

    Returns:
        The full-length tensor, identical on every rank of ``group``.

    Raises:
        ParallelConfigError: If a length is not a multiple of ``2 * cp``.
    """
    dim %= local.dim()
    return _Gather.apply(local, group, dim, cu_seqlens)  # type: ignore[no-any-return]
