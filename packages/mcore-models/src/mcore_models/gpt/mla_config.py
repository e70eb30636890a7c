"""Configuration of Multi-head Latent Attention (MLA) and of its YaRN rotary scaling.

MLA (DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, section 2.1) compresses keys and values of
every token into one latent vector ``c_kv`` of ``kv_lora_rank`` channels plus one rotary key of
``qk_rope_head_dim`` channels shared by all heads; per-head keys (without position) and values
are up-projections of ``c_kv``. Queries are optionally low-rank too (``q_lora_rank``). Set
``GPTConfig(attention_type="mla", mla=MLAConfig(...))`` to use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_models.errors import ModelConfigError

__all__ = ["MLAConfig", "YarnScaling", "yarn_mscale"]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``).

    Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models"
    (arXiv:2309.00071, section 3.4), with the ``mscale`` multiplier of DeepSeek-V2/V3 configs.

    Args:
        factor: Context extension factor.
        mscale: Multiplier of the logarithm.

    Returns:
        The magnitude correction.
    """
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(kw_only=True, slots=True, frozen=True)
class YarnScaling:
    """YaRN RoPE scaling as written in DeepSeek-V3 / Kimi-K2 configs (``rope_type: yarn``)."""

    factor: float = 40.0
    """Context extension factor (ratio of the new to the original context)."""
    original_max_position_embeddings: int = 4096
    """Context length of pre-training, before extension."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations over the original context below which a frequency is divided by ``factor``."""
    mscale: float = 1.0
    """Multiplier of ``ln(factor)`` in the magnitude correction of the rotary tables."""
    mscale_all_dim: float = 0.0
    """Multiplier of ``ln(factor)`` of the correction of every dimension: the rotary tables are
    divided by it and the softmax scale multiplied by its square; 0 turns that off."""
    truncate: bool = True
    """Round the correction range outwards to whole dimensions (Hugging Face's default)."""

    def __post_init__(self) -> None:
        if not (self.factor >= 1.0 and math.isfinite(self.factor)):
            raise ModelConfigError(f"YarnScaling.factor={self.factor} must be a finite float >= 1")
        if self.original_max_position_embeddings <= 0:
            raise ModelConfigError(
                "YarnScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be positive"
            )
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ModelConfigError(
                f"YarnScaling.beta_slow={self.beta_slow} and beta_fast={self.beta_fast}: expected "
                "0 < beta_slow <= beta_fast"
            )
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ModelConfigError(f"YarnScaling.{name}={value} must be a finite float >= 0")

    @property
    def rotary_magnitude(self) -> float:
        """Factor applied to the cosine and sine tables (Hugging Face's ``attention_factor``)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_correction(self) -> float:
        """Factor applied to the softmax scale: ``yarn_mscale(factor, mscale_all_dim) ** 2``."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(kw_only=True, slots=True)
class MLAConfig:
    """Shapes of Multi-head Latent Attention (defaults: DeepSeek-V3's)."""

    q_lora_rank: int | None = 1536
    """Rank of the low-rank query projection; None projects queries at full rank."""
    kv_lora_rank: int = 512
    """Channels of the compressed key/value latent ``c_kv`` (what the KV cache stores)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without position (up-projected from ``c_kv``)."""
    qk_rope_head_dim: int = 64
    """Rotary channels: per head for queries, one key shared by all heads."""
    v_head_dim: int = 128
    """Per-head value channels."""
    rope_interleave: bool = True
    """Rotary channels come in interleaved pairs ``(x0, x1), (x2, x3) ...`` (DeepSeek's weight
    layout; Hugging Face's ``rope_interleave``); False rotates the two halves."""
    yarn: YarnScaling | None = None
    """YaRN rotary scaling with its softmax correction, or None for plain RoPE."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"MLAConfig.{name}={value!r} must be a positive int")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even"
            )
        if self.q_lora_rank is not None and (
            isinstance(self.q_lora_rank, bool)
            or not isinstance(self.q_lora_rank, int)
            or self.q_lora_rank <= 0
        ):
            raise ModelConfigError(
                f"MLAConfig.q_lora_rank={self.q_lora_rank!r} must be a positive int or None"
            )
        if isinstance(self.yarn, dict):
            self.yarn = YarnScaling(**self.yarn)
        if self.yarn is not None and not isinstance(self.yarn, YarnScaling):
            raise ModelConfigError(
                f"MLAConfig.yarn={self.yarn!r} must be a YarnScaling, a dict or None"
            )

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key channels: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """Multiplier of the query-key products: ``qk_head_dim ** -0.5`` times the YaRN
        correction."""
        correction = self.yarn.softmax_correction if self.yarn is not None else 1.0
        return self.qk_head_dim**-0.5 * correction

    @property
    def latent_dim(self) -> int:
        """Channels cached per token and layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_parameters(self, hidden_size: int, num_heads: int) -> int:
        """Parameters of one MLA block (projections and the two latent norms).

        Args:
            hidden_size: Width of the residual stream.
            num_heads: Number of attention heads.

        Returns:
            The number of parameters.
        """
        heads_qk = num_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            query = hidden_size * heads_qk
        else:
            query = hidden_size * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads_qk
        kv_down = hidden_size * self.latent_dim + self.kv_lora_rank
        kv_up = self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        output = num_heads * self.v_head_dim * hidden_size
        return query + kv_down + kv_up + output
