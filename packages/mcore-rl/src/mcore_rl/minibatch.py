"""A step's rollouts packed into this rank's bins, one :class:`Minibatch` per optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.config import GRPOConfig
from mcore_rl.context_parallel import packing_multiples, split_packed_rows, split_packing_context
from mcore_rl.packing import PackingContext, distribute_bins, pack_sequences
from mcore_rl.rollout import Rollout
from mcore_rl.shared_prompts import build_shared_prompt_rows

__all__ = ["Minibatch", "pack_minibatches"]


@dataclass(kw_only=True, slots=True)
class Minibatch:
    """The rollouts of one optimizer step, packed into this rank's bins."""

    context: PackingContext
    """Packed token ids, positions, loss mask and advantages of this rank's bins (under context
    parallelism, this rank's tokens of them)."""
    inference_logprobs: torch.Tensor
    """Log-probs the inference engine sampled with, scattered (and split) like the tokens."""
    num_global_tokens: float
    """Completion tokens of the minibatch over every rank (the loss normaliser)."""
    old_logprobs: torch.Tensor | None = None
    """Log-probs of the policy before the step (set by the old-logprob pass)."""
    old_from_training_forward: bool = False
    """The weights have not changed since generation (the step's first minibatch): the old
    log-probs are the training forward's own, detached, and no separate pass runs."""
    ref_logprobs: torch.Tensor | None = None
    """Log-probs of the reference weights (set when ``loss.kl_beta > 0``)."""


def pack_minibatches(
    rollouts: list[Rollout],
    advantages: torch.Tensor,
    config: GRPOConfig,
    *,
    dp_rank: int,
    dp_size: int,
    cp_rank: int,
    cp_size: int,
    pad_id: int,
) -> tuple[list[Minibatch], dict[str, float]]:
    """Splits the step's prompt groups into ``packing.minibatches_per_step`` minibatches and
    packs each into bins, this rank's share of them.

    Args:
        rollouts: Every rollout of the step, ``rollout.group_size`` per prompt, identical on
            every rank.
        advantages: One advantage per rollout.
        config: The run config (its packing options and training layout).
        dp_rank: This rank's index in its data-parallel group.
        dp_size: Ranks of the data-parallel group (they split the bins).
        cp_rank: This rank's index in its context-parallel group.
        cp_size: Ranks of the context-parallel group (they split every row).
        pad_id: Token id of the padding.

    Returns:
        The minibatches, and ``packing/efficiency`` (mean over minibatches) and
        ``packing/bins_per_rank`` (of the first) as metrics.
    """
    group_size = config.rollout.group_size
    packing = config.packing
    layout = config.train_parallel
    # The interleaved schedule runs a multiple of pp microbatches on every rank.
    bin_multiple = layout.pp if layout.vp > 1 else 1
    groups = len(rollouts) // group_size
    per_minibatch = -(-groups // packing.minibatches_per_step)
    minibatches: list[Minibatch] = []
    efficiencies: list[float] = []
    # Sequence parallelism splits every row over the tensor-parallel ranks, context
    # parallelism every sequence into 2 cp chunks.
    pad_multiple, slot_multiple = packing_multiples(layout)
    for first in range(0, groups, per_minibatch):
        last = min(groups, first + per_minibatch)
        chosen = list(range(first * group_size, last * group_size))
        sequences = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in chosen]
        tokens = float(sum(len(rollouts[i].completion_ids) for i in chosen))
        if packing.share_prompts:  # cp is 1 (checked by the config)
            context, logprobs, efficiency = build_shared_prompt_rows(
                sequences,
                [len(rollouts[i].prompt_ids) for i in chosen],
                advantages[chosen].tolist(),
                [rollouts[i].inference_logprobs for i in chosen],
                token_budget=packing.max_tokens_per_microbatch,
                pad_multiple=pad_multiple,
                max_sequences_per_bin=packing.max_sequences_per_bin,
                dp_size=dp_size,
                dp_rank=dp_rank,
                bin_multiple=bin_multiple,
                pad_id=pad_id,
            )
            efficiencies.append(efficiency)
            minibatches.append(
                Minibatch(context=context, inference_logprobs=logprobs, num_global_tokens=tokens)
            )
            continue
        info = pack_sequences(
            [len(s) for s in sequences],
            max_sequences_per_bin=packing.max_sequences_per_bin,
            algorithm=packing.algorithm,
            token_budget=packing.max_tokens_per_microbatch,
            pad_multiple=pad_multiple,
            slot_multiple=slot_multiple,
        )
        efficiencies.append(info.efficiency)
        mine = distribute_bins(info, dp_size)[dp_rank]
        mine = mine + [-1] * (-len(mine) % bin_multiple)
        context = PackingContext.build(
            sequences,
            [len(rollouts[i].prompt_ids) for i in chosen],
            advantages[chosen],
            info,
            bin_indices=mine,
            max_sequences_per_bin=packing.max_sequences_per_bin,
            pad_id=pad_id,
        )
        inference_logprobs = context.scatter([rollouts[i].inference_logprobs for i in chosen])
        if cp_size > 1:
            # This rank's tokens of every row; the token count stays the global one.
            inference_logprobs = split_packed_rows(
                inference_logprobs, context.cu_seqlens, cp_size, cp_rank
            )
            context = split_packing_context(context, cp_size, cp_rank)
        minibatches.append(
            Minibatch(
                context=context, inference_logprobs=inference_logprobs, num_global_tokens=tokens
            )
        )
    metrics = {
        "packing/efficiency": float(sum(efficiencies) / len(efficiencies)),
        "packing/bins_per_rank": float(minibatches[0].context.input_ids.shape[0]),
    }
    return minibatches, metrics
