"""The ``model.moe`` section of a GRPO run: a mixture-of-experts policy and its router losses.

``num_experts = 0`` (the default) keeps the dense SwiGLU MLP. With experts, every decoder
layer's MLP becomes a :class:`mcore_models.MoELayer` whose experts are split over
``train_parallel.ep`` (and their FFNs over ``train_parallel.etp``) while training and over
``infer_parallel.ep``/``etp`` while generating. The router's load-balancing and z-losses are
added to the GRPO loss by :mod:`mcore_rl.router_loss` (weighted like the GRPO loss, so the sum
is the same at every layout), never by the router itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from mcore_models import MoEConfig
from mcore_rl.errors import RLConfigError

if TYPE_CHECKING:
    from mcore_rl.config import GRPOConfig, ParallelConfig

__all__ = ["MoEModelConfig", "as_moe_section", "check_expert_layouts", "moe_config_for"]

_LOSS_FIELDS = ("aux_loss_coeff", "z_loss_coeff")
"""Fields that may be set for a Hugging Face checkpoint (the others are its shape)."""


@dataclass(kw_only=True, slots=True)
class MoEModelConfig:
    """A mixture-of-experts MLP in every decoder layer (``num_experts > 0``), and its losses."""

    num_experts: int = 0
    """Routed experts per layer; 0 keeps the dense MLP (from scratch only)."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_ffn_hidden_size: int | None = None
    """Inner width of each expert's SwiGLU; None takes ``model.ffn_hidden_size``."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of a shared expert every token goes through; 0: none."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Score function of the router (softmax: Mixtral, Qwen; sigmoid: DeepSeek-V3)."""
    capacity_factor: float | None = None
    """None routes every token (dropless: the routing of a token never depends on its batch,
    so rollouts and losses are the same at every layout); a number drops assignments past
    ``ceil(tokens x top_k / num_experts x capacity_factor)`` per expert and rank."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (Switch Transformer) added to the GRPO loss."""
    z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (ST-MoE) added to the GRPO loss."""

    def __post_init__(self) -> None:
        for name, low in (("num_experts", 0), ("top_k", 1), ("shared_expert_ffn_hidden_size", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RLConfigError(f"moe.{name}={value!r} must be an integer >= {low}")
        if self.expert_ffn_hidden_size is not None and self.expert_ffn_hidden_size < 1:
            raise RLConfigError(
                f"moe.expert_ffn_hidden_size={self.expert_ffn_hidden_size} must be >= 1 or None"
            )
        if self.num_experts and self.top_k > self.num_experts:
            raise RLConfigError(
                f"moe.top_k={self.top_k} must not exceed moe.num_experts={self.num_experts}"
            )
        if self.router_score not in ("softmax", "sigmoid"):
            raise RLConfigError(
                f"moe.router_score={self.router_score!r} is unknown, expected one of "
                "('softmax', 'sigmoid')"
            )
        factor = self.capacity_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0.0):
            raise RLConfigError(
                f"moe.capacity_factor={factor} must be a positive finite number or None"
            )
        for name in _LOSS_FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise RLConfigError(f"moe.{name}={value} must be a finite number >= 0")

    @property
    def enabled(self) -> bool:
        """Whether the section makes a from-scratch policy a MoE model (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def has_router_loss(self) -> bool:
        """Whether a router loss is added to the GRPO loss."""
        return self.aux_loss_coeff > 0.0 or self.z_loss_coeff > 0.0

    def shape_fields_set(self) -> list[str]:
        """Fields other than the loss coefficients that differ from their defaults.

        Returns:
            Their names (a Hugging Face checkpoint brings its own expert shape).
        """
        default = MoEModelConfig()
        return [
            f.name
            for f in fields(self)
            if f.name not in _LOSS_FIELDS and getattr(self, f.name) != getattr(default, f.name)
        ]


def as_moe_section(value: Any) -> MoEModelConfig:
    """The section from a :class:`MoEModelConfig` or a dict of its fields (``from_dict``).

    Args:
        value: The section or a dict of field values.

    Returns:
        The section.

    Raises:
        RLConfigError: If a key is not a field, or the value is neither.
    """
    if isinstance(value, MoEModelConfig):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(MoEModelConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RLConfigError(f"{unknown} are not fields of section 'model.moe'")
        return MoEModelConfig(**value)
    raise RLConfigError(f"moe={value!r} must be a MoEModelConfig or a dict of its fields")


def moe_config_for(section: MoEModelConfig) -> MoEConfig | None:
    """The :class:`mcore_models.MoEConfig` of a from-scratch policy (None when dense).

    The router computes no loss itself (both coefficients 0): :mod:`mcore_rl.router_loss`
    adds the section's losses to the GRPO loss with the weight of each packed row.

    Args:
        section: The ``model.moe`` section.

    Returns:
        The model's MoE config, or None for a dense MLP.
    """
    if not section.enabled:
        return None
    return MoEConfig(
        num_experts=section.num_experts,
        top_k=section.top_k,
        expert_ffn_hidden_size=section.expert_ffn_hidden_size,
        shared_expert_ffn_hidden_size=section.shared_expert_ffn_hidden_size,
        router_score=section.router_score,
        capacity_factor=section.capacity_factor,
    )


def _expert_ffn(config: GRPOConfig) -> int | None:
    model = config.model
    return model.moe.expert_ffn_hidden_size or model.ffn_hidden_size


def check_expert_layouts(config: GRPOConfig) -> None:
    """Checks the expert sizes of both layouts against the ``model.moe`` section.

    Args:
        config: The run config.

    Raises:
        RLConfigError: If a layout splits experts of a dense model, ``ep`` does not divide
            ``num_experts``, ``etp`` does not divide the expert FFN width, or a capacity
            factor meets sequence parallelism (drops would depend on the tp split), or router
            losses or a capacity factor meet context parallelism.
    """
    model = config.model
    moe = model.moe
    if model.hf_path is not None:
        shaped = moe.shape_fields_set()
        if shaped:
            raise RLConfigError(
                f"moe.{shaped[0]}={getattr(moe, shaped[0])!r} cannot change the shape of the "
                f"checkpoint hf_path={model.hf_path!r}; only the router loss coefficients apply"
            )
    layouts: list[tuple[str, ParallelConfig]] = [
        ("train_parallel", config.train_parallel),
        ("infer_parallel", config.infer_parallel),
    ]
    for name, layout in layouts:
        splits = layout.ep > 1 or (layout.etp is not None and layout.etp != layout.tp)
        if model.hf_path is None and not moe.enabled and splits:
            raise RLConfigError(
                f"{name}.ep={layout.ep}, {name}.etp={layout.etp} split experts, but the policy "
                "is dense; set model.moe.num_experts > 0"
            )
        if model.hf_path is not None or not moe.enabled:
            continue
        if moe.num_experts % layout.ep:
            raise RLConfigError(
                f"{name}.ep={layout.ep} must divide model.moe.num_experts={moe.num_experts}"
            )
        ffn = _expert_ffn(config)
        etp = layout.expert_tp
        if ffn is not None and ffn % etp:
            raise RLConfigError(
                f"{name}.etp={etp} must divide the expert FFN width {ffn} "
                "(model.moe.expert_ffn_hidden_size or model.ffn_hidden_size)"
            )
    train = config.train_parallel
    if moe.enabled and train.cp > 1 and (moe.has_router_loss or moe.capacity_factor is not None):
        raise RLConfigError(
            f"train_parallel.cp={train.cp} with a MoE router loss or capacity factor "
            f"(aux_loss_coeff={moe.aux_loss_coeff}, z_loss_coeff={moe.z_loss_coeff}, "
            f"capacity_factor={moe.capacity_factor}) would make them depend on each rank's "
            "sequence chunk; expected train_parallel.cp=1, or zero coefficients and dropless "
            "routing"
        )
    if moe.capacity_factor is not None and train.sequence_parallel:
        raise RLConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} with "
            "train_parallel.sequence_parallel=True would drop tokens by each rank's sequence "
            "chunk; use dropless routing (capacity_factor None) or no sequence parallelism"
        )
