"""Configuration of the mixture-of-experts MLP (:class:`MoEConfig`, a field of GPTConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_models.errors import ModelConfigError

__all__ = ["DISPATCHERS", "EXPERT_KERNELS", "ROUTER_SCORES", "MoEConfig"]

ROUTER_SCORES = ("softmax", "sigmoid")
"""Names accepted by :attr:`MoEConfig.router_score`."""

DISPATCHERS = ("alltoall", "allgather")
"""Names accepted by :attr:`MoEConfig.dispatcher`."""

EXPERT_KERNELS = ("grouped_mm", "cublas", "bmm")
"""Names accepted by :attr:`MoEConfig.expert_kernel`."""


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-experts MLP of a GPT decoder (set as ``GPTConfig(moe=MoEConfig(...))``).

    Each token is sent to the ``top_k`` experts its router scores highest; their SwiGLU outputs
    are summed with the router weights, plus an optional always-on shared expert.
    """

    num_experts: int = 8
    """Number of routed experts in each MoE layer."""
    top_k: int = 2
    """Number of experts each token is routed to."""
    expert_ffn_hidden_size: int | None = None
    """Inner width of each routed expert's SwiGLU; None means ``GPTConfig.ffn_hidden_size``."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of the shared expert every token goes through; 0 means no shared expert."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(linear(x))`` (Qwen2-MoE)."""
    router_score: str = "softmax"
    """Score function of the router: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3)."""
    router_expert_bias: bool = False
    """Add a per-expert bias buffer to the scores when choosing experts (not to the weights),
    for auxiliary-loss-free load balancing (DeepSeek-V3); see ``MoELayer.update_expert_bias``."""
    normalize_top_k: bool = True
    """Rescale the ``top_k`` routing weights of each token to sum to one."""
    router_num_groups: int = 1
    """Expert groups of group-limited routing (DeepSeek-V3's ``n_group``): the experts are cut
    into this many consecutive groups and each token picks its experts from the
    ``router_group_top_k`` groups whose two best scores sum highest; 1 turns it off."""
    router_group_top_k: int = 1
    """Groups each token may choose experts from (DeepSeek-V3's ``topk_group``)."""
    router_scaling_factor: float = 1.0
    """Factor applied to the routing weights after normalisation (DeepSeek-V3's
    ``routed_scaling_factor``)."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the Switch-Transformer load-balancing loss; 0 turns it off."""
    z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (ST-MoE); 0 turns it off."""
    capacity_factor: float | None = None
    """None routes every token (dropless); a number gives each expert
    ``ceil(tokens * top_k / num_experts * capacity_factor)`` fixed slots per rank (drop-and-pad):
    assignments past an expert's capacity are dropped, unused slots are zero padding."""
    decode_capacity_factor: float | None = None
    """Capacity factor while decode expert padding is on (see
    :func:`mcore_models.set_decode_expert_padding`); None means ``num_experts / top_k``, which
    gives every expert room for every token and so drops nothing."""
    dispatcher: str = "alltoall"
    """Token dispatcher over the expert-parallel group: "alltoall" (general) or "allgather"
    (small expert-parallel sizes; every EP rank must then hold the same number of tokens)."""
    grouped_gemm: bool = True
    """Compute experts with ``torch._grouped_mm`` where this torch and device provide it;
    False always uses a loop over experts."""
    expert_kernel: str = "grouped_mm"
    """Kernels of the experts when ``grouped_gemm`` is on: "grouped_mm" (``torch._grouped_mm``
    dropless, batched GEMMs for drop-and-pad; the faster on every measured shape) or
    "cublas" (dropless: one cuBLAS GEMM per expert and pass, with the group sizes copied to the
    host once per layer call, a device sync; for few experts with many tokens each, where
    per-expert GEMMs are as efficient as the dense one; with ``fused_experts`` inside the
    fused routed operation, like "grouped_mm"; drop-and-pad runs batched GEMMs below the
    packing capacity) or
    "bmm" (dropless on one rank: every expert
    padded to the largest expert's row count, rounded up to 8, and run as batched cuBLAS
    GEMMs like drop-and-pad, dropping nothing; the count is copied to the host, a device
    sync; routing so uneven that this pads more than 25% runs "grouped_mm" instead; with
    ``fused_experts`` the padded slots run in the fused routed operation; capacity routing
    never packs its kept rows and runs batched GEMMs over its slots). "grouped_mm" itself pads
    dropless routing this way where that was measured faster (DeepSeek-V3's layer shape at up
    to 384 rows per expert on a Hopper GPU, never inside a CUDA graph capture).
    See ``docs/benchmarks/moe.md``."""
    weights_in_experts: bool = True
    """On one rank holding every expert (no expert or expert tensor parallelism), scale each row's activation by its routing weight in the
    fused SwiGLU kernel, before the down projection (which is linear, so the result is the
    same up to rounding), and combine with a plain sum. The weight gradient then comes from
    the SwiGLU backward pass, and the combine neither saves the expert outputs nor reads them
    again in the backward pass. False scales in the combine, as the other paths do."""
    fused_experts: bool = True
    """On one rank holding every expert, with ``expert_kernel`` "grouped_mm" or "cublas", the
    routing weights inside the experts and the GPU kernels: run the token permutation, both
    grouped GEMMs (each on the kernel ``GroupedExperts.plan_for`` picks), the weighted SwiGLU and the combine as one autograd operation
    (:func:`mcore_kernels.moe.routed_experts`; the same kernels with one autograd node instead
    of seven, less host work per step). Capacity routing (drop-and-pad) then packs the kept
    assignments without padding rows for the grouped GEMMs when the capacity is at least
    ``PACKED_MIN_CAPACITY`` rows per expert (:mod:`mcore_models.moe.dispatcher`; on the
    shape's measured plan, which at Mixtral's shape loops cuBLAS over the experts and reads
    the kept counts on the host, except inside a CUDA graph capture), and runs batched GEMMs
    over the padded slots below it (separate operations). False chains the separate
    operations."""
    layer_step: int = 1
    """Every ``layer_step``-th layer is a MoE layer (layers ``i`` with ``(i + 1) % step == 0``)."""
    dense_layers: tuple[int, ...] = ()
    """Indices of layers that keep a dense MLP of ``GPTConfig.ffn_hidden_size``."""

    def __post_init__(self) -> None:
        for name in (
            "num_experts",
            "top_k",
            "layer_step",
            "router_num_groups",
            "router_group_top_k",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"MoEConfig.{name}={value!r} must be a positive int")
        if self.top_k > self.num_experts:
            raise ModelConfigError(
                f"MoEConfig.top_k={self.top_k} must not exceed num_experts={self.num_experts}"
            )
        self._check_groups()
        if not (self.router_scaling_factor > 0 and math.isfinite(self.router_scaling_factor)):
            raise ModelConfigError(
                f"MoEConfig.router_scaling_factor={self.router_scaling_factor!r} must be a "
                "positive finite float"
            )
        if self.expert_ffn_hidden_size is not None and self.expert_ffn_hidden_size <= 0:
            raise ModelConfigError(
                f"MoEConfig.expert_ffn_hidden_size={self.expert_ffn_hidden_size} must be positive"
            )
        if self.shared_expert_ffn_hidden_size < 0:
            raise ModelConfigError(
                "MoEConfig.shared_expert_ffn_hidden_size="
                f"{self.shared_expert_ffn_hidden_size} must be >= 0"
            )
        if self.shared_expert_gate and self.shared_expert_ffn_hidden_size == 0:
            raise ModelConfigError(
                "MoEConfig.shared_expert_gate=True needs a shared expert; expected "
                "shared_expert_ffn_hidden_size > 0"
            )
        if self.router_score not in ROUTER_SCORES:
            raise ModelConfigError(
                f"MoEConfig.router_score={self.router_score!r} is unknown; expected one of "
                f"{ROUTER_SCORES}"
            )
        if self.dispatcher not in DISPATCHERS:
            raise ModelConfigError(
                f"MoEConfig.dispatcher={self.dispatcher!r} is unknown; expected one of "
                f"{DISPATCHERS}"
            )
        if self.expert_kernel not in EXPERT_KERNELS:
            raise ModelConfigError(
                f"MoEConfig.expert_kernel={self.expert_kernel!r} is unknown; expected one of "
                f"{EXPERT_KERNELS}"
            )
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ModelConfigError(f"MoEConfig.{name}={value!r} must be a finite float >= 0")
        for name in ("capacity_factor", "decode_capacity_factor"):
            check_capacity_factor(f"MoEConfig.{name}", getattr(self, name))
        self.dense_layers = tuple(self.dense_layers)
        if any(not isinstance(i, int) or i < 0 for i in self.dense_layers):
            raise ModelConfigError(
                f"MoEConfig.dense_layers={self.dense_layers!r} must hold layer indices >= 0"
            )

    def _check_groups(self) -> None:
        groups, chosen = self.router_num_groups, self.router_group_top_k
        if self.num_experts % groups:
            raise ModelConfigError(
                f"MoEConfig.router_num_groups={groups} must divide num_experts={self.num_experts}"
            )
        if chosen > groups:
            raise ModelConfigError(
                f"MoEConfig.router_group_top_k={chosen} must not exceed router_num_groups={groups}"
            )
        reachable = chosen * (self.num_experts // groups)
        if self.top_k > reachable:
            raise ModelConfigError(
                f"MoEConfig.top_k={self.top_k} exceeds the {reachable} experts of the "
                f"router_group_top_k={chosen} groups a token may choose from"
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has a MoE MLP (else a dense one).

        Args:
            layer_idx: Index of the decoder layer (0-based).

        Returns:
            True for a MoE layer.
        """
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.layer_step == 0

    def mlp_parameters(self, hidden_size: int, ffn_hidden_size: int, *, active: bool) -> int:
        """Parameters of one MoE MLP (router, experts, shared expert and its gate).

        Args:
            hidden_size: Width of the residual stream.
            ffn_hidden_size: ``GPTConfig.ffn_hidden_size`` (the expert width when
                ``expert_ffn_hidden_size`` is None).
            active: Count only the ``top_k`` experts one token uses instead of all.

        Returns:
            The number of parameters.
        """
        ffn = self.expert_ffn_hidden_size or ffn_hidden_size
        experts = self.top_k if active else self.num_experts
        shared = 3 * hidden_size * self.shared_expert_ffn_hidden_size
        gate = hidden_size if self.shared_expert_gate else 0
        return experts * 3 * hidden_size * ffn + self.num_experts * hidden_size + shared + gate

    @property
    def default_decode_capacity_factor(self) -> float:
        """Capacity factor of decode padding: ``decode_capacity_factor`` or ``E / top_k``."""
        if self.decode_capacity_factor is not None:
            return self.decode_capacity_factor
        return self.num_experts / self.top_k


def check_capacity_factor(name: str, value: float | None) -> None:
    """Validate a capacity factor.

    Args:
        name: Name of the argument, for the message.
        value: The capacity factor, or None (dropless).

    Raises:
        ModelConfigError: If the value is not None and not a positive finite number.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"{name}={value!r} must be a positive float or None")
    if not (value > 0 and math.isfinite(value)):
        raise ModelConfigError(f"{name}={value!r} must be a positive finite float or None")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for ``num_tokens`` tokens (as Megatron-Core's ``get_capacity``).

    Args:
        num_tokens: Tokens routed on this rank.
        top_k: Experts per token.
        num_experts: Number of experts.
        factor: Capacity factor.

    Returns:
        ``ceil(num_tokens * top_k / num_experts * factor)``, at least 1 and at most
        ``num_tokens`` (an expert never gets a token twice).
    """
    # The epsilon keeps num_experts / top_k from rounding up to one slot more than needed.
    capacity = math.ceil(num_tokens * top_k / num_experts * factor - 1e-9)
    return max(1, min(capacity, num_tokens))
