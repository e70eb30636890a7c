"""Top-k router of a MoE layer and its auxiliary losses (load balancing, z-loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.moe.config import MoEConfig

__all__ = ["RouterOutput", "TopKRouter", "load_balancing_loss", "z_loss"]


@dataclass(slots=True)
class RouterOutput:
    """What the router decided for a batch of ``T`` tokens."""

    weights: torch.Tensor
    """``[T, top_k]`` routing weights, in the dtype of the input."""
    experts: torch.Tensor
    """``[T, top_k]`` int64 indices of the chosen experts."""
    logits: torch.Tensor
    """``[T, num_experts]`` float32 router logits."""
    scores: torch.Tensor
    """``[T, num_experts]`` float32 scores (softmax or sigmoid of the logits)."""


def load_balancing_loss(
    scores: torch.Tensor, experts: torch.Tensor, num_experts: int, coeff: float
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (Fedus et al., 2021, eq. 4).

    ``coeff * E * sum_i f_i * P_i`` with ``f_i`` the fraction of the ``T * top_k`` routing
    assignments that chose expert ``i`` and ``P_i`` the mean score of expert ``i`` over the
    tokens (scores normalised to sum to one per token), as in Megatron-Core's
    ``switch_load_balancing_loss_func``.

    Args:
        scores: ``[T, E]`` router scores.
        experts: ``[T, top_k]`` chosen experts.
        num_experts: ``E``.
        coeff: Loss coefficient.

    Returns:
        Scalar float32 loss.
    """
    probs = scores / scores.sum(dim=-1, keepdim=True)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(
        0, experts.reshape(-1), torch.ones_like(experts.reshape(-1), dtype=counts.dtype)
    )
    fraction = counts / experts.numel()
    return coeff * num_experts * (fraction * probs.mean(dim=0)).sum()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss (Zoph et al., 2022, ST-MoE eq. 5): ``coeff * mean(logsumexp(logits)^2)``.

    Args:
        logits: ``[T, E]`` float32 router logits.
        coeff: Loss coefficient.

    Returns:
        Scalar float32 loss.
    """
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also starts the backward of ``aux_loss`` (gradient 1).

    Megatron-Core's ``MoEAuxLossAutoScaler`` does the same, so that the auxiliary losses train
    the router without the caller adding them to the loss.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class TopKRouter(nn.Module):
    """Linear router choosing ``top_k`` of ``num_experts`` experts per token.

    Args:
        hidden_size: Width of the input.
        config: MoE config (expert count, top-k, score function, bias, losses).
        dtype: Dtype of the router weight.
    """

    expert_bias: torch.Tensor | None

    def __init__(self, hidden_size: int, config: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size, dtype=dtype))
        if config.router_expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(config.num_experts, dtype=torch.float32)
            )
        else:
            self.expert_bias = None
        self.aux_loss: torch.Tensor | None = None
        """Detached sum of the auxiliary losses of the last forward pass that computed them."""

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the expert bias (called by GPTModel after materialising its buffers)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Score the experts and pick the ``top_k`` best for each token.

        With a positive ``aux_loss_coeff`` or ``z_loss_coeff`` and autograd on, the losses
        are attached to the returned weights: backpropagating through the layer output also
        backpropagates them (gradient 1, the coefficients already applied).

        Args:
            x: ``[T, hidden]`` tokens.

        Returns:
            The routing decision.
        """
        config = self.config
        logits = F.linear(x, self.weight).float()
        if config.router_score == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        experts = torch.topk(choice, config.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if config.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if torch.is_grad_enabled() and (config.aux_loss_coeff > 0 or config.z_loss_coeff > 0):
            aux = logits.new_zeros(())
            if config.aux_loss_coeff > 0:
                aux = aux + load_balancing_loss(
                    scores, experts, config.num_experts, config.aux_loss_coeff
                )
            if config.z_loss_coeff > 0:
                aux = aux + z_loss(logits, config.z_loss_coeff)
            self.aux_loss = aux.detach()
            weights = _AttachAuxLoss.apply(weights, aux)
        return RouterOutput(weights=weights, experts=experts, logits=logits, scores=scores)
