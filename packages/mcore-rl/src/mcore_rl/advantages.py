"""Group-relative advantage estimators: GRPO, leave-one-out and Dr. GRPO."""

from __future__ import annotations

from typing import Literal

import torch

from mcore_rl.errors import RLInputError

__all__ = ["AdvantageEstimator", "compute_advantages"]

AdvantageEstimator = Literal["grpo", "leave_one_out", "dr_grpo"]
"""Names of the estimators :func:`compute_advantages` knows."""


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: AdvantageEstimator = "grpo",
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Turns rewards of groups of completions of one prompt into per-completion advantages.

    Rewards are laid out group after group: ``rewards[g * group_size + i]`` is completion ``i``
    of prompt ``g``.

    - ``"grpo"``: ``(r - mean) / std`` within the group (sample std, Bessel-corrected, as in
      DeepSeekMath, arXiv:2402.03300).
    - ``"leave_one_out"``: ``r_i - mean of the other rewards`` of the group (RLOO,
      arXiv:2402.14740).
    - ``"dr_grpo"``: ``r - mean``, no std division (Dr. GRPO, arXiv:2503.20783).

    A group whose rewards are all equal gets advantage 0 under every estimator.

    Args:
        rewards: Float rewards, shape ``[num_groups * group_size]``.
        group_size: Completions per prompt (G), at least 2.
        estimator: Which estimator.
        eps: Standard deviations at or below ``eps`` count as zero.

    Returns:
        Float32 advantages with the shape of ``rewards``.

    Raises:
        RLInputError: If the shapes, ``group_size`` or ``estimator`` are invalid.
    """
    if group_size < 2:
        raise RLInputError(f"group_size={group_size} must be >= 2 for group-relative advantages")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise RLInputError(
            f"rewards of shape {tuple(rewards.shape)} must be 1-D with a length divisible by "
            f"group_size={group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    constant = std <= eps
    if estimator == "grpo":
        advantages = (grouped - mean) / torch.where(constant, torch.ones_like(std), std)
    elif estimator == "leave_one_out":
        advantages = (grouped - mean) * group_size / (group_size - 1)
    elif estimator == "dr_grpo":
        advantages = grouped - mean
    else:
        raise RLInputError(
            f"estimator={estimator!r} is unknown, expected 'grpo', 'leave_one_out' or 'dr_grpo'"
        )
    return advantages.masked_fill(constant, 0.0).reshape(rewards.shape)
