"""Top-k router of a MoE layer and its auxiliary losses (load balancing, z-loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcore_kernels.moe import moe_router
from mcore_models.moe.config import MoEConfig

__all__ = ["RouterOutput", "TopKRouter", "group_limited_top_k", "load_balancing_loss", "z_loss"]


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
    counts: torch.Tensor | None = None
    """``[num_experts]`` int64 assignments per expert, when the fused router counted them."""


def _global_tokens(num_tokens: int, device: torch.device, group: dist.ProcessGroup | None):
    total = torch.tensor(float(num_tokens), device=device)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total


def load_balancing_loss(
    scores: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    coeff: float,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (Fedus et al., 2021, eq. 4).

    ``coeff * E * sum_i f_i * P_i`` with ``f_i`` the fraction of the ``T * top_k`` routing
    assignments that chose expert ``i`` and ``P_i`` the mean score of expert ``i`` over the
    tokens (scores normalised to sum to one per token), as in Megatron-Core's
    ``switch_load_balancing_loss_func``.

    With ``group`` (the tensor-parallel group under sequence parallelism, where each rank
    routes a chunk of the sequence) ``f_i`` and the token count are summed over the group and
    each rank returns its share of the loss of all the group's tokens: the shares sum to that
    loss, and so do the router gradients once the sequence-parallel gradients are reduced.

    Args:
        scores: ``[T, E]`` router scores.
        experts: ``[T, top_k]`` chosen experts.
        num_experts: ``E``.
        coeff: Loss coefficient.
        group: Group whose ranks route parts of one batch of tokens, or None.

    Returns:
        Scalar float32 loss (this rank's share with ``group``).
    """
    probs = scores / scores.sum(dim=-1, keepdim=True)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(
        0, experts.reshape(-1), torch.ones_like(experts.reshape(-1), dtype=counts.dtype)
    )
    if group is not None:
        dist.all_reduce(counts, group=group)
    total = _global_tokens(scores.shape[0], scores.device, group)
    fraction = counts / (total * experts.shape[-1])
    return coeff * num_experts * (fraction * probs.sum(dim=0) / total).sum()


def z_loss(
    logits: torch.Tensor, coeff: float, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Router z-loss (Zoph et al., 2022, ST-MoE eq. 5): ``coeff * mean(logsumexp(logits)^2)``.

    Args:
        logits: ``[T, E]`` float32 router logits.
        coeff: Loss coefficient.
        group: As in :func:`load_balancing_loss`: the mean runs over the group's tokens and
            this rank returns its share.

    Returns:
        Scalar float32 loss (this rank's share with ``group``).
    """
    total = _global_tokens(logits.shape[0], logits.device, group)
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / total


def group_limited_top_k(
    choice: torch.Tensor, top_k: int, num_groups: int, group_top_k: int
) -> torch.Tensor:
    """Indices of the ``top_k`` best experts, taken from each token's best expert groups.

    The ``E`` experts form ``num_groups`` consecutive groups; a group's score is the sum of
    its two highest expert scores (DeepSeek-V3, arXiv:2412.19437, section 2.1.2) and every
    token keeps the experts of its ``group_top_k`` best groups. With one group this is a plain
    top-k.

    Args:
        choice: ``[T, E]`` float32 selection scores.
        top_k: Experts per token.
        num_groups: Number of expert groups.
        group_top_k: Groups kept per token.

    Returns:
        ``[T, top_k]`` int64 expert indices, best first.
    """
    if num_groups > 1:
        tokens, num_experts = choice.shape
        grouped = choice.view(tokens, num_groups, num_experts // num_groups)
        best_two = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, best_two.topk(group_top_k, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, num_experts)
    return torch.topk(choice, top_k, dim=-1).indices


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
        """Detached sum of the auxiliary losses of the last forward pass that computed them
        (this rank's share under sequence parallelism)."""
        self.token_group: dist.ProcessGroup | None = None
        """Group of ranks routing chunks of one sequence (sequence parallelism), over which
        the auxiliary losses are normalised; set by ``parallelize_moe``."""

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
        counts = None
        if config.router_num_groups == 1:
            # One fused kernel: scores, top-k, weights, counts (torch reference on the CPU).
            weights, experts, scores, counts = moe_router(
                logits,
                config.top_k,
                score=config.router_score,
                expert_bias=self.expert_bias,
                normalize=config.normalize_top_k,
                scaling=config.router_scaling_factor,
                weights_dtype=x.dtype,
            )
        else:
            weights, experts, scores = self._route_grouped(logits)
        weights = weights.to(x.dtype)
        if torch.is_grad_enabled() and (config.aux_loss_coeff > 0 or config.z_loss_coeff > 0):
            aux = logits.new_zeros(())
            if config.aux_loss_coeff > 0:
                aux = aux + load_balancing_loss(
                    scores,
                    experts,
                    config.num_experts,
                    config.aux_loss_coeff,
                    group=self.token_group,
                )
            if config.z_loss_coeff > 0:
                aux = aux + z_loss(logits, config.z_loss_coeff, group=self.token_group)
            self.aux_loss = aux.detach()
            weights = _AttachAuxLoss.apply(weights, aux)
        return RouterOutput(
            weights=weights, experts=experts, logits=logits, scores=scores, counts=counts
        )

    def _route_grouped(
        self, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group-limited routing in torch: ``(weights, experts, scores)``."""
        config = self.config
        if config.router_score == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        experts = group_limited_top_k(
            choice, config.top_k, config.router_num_groups, config.router_group_top_k
        )
        weights = scores.gather(1, experts)
        if config.normalize_top_k:
            # The epsilon keeps sigmoid scores that all underflow from dividing by zero.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if config.router_scaling_factor != 1.0:
            weights = weights * config.router_scaling_factor
        return weights, experts, scores
