"""``torch.library`` ops of the MoE autograd functions (what ``torch.compile`` traces).

Each public MoE function calls its op while Dynamo traces it (eager calls apply the
``autograd.Function`` directly). The ops come from
:func:`mcore_kernels._compile.register_function`: the forward applies the Function without
autograd, and the backward op recomputes the forward with autograd and returns the Function's
own gradients. The torch references of the ops are in :mod:`mcore_kernels.moe.reference`.
"""

from __future__ import annotations

import torch

from mcore_kernels._compile import register_function
from mcore_kernels.moe.permute import (
    PermuteTokensFunction,
    UnpermuteCombineFunction,
    UnpermuteSumFunction,
)
from mcore_kernels.moe.routed import RoutedExpertsFunction
from mcore_kernels.moe.router import MoERouterFunction
from mcore_kernels.moe.swiglu import SwiGLUFunction, WeightedSwiGLUFunction

__all__ = ["OPS"]


def _half_width(gate_up: torch.Tensor, *args: object) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _router_fake(logits, top_k, score, expert_bias, normalize, scaling):
    tokens, experts = logits.shape
    return (
        logits.new_empty((tokens, top_k)),
        logits.new_empty((tokens, top_k), dtype=torch.int64),
        logits.new_empty((tokens, experts)),
        logits.new_empty((experts,), dtype=torch.int64),
    )


OPS = {
    "moe_swiglu": register_function(
        "moe_swiglu", SwiGLUFunction, "Tensor gate_up", 1, (0,), _half_width
    ),
    "moe_weighted_swiglu": register_function(
        "moe_weighted_swiglu",
        WeightedSwiGLUFunction,
        "Tensor gate_up, Tensor weights",
        1,
        (0, 1),
        _half_width,
    ),
    "moe_permute_tokens": register_function(
        "moe_permute_tokens",
        PermuteTokensFunction,
        "Tensor x, Tensor rows, Tensor slots, int top_k",
        1,
        (0,),
        lambda x, rows, slots, top_k: x.new_empty((rows.shape[0], x.shape[1])),
    ),
    "moe_unpermute_combine": register_function(
        "moe_unpermute_combine",
        UnpermuteCombineFunction,
        "Tensor y, Tensor weights, Tensor slots, Tensor fillers",
        1,
        (0, 1),
        lambda y, weights, slots, fillers: y.new_empty((weights.shape[0], y.shape[1])),
    ),
    "moe_unpermute_sum": register_function(
        "moe_unpermute_sum",
        UnpermuteSumFunction,
        "Tensor y, Tensor slots, Tensor fillers, int top_k",
        1,
        (0,),
        lambda y, slots, fillers, top_k: y.new_empty((slots.shape[0] // top_k, y.shape[1])),
    ),
    "moe_router": register_function(
        "moe_router",
        MoERouterFunction,
        "Tensor logits, int top_k, str score, Tensor? expert_bias, bool normalize, float scaling",
        4,
        (0,),
        _router_fake,
    ),
    "moe_routed_experts": register_function(
        "moe_routed_experts",
        RoutedExpertsFunction,
        "Tensor x, Tensor weights, Tensor w_gate_up, Tensor w_down, Tensor order, "
        "Tensor inverse, Tensor offsets, int top_k",
        1,
        (0, 1, 2, 3),
        lambda x, *args: x.new_empty(x.shape),
    ),
}
"""The forward ops by name (``torch.ops.mcore_kernels.<name>``)."""
