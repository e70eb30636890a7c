"""Context parallelism in GRPO training: every packed row split over the cp ranks.

Under ``train_parallel.cp > 1`` each rank of a context-parallel group runs ``1 / cp`` of every
packed row through the policy: the load-balanced chunks of
:func:`mcore_parallel.context_parallel.split_sequence` (chunks ``r`` and ``2 cp - 1 - r`` of
every packed sequence), while the model's ring attention exchanges keys and values over the
group. So that every packed sequence splits into ``2 cp`` equal chunks it occupies a slot of
its length rounded up to a multiple of ``2 cp`` (:func:`packing_multiples`); the slot's padding
is never a loss position.

Everything after attention is token-local: each rank computes the log-probs, entropies and
GRPO loss terms of its own tokens, divided by the global token count, so summing over the
context-parallel ranks (like over the data-parallel ones) counts every token exactly once.
Gradients are reduced over data x context parallel by the distributed optimizer.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from mcore_parallel.context_parallel import split_sequence
from mcore_rl.config import ParallelConfig
from mcore_rl.errors import PackingError
from mcore_rl.packing import PackingContext

__all__ = ["packing_multiples", "split_packed_rows", "split_packing_context"]


def packing_multiples(layout: ParallelConfig) -> tuple[int, int]:
    """The bin-size and slot multiples a training layout needs from the packing.

    Args:
        layout: The training layout.

    Returns:
        ``(pad_multiple, slot_multiple)`` for :func:`mcore_rl.packing.pack_sequences`: bins
        are multiples of 8 (and of ``tp x cp`` under sequence parallelism, which splits each
        rank's ``bin / cp`` tokens over the tensor-parallel ranks); every sequence's slot is a
        multiple of ``2 cp`` (1 without context parallelism).
    """
    pad_multiple = math.lcm(8, layout.tp * layout.cp) if layout.sequence_parallel else 8
    slot_multiple = 2 * layout.cp if layout.cp > 1 else 1
    return pad_multiple, slot_multiple


def split_packed_rows(
    tensor: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """This rank's tokens of every packed row of a per-token tensor.

    Args:
        tensor: ``[rows, bin_size]`` values at the packed positions.
        cu_seqlens: ``[rows, width]`` boundaries of every row's sequences (the packing
            context's, padding segments included; repeated ends are empty segments).
        cp_size: Context-parallel size.
        cp_rank: This rank's index in the context-parallel group.

    Returns:
        ``[rows, bin_size / cp_size]``: per row, chunks ``cp_rank`` and
        ``2 cp_size - 1 - cp_rank`` of every sequence, in order.

    Raises:
        PackingError: If the shapes do not match or a segment is not a multiple of
            ``2 * cp_size`` tokens.
    """
    if tensor.dim() != 2 or cu_seqlens.dim() != 2 or tensor.shape[0] != cu_seqlens.shape[0]:
        raise PackingError(
            f"tensor of shape {tuple(tensor.shape)} and cu_seqlens of shape "
            f"{tuple(cu_seqlens.shape)} must be [rows, bin_size] and [rows, width]"
        )
    if cp_size == 1:
        return tensor
    bin_size = int(tensor.shape[1])
    if bin_size % (2 * cp_size):
        raise PackingError(
            f"bin_size={bin_size} must be a multiple of 2 * cp = {2 * cp_size} "
            "(pack with mcore_rl.context_parallel.packing_multiples)"
        )
    rows = []
    for row in range(tensor.shape[0]):
        bounds = cu_seqlens[row]
        lengths = bounds[1:] - bounds[:-1]
        if bool((lengths % (2 * cp_size) != 0).any()):
            raise PackingError(
                f"row {row} has segments of {lengths.tolist()} tokens; under context "
                f"parallelism every segment must be a multiple of 2 * cp = {2 * cp_size} "
                "(pack with slot_multiple = 2 * cp)"
            )
        rows.append(
            split_sequence(tensor[row : row + 1], cp_size, cp_rank, dim=1, cu_seqlens=bounds)
        )
    return torch.cat(rows)


def split_packing_context(context: PackingContext, cp_size: int, cp_rank: int) -> PackingContext:
    """The rows of ``context`` as this context-parallel rank runs them.

    Token ids, targets, positions, loss mask and advantages hold this rank's
    ``bin_size / cp_size`` tokens of every row; ``cu_seqlens`` and ``max_seqlen`` stay those of
    the full rows (what the model's context-parallel attention takes), so do ``info`` and
    ``bin_indices``. Build per-sequence values into full rows first
    (:meth:`PackingContext.scatter`) and split them with :func:`split_packed_rows`.

    Args:
        context: Full packed rows, their sequences in slots of multiples of ``2 * cp_size``.
        cp_size: Context-parallel size.
        cp_rank: This rank's index in the context-parallel group.

    Returns:
        The split context (``context`` itself for ``cp_size == 1``).

    Raises:
        PackingError: If ``cp_rank`` is out of range or the rows do not split evenly.
    """
    if not 0 <= cp_rank < cp_size:
        raise PackingError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    if cp_size == 1:
        return context

    def split(tensor: torch.Tensor) -> torch.Tensor:
        return split_packed_rows(tensor, context.cu_seqlens, cp_size, cp_rank)

    return replace(
        context,
        input_ids=split(context.input_ids),
        position_ids=split(context.position_ids),
        target_ids=split(context.target_ids),
        loss_mask=split(context.loss_mask),
        advantages=split(context.advantages),
        context_parallel_size=cp_size,
    )
