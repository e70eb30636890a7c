"""The AdamW update on lists of tensors, with the formula and operation order of torch's."""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_update"]


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Applies one AdamW update in place to lists of tensors (one fused kernel per operation).

    Decoupled weight decay and bias-corrected moments, with the formula and operation order of
    ``torch.optim.AdamW`` (Loshchilov and Hutter, "Decoupled Weight Decay Regularization",
    ICLR 2019). Owning the update keeps the optimizer state in plain tensors that can be
    sharded, offloaded and checkpointed without the torch optimizer's bookkeeping.

    Args:
        params: fp32 parameters, updated in place.
        grads: Their gradients.
        exp_avgs: First moments, updated in place.
        exp_avg_sqs: Second moments, updated in place.
        step: Number of this step, starting at 1.
        lr: Learning rate.
        betas: Decay rates of the two moments.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay coefficient.
    """
    if not params:
        return
    beta1, beta2 = betas
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias_correction1)
