"""Token log-probs of packed rows under the training forward (any pipeline stage, any tp)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcore_kernels import token_logprobs
from mcore_models import PackedSeqParams
from mcore_rl.packing import PackingContext

__all__ = ["row_logprobs"]


def _stage(model: nn.Module) -> Any:
    # The module whose forward runs: a data-parallel wrapper around one chunk, or the chunk.
    inner = getattr(model, "module", model)
    chunks = getattr(inner, "chunks", None)
    if chunks is not None and len(chunks) == 1:
        return chunks[0]
    return inner


def row_logprobs(
    model: nn.Module,
    context: PackingContext,
    row: int,
    *,
    temperature: float = 1.0,
    device: torch.device | str = "cpu",
    input_tensor: torch.Tensor | None = None,
    tp_group: Any = None,
    loss_positions_only: bool = False,
) -> torch.Tensor:
    """Runs one packed row through the model (or a pipeline stage of it).

    Position ``q`` of the result holds the log-prob of ``context.target_ids[row, q]`` (the next
    token of the same sequence) at ``temperature``; attention never crosses a sequence
    boundary. Under tensor parallelism the vocabulary-parallel logits are never gathered: the
    log-softmax statistics are combined over ``tp_group``.

    Args:
        model: The policy, one of its pipeline chunks, or a data-parallel wrapper of either.
        context: The packed rows.
        row: Which row.
        temperature: Logits are divided by it, as during sampling.
        device: Device of the model.
        input_tensor: Hidden states from the previous pipeline stage; None on the first stage.
        tp_group: The tensor-parallel group the vocabulary is split over; None for tp = 1.
        loss_positions_only: Project to the vocabulary only at the row's loss positions
            (``context.loss_mask``), the completion tokens; other positions of the result are 0.
            The output layer and the log-softmax are the largest per-token cost after the
            decoder, and prompt positions never enter the GRPO loss or its metrics.

    Returns:
        On the last stage, float32 ``[2, bin_size]``: log-probs then entropies (differentiable
        when grad is enabled); on other stages, the hidden states for the next stage.
    """
    stage = _stage(model)
    position_ids = context.position_ids[row : row + 1].to(device, non_blocking=True)
    cu_seqlens = context.cu_seqlens[row]
    if context.context_parallel_size > 1:
        # Context-parallel attention reads the full row's boundaries on the device.
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
    # Otherwise the boundaries stay on the host: the model reads them there (checks, the
    # varlen attention's segment list) without a device synchronisation per row.
    prefix_of = context.prefix_of[row] if context.prefix_of is not None else None
    packed = PackedSeqParams(
        cu_seqlens=cu_seqlens, max_seqlen=context.max_seqlen, prefix_of=prefix_of
    )
    if input_tensor is None:
        source = context.input_ids[row : row + 1].to(device, non_blocking=True)
    else:
        source = input_tensor
    if not getattr(stage, "post_process", True):
        return stage(source, position_ids, packed_seq_params=packed)
    hidden = stage(source, position_ids, packed_seq_params=packed, return_hidden=True)[0]
    targets = context.target_ids[row]
    positions = None
    if loss_positions_only:
        # Host-side index (the context lives on the host): no device synchronisation.
        chosen = context.loss_mask[row].nonzero().squeeze(1)
        if 0 < chosen.numel() < targets.numel():
            positions = chosen.to(device, non_blocking=True)
            targets = targets[chosen]
            hidden = hidden.index_select(0, positions)
    logits = stage.compute_logits(hidden, gather=False, upcast=False)
    logprobs, entropy = token_logprobs(
        logits,
        targets.to(device, non_blocking=True),
        temperature=temperature,
        return_entropy=True,
        group=tp_group,
    )
    result = torch.stack([logprobs, entropy])
    if positions is None:
        return result
    full = result.new_zeros(2, context.target_ids.shape[1])
    return full.index_copy(1, positions, result)
