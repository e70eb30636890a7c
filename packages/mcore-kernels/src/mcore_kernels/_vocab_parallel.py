"""Combination of per-shard log-sum-exp statistics across a tensor-parallel group.

Each rank holds a contiguous vocabulary shard and computes, per row, the log-sum-exp of its
logits, the target logit (0 when the target lies on another rank) and, for the entropy, the
expectation of the logits under its own shard's softmax. The statistics of all ranks are
gathered and combined in rank order, so every rank computes bitwise the same result whatever the
communication backend's reduction order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["group_rank_and_size", "combine_shard_stats"]


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Return this process's rank in ``group`` and the group size (0 and 1 without a group).

    Args:
        group: a torch.distributed process group or None.

    Returns:
        ``(rank, world_size)``.
    """
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def combine_shard_stats(
    lse: torch.Tensor,
    target_logit: torch.Tensor,
    expected_logit: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Combine per-shard statistics into statistics of the full vocabulary.

    Only this rank's inputs keep their autograd history: the gathered copies of the other ranks'
    statistics are constants, which is exactly the gradient of the global statistics with
    respect to this rank's logits.

    Args:
        lse: ``[N]`` log-sum-exp over this rank's shard.
        target_logit: ``[N]`` target logit when the target is in this shard, else 0.
        expected_logit: ``[N]`` expectation of the logits under this shard's softmax, or None.
        group: the tensor-parallel group, or None for a full vocabulary.

    Returns:
        ``(lse, target_logit, expected_logit)`` over the full vocabulary.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return lse, target_logit, expected_logit
    parts = [lse, target_logit] + ([expected_logit] if expected_logit is not None else [])
    local = torch.stack([p.detach() for p in parts]).contiguous()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    lse_all = torch.stack([lse if r == rank else gathered[r][0] for r in range(world)])
    lse_global = torch.logsumexp(lse_all, dim=0)
    target_global = target_logit if rank == 0 else gathered[0][1]
    for r in range(1, world):
        target_global = target_global + (target_logit if r == rank else gathered[r][1])
    expected_global = None
    if expected_logit is not None:
        # A shard whose logits are all -inf has weight 0 and an undefined expectation.
        weights = torch.exp(lse_all - lse_global)
        expected_all = torch.stack(
            [expected_logit if r == rank else gathered[r][2] for r in range(world)]
        )
        terms = torch.where(weights > 0, weights * expected_all, torch.zeros_like(expected_all))
        expected_global = terms[0]
        for r in range(1, world):
            expected_global = expected_global + terms[r]
    return lse_global, target_global, expected_global
