"""Token log-probs of packed rows under the training forward."""

from __future__ import annotations

import torch
from torch import nn

from mcore_kernels import token_logprobs
from mcore_models import PackedSeqParams
from mcore_rl.packing import PackingContext

__all__ = ["row_logprobs"]


def row_logprobs(
    model: nn.Module,
    context: PackingContext,
    row: int,
    *,
    temperature: float = 1.0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the model on one packed row and returns per-position log-probs and entropies.

    Position ``q`` holds the log-prob of ``context.target_ids[row, q]`` (the next token of the
    same sequence) at ``temperature``; attention never crosses a sequence boundary.

    Args:
        model: The policy (a DDP wrapper or a plain ``GPTModel``).
        context: The packed rows.
        row: Which row.
        temperature: Logits are divided by it, as during sampling.
        device: Device of the model.

    Returns:
        ``(logprobs, entropy)``, float32 ``[bin_size]`` each, on ``device``; differentiable
        when grad is enabled.
    """
    input_ids = context.input_ids[row : row + 1].to(device, non_blocking=True)
    position_ids = context.position_ids[row : row + 1].to(device, non_blocking=True)
    packed = PackedSeqParams(
        cu_seqlens=context.cu_seqlens[row].to(device, non_blocking=True),
        max_seqlen=context.max_seqlen,
    )
    logits = model(input_ids, position_ids, packed_seq_params=packed)[0]
    targets = context.target_ids[row].to(device, non_blocking=True)
    logprobs, entropy = token_logprobs(
        logits, targets, temperature=temperature, return_entropy=True
    )
    return logprobs, entropy
