"""Mixture-of-experts: config, router, experts, token dispatchers, decode padding, HF interop."""

from mcore_models.moe.config import MoEConfig
from mcore_models.moe.layer import MoELayer
from mcore_models.moe.padding import DecodeExpertPadding, moe_layers, set_decode_expert_padding
from mcore_models.moe.parallelize import parallelize_moe
from mcore_models.moe.router import (
    RouterOutput,
    TopKRouter,
    group_limited_top_k,
    load_balancing_loss,
    z_loss,
)

__all__ = [
    "MoEConfig",
    "MoELayer",
    "parallelize_moe",
    "TopKRouter",
    "RouterOutput",
    "DecodeExpertPadding",
    "set_decode_expert_padding",
    "moe_layers",
    "group_limited_top_k",
    "load_balancing_loss",
    "z_loss",
]
