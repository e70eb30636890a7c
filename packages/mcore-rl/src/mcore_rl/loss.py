"""The GRPO policy loss: clipped surrogate with clip-higher, k3 KL, truncated importance sampling.

The loss is normalised per token over the whole global batch: every microbatch on every
data-parallel rank divides its token sum by the same ``num_global_tokens``, so summing the
microbatch losses over ranks gives the mean over every completion token of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.errors import RLConfigError, RLInputError

__all__ = ["LossConfig", "grpo_loss", "grpo_loss_metric_names", "kl_k3"]


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """Hyper-parameters of :func:`grpo_loss`."""

    clip_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_low``."""
    clip_high: float = 0.28
    """The ratio is clipped above at ``1 + clip_high`` (clip-higher, DAPO arXiv:2503.14476)."""
    kl_beta: float = 0.0
    """Weight of the k3 KL penalty to the reference policy; 0 turns it off (and skips the
    reference forward)."""
    reference_on_device: bool = False
    """Keep the reference weights (and the policy's copy while they are swapped in) in device
    memory, two more copies of the local parameters, instead of pinned host memory: the swap
    around the reference forward then costs two device copies instead of three host
    transfers."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (needs ``entropy`` with grad); keeps exploration alive."""
    importance_sampling_cap: float | None = 2.0
    """Cap of the truncated importance weight between training and inference log-probs; None
    turns the correction off."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise RLConfigError(f"clip_low={self.clip_low} must be in [0, 1)")
        if self.clip_high < 0.0:
            raise RLConfigError(f"clip_high={self.clip_high} must be >= 0")
        if self.kl_beta < 0.0:
            raise RLConfigError(f"kl_beta={self.kl_beta} must be >= 0")
        if self.entropy_coef < 0.0:
            raise RLConfigError(f"entropy_coef={self.entropy_coef} must be >= 0")
        if self.importance_sampling_cap is not None and self.importance_sampling_cap <= 0.0:
            raise RLConfigError(
                f"importance_sampling_cap={self.importance_sampling_cap} must be > 0 or None"
            )


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) on samples of the policy.

    ``exp(ref - logp) - (ref - logp) - 1`` (Schulman, "Approximating KL divergence", 2020):
    unbiased, always non-negative.

    Args:
        logprobs: Policy log-probs of the sampled tokens.
        ref_logprobs: Reference log-probs of the same tokens.

    Returns:
        The per-token estimate.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_global_tokens: float,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Computes the GRPO loss of one microbatch and its metrics.

    Per token: ``w * (-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + beta * k3)
    - entropy_coef * H`` (the entropy bonus is not importance-weighted)
    with ``r = exp(logprobs - old_logprobs)`` and the truncated importance weight
    ``w = min(exp(old_logprobs - inference_logprobs), cap)`` (1 when either is None). The loss
    is the masked token sum divided by ``num_global_tokens``.

    Args:
        logprobs: Log-probs of the sampled tokens under the current weights (with grad), 1-D.
        old_logprobs: Log-probs under the weights that generated the step (training forward).
        advantages: Per-token advantages.
        loss_mask: 1 for completion tokens that count, 0 elsewhere.
        num_global_tokens: Completion tokens of the whole global batch (all ranks, all
            microbatches).
        config: The loss hyper-parameters.
        ref_logprobs: Reference log-probs; required when ``config.kl_beta > 0``.
        inference_logprobs: Log-probs the inference engine reported while sampling.
        entropy: Per-token entropy of the policy under the current weights: logged, and
            rewarded with ``config.entropy_coef`` (then it must carry grad).

    Returns:
        ``(loss, metrics)``; each metric is a masked token sum divided by
        ``num_global_tokens``, so summing it over microbatches and ranks gives the global mean.

    Raises:
        RLInputError: If shapes differ, ``num_global_tokens`` is not positive or a needed
            input is missing.
    """
    shape = logprobs.shape
    named: dict[str, torch.Tensor | None] = {
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "loss_mask": loss_mask,
        "ref_logprobs": ref_logprobs,
        "inference_logprobs": inference_logprobs,
        "entropy": entropy,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise RLInputError(
                f"{name} has shape {tuple(tensor.shape)}, expected the shape of logprobs "
                f"{tuple(shape)}"
            )
    if num_global_tokens <= 0:
        raise RLInputError(f"num_global_tokens={num_global_tokens} must be > 0")
    if config.kl_beta > 0.0 and ref_logprobs is None:
        raise RLInputError(f"ref_logprobs is None but kl_beta={config.kl_beta} > 0")
    if config.entropy_coef > 0.0 and entropy is None:
        raise RLInputError(f"entropy is None but entropy_coef={config.entropy_coef} > 0")

    mask = loss_mask.float()
    old = old_logprobs.detach().float()
    ratio = torch.exp(logprobs.float() - old)
    adv = advantages.float()
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    metrics: dict[str, torch.Tensor] = {}
    if ref_logprobs is not None:
        kl = kl_k3(logprobs.float(), ref_logprobs.detach().float())
        if config.kl_beta > 0.0:
            per_token = per_token + config.kl_beta * kl
        metrics["kl"] = kl.detach()
    if inference_logprobs is not None:
        inference = inference_logprobs.detach().float()
        metrics["token_prob_error"] = (old.exp() - inference.exp()).abs()
        metrics["generation_kl"] = kl_k3(inference, old)
        if config.importance_sampling_cap is not None:
            weight = torch.exp(old - inference).clamp(max=config.importance_sampling_cap)
            per_token = per_token * weight
            metrics["importance_weight"] = weight
    metrics["clip_fraction"] = (ratio.detach() != clipped.detach()).float()
    metrics["ratio"] = ratio.detach()
    if entropy is not None:
        if config.entropy_coef > 0.0:
            per_token = per_token - config.entropy_coef * entropy.float()
        metrics["entropy"] = entropy.detach().float()
    loss = (per_token * mask).sum() / num_global_tokens
    summed = {k: (v * mask).sum() / num_global_tokens for k, v in metrics.items()}
    return loss, summed


def grpo_loss_metric_names(
    config: LossConfig, *, reference: bool, inference: bool, entropy: bool
) -> set[str]:
    """The metric names :func:`grpo_loss` returns, plus ``"loss"``, without calling it.

    Ranks that compute no loss (pipeline stages before the last) reduce the same names.

    Args:
        config: The loss config.
        reference: Whether ``ref_logprobs`` is given.
        inference: Whether ``inference_logprobs`` is given.
        entropy: Whether ``entropy`` is given.

    Returns:
        The names.
    """
    names = {"loss", "clip_fraction", "ratio"}
    if reference:
        names.add("kl")
    if inference:
        names |= {"token_prob_error", "generation_kl"}
        if config.importance_sampling_cap is not None:
            names.add("importance_weight")
    if entropy:
        names.add("entropy")
    return names
