"""The router losses of a MoE policy, added to the GRPO loss with the weight of each packed row.

The GRPO loss of a packed row is its share of the minibatch's token mean over every rank, and
the rows and ranks are summed. :class:`RouterLoss` gives the router losses of a row (the
Switch-Transformer load-balancing loss and the ST-MoE z-loss of every MoE layer, computed by
:func:`mcore_models.moe.router.load_balancing_loss` and :func:`~mcore_models.moe.router.z_loss`
on the row's tokens) the same weight, the row's completion tokens over the minibatch's: over a
minibatch the weights sum to one, so the added term is the token-weighted mean of the rows'
router losses on every layout (the same rows exist on every layout; the empty rows that pad an
interleaved pipeline weigh 0).

It works through forward hooks on the training chunks' routers: while a training row runs
forward with autograd on, each router's loss is attached to its routing weights by an identity
whose backward starts the loss's backward (as Megatron-Core's ``MoEAuxLossAutoScaler`` does),
so pipeline stages and tensor-parallel ranks backpropagate their own layers' losses with no
change to the loss function. Log-prob passes (no autograd) and generation compute nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mcore_models.moe.router import RouterOutput, TopKRouter, load_balancing_loss, z_loss
from mcore_rl.moe_config import MoEModelConfig
from mcore_rl.packing import PackingContext

__all__ = ["ROUTER_LOSS_METRIC", "RouterLoss"]

ROUTER_LOSS_METRIC = "moe/router_loss"
"""Metric of the router losses added to the GRPO loss (mean over minibatches, summed over
layers)."""


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also backpropagates ``loss`` with gradient 1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class RouterLoss:
    """Adds the ``model.moe`` router losses of the training forward to the GRPO loss.

    Args:
        chunks: This rank's training chunks (their routers get the hooks).
        section: The ``model.moe`` section (the coefficients).
        tp_rank: This rank's tensor-parallel rank at the training layout.
    """

    def __init__(self, chunks: Sequence[nn.Module], section: MoEModelConfig, *, tp_rank: int = 0):
        self.section = section
        self._routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self._weight: float | None = None
        # Without sequence parallelism every tensor-parallel rank routes the whole row and
        # computes the same loss: one of them counts it. With it each rank holds its share.
        sequence_parallel = any(r.token_group is not None for r in self._routers)
        self._counts = sequence_parallel or tp_rank == 0
        self._total: torch.Tensor | None = None
        # Decided by the model's config, not by this rank's layers: a pipeline stage without
        # MoE layers still takes part in the metric's reduction.
        moe_model = any(getattr(getattr(c, "config", None), "moe", None) for c in chunks)
        self._active = moe_model and section.has_router_loss
        self._handles = []
        if self._active:
            self._handles = [r.register_forward_hook(self._hook) for r in self._routers]

    @property
    def active(self) -> bool:
        """Whether the policy is a MoE model and a loss coefficient is positive (the same on
        every rank)."""
        return self._active

    def _hook(self, router: nn.Module, args: Any, output: RouterOutput) -> RouterOutput | None:
        weight = self._weight
        if weight is None or not torch.is_grad_enabled():
            return None
        assert isinstance(router, TopKRouter)
        section = self.section
        loss = output.logits.new_zeros(())
        if section.aux_loss_coeff > 0.0:
            loss = loss + load_balancing_loss(
                output.scores,
                output.experts,
                router.config.num_experts,
                section.aux_loss_coeff,
                group=router.token_group,
            )
        if section.z_loss_coeff > 0.0:
            loss = loss + z_loss(output.logits, section.z_loss_coeff, group=router.token_group)
        weighted = loss * weight
        if self._counts:
            counted = weighted.detach()
            self._total = counted if self._total is None else self._total + counted
        output.weights = _AttachLoss.apply(output.weights, weighted)
        return output

    def weighted_rows(
        self,
        forward_step: Callable[[Any, Any, int], Any],
        context: PackingContext,
        num_global_tokens: float,
    ) -> Callable[[Any, Any, int], Any]:
        """Wraps a training forward step so that each row's router losses get its weight.

        Args:
            forward_step: ``(model, input_tensor, row) -> output`` of the pipeline schedule.
            context: The packed rows.
            num_global_tokens: Completion tokens of the minibatch over every rank.

        Returns:
            The wrapped step (``forward_step`` itself when no loss is added).
        """
        if not self.active:
            return forward_step

        def step(model: Any, input_tensor: Any, row: int) -> Any:
            tokens = float(context.loss_mask[row].sum())
            with self.weighting(tokens / num_global_tokens):
                return forward_step(model, input_tensor, row)

        return step

    @contextlib.contextmanager
    def weighting(self, weight: float) -> Iterator[None]:
        """Context in which forward passes with autograd add their router losses x ``weight``.

        Args:
            weight: The weight of the row that runs forward.

        Yields:
            None.
        """
        self._weight = weight
        try:
            yield
        finally:
            self._weight = None

    def take_metrics(
        self, over_world: Callable[[list[float]], list[float]], minibatches: int
    ) -> dict[str, float]:
        """The added loss since the last call, summed over ranks (collective when active).

        Args:
            over_world: Sums a list of floats over every rank.
            minibatches: Minibatches trained since the last call (the metric is their mean).

        Returns:
            ``{ROUTER_LOSS_METRIC: value}``, or empty when no router loss is added.
        """
        if not self.active:
            return {}
        local = 0.0 if self._total is None else float(self._total)
        self._total = None
        total = over_world([local])[0]
        return {ROUTER_LOSS_METRIC: total / minibatches}

    def close(self) -> None:
        """Removes the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active = False
