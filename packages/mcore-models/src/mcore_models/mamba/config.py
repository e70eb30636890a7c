"""Config of hybrid Mamba-2 / attention / MLP / MoE models and its layer-pattern notation.

A hybrid model is a stack of pre-norm residual blocks, each holding ONE mixer: a Mamba-2 layer,
self-attention, an MLP or a mixture of experts, as in Nemotron-H (NVIDIA, 2025) and Mamba-2
(Dao & Gu, 2024). The stack is written as a pattern string, one character per layer:

========  ======================================================================
``M``     Mamba-2 mixer (in_proj, depthwise causal conv1d, SSD scan, gated RMSNorm, out_proj)
``*``     grouped-query self-attention without positional embedding (Nemotron-H)
``-``     dense MLP (``mlp_activation``: squared ReLU as Nemotron-H, or SwiGLU)
``E``     mixture of experts (:class:`mcore_models.MoEConfig`)
========  ======================================================================

This is the notation of Nemotron-H's ``hybrid_override_pattern``, so a published pattern is
copied verbatim; a pure Mamba-2 model is ``"M" * num_layers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.config import GPTConfig

__all__ = ["LAYER_KINDS", "HybridConfig"]

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
"""Pattern character -> layer kind."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True)
class HybridConfig:
    """Shape and options of a hybrid Mamba-2 model (see the module docstring for the pattern)."""

    vocab_size: int = 256
    """Vocabulary size."""
    hidden_size: int = 64
    """Width of the residual stream."""
    layer_pattern: str = "M*M-"
    """One character per layer: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE."""
    mamba_num_heads: int = 8
    """SSM heads of a Mamba layer."""
    mamba_head_dim: int = 16
    """Channels per SSM head (``P``)."""
    mamba_num_groups: int = 2
    """Groups sharing one ``B``/``C`` projection (``G``; divides ``mamba_num_heads``)."""
    ssm_state_size: int = 16
    """State size per channel (``N``)."""
    conv_kernel: int = 4
    """Taps of the depthwise causal convolution."""
    chunk_size: int = 64
    """Tokens per chunk of the SSD scan (power of two >= 16); numerics only, not the model."""
    use_conv_bias: bool = True
    """Whether the convolution has a bias."""
    mamba_proj_bias: bool = False
    """Whether in_proj and out_proj of a Mamba layer have biases."""
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    """Clamp of the time step after softplus (Nemotron-H: ``(time_step_min, inf)``)."""
    time_step_min: float = 0.001
    """Smallest time step of the initialisation of ``dt_bias``."""
    time_step_max: float = 0.1
    """Largest time step of the initialisation of ``dt_bias``."""
    time_step_floor: float = 1e-4
    """Floor of the initial time steps."""
    num_attention_heads: int = 4
    """Query heads of an attention layer."""
    num_query_groups: int | None = None
    """Key/value heads of an attention layer (default: ``num_attention_heads``)."""
    head_dim: int | None = None
    """Width of an attention head (default ``hidden_size // num_attention_heads``)."""
    ffn_hidden_size: int = 128
    """Hidden width of a dense MLP layer."""
    mlp_activation: str = "relu2"
    """``"relu2"`` (``down(relu(up(x))**2)``, Nemotron-H) or ``"swiglu"``."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (also the gated norm of Mamba layers)."""
    tie_word_embeddings: bool = False
    """Whether the output layer shares the embedding weight."""
    residual_in_fp32: bool = False
    """Keep the residual stream in float32 (the Mamba-2 reference models do)."""
    dtype: Any = torch.float32
    """Parameter dtype (``torch.float32``, ``torch.bfloat16``, ``torch.float16`` or a name)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    attention_backend: str = "sdpa"
    """Attention backend of attention layers (see :class:`mcore_models.GPTConfig`)."""
    seed: int = 1234
    """Seed of the initialisation."""
    moe: Any = None
    """:class:`mcore_models.MoEConfig` of the ``E`` layers (required when the pattern has one)."""
    max_position_embeddings: int = 4096
    """Longest sequence the engine plans for (the model has no positional embedding)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields of the source checkpoint's config kept for a faithful export (informational)."""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise ModelConfigError(
                    f"dtype={self.dtype!r} is not supported; expected one of {sorted(_DTYPES)}"
                )
            self.dtype = _DTYPES[self.dtype]
        if self.dtype not in _DTYPES.values():
            raise ModelConfigError(f"dtype={self.dtype!r} is not float32, bfloat16 or float16")
        if not self.layer_pattern or any(c not in LAYER_KINDS for c in self.layer_pattern):
            raise ModelConfigError(
                f"layer_pattern={self.layer_pattern!r} must be a non-empty string of "
                f"{''.join(LAYER_KINDS)} (M: Mamba-2, *: attention, -: MLP, E: MoE)"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "mamba_num_heads",
            "mamba_head_dim",
            "mamba_num_groups",
            "ssm_state_size",
            "conv_kernel",
            "num_attention_heads",
            "ffn_hidden_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}={value!r} must be a positive int")
        if self.conv_kernel < 2:
            raise ModelConfigError(f"conv_kernel={self.conv_kernel} must be at least 2")
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ModelConfigError(
                f"mamba_num_groups={self.mamba_num_groups} must divide mamba_num_heads="
                f"{self.mamba_num_heads}"
            )
        if self.chunk_size < 16 or self.chunk_size & (self.chunk_size - 1):
            raise ModelConfigError(f"chunk_size={self.chunk_size} must be a power of two >= 16")
        low, high = self.time_step_limit
        self.time_step_limit = (float(low), float(high))
        if not 0 <= low < high:
            raise ModelConfigError(
                f"time_step_limit={self.time_step_limit} must satisfy 0 <= low < high"
            )
        if self.mlp_activation not in ("relu2", "swiglu"):
            raise ModelConfigError(
                f"mlp_activation={self.mlp_activation!r} must be 'relu2' or 'swiglu'"
            )
        if self.norm_eps <= 0:
            raise ModelConfigError(f"norm_eps={self.norm_eps} must be positive")
        if "E" in self.layer_pattern and self.moe is None:
            raise ModelConfigError(
                f"layer_pattern={self.layer_pattern!r} has MoE layers (E) but moe is None"
            )
        # Validates the attention fields (heads, groups, head_dim, backend) once.
        self.attention_config()

    @property
    def num_layers(self) -> int:
        """Number of layers (the pattern's length)."""
        return len(self.layer_pattern)

    @property
    def layer_kinds(self) -> list[str]:
        """Kind of every layer: ``"mamba"``, ``"attention"``, ``"mlp"`` or ``"moe"``."""
        return [LAYER_KINDS[c] for c in self.layer_pattern]

    @property
    def mamba_layer_indices(self) -> list[int]:
        """Indices of the Mamba-2 layers."""
        return [i for i, c in enumerate(self.layer_pattern) if c == "M"]

    @property
    def attention_layer_indices(self) -> list[int]:
        """Indices of the attention layers."""
        return [i for i, c in enumerate(self.layer_pattern) if c == "*"]

    @property
    def mamba_inner_size(self) -> int:
        """Width of a Mamba layer's SSM input (``heads * head_dim``)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution (x, B and C)."""
        return self.mamba_inner_size + 2 * self.mamba_num_groups * self.ssm_state_size

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads of an attention layer (for the engine's KV cache)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of an attention head (for the engine's KV cache)."""
        return self.attention_config().kv_channels

    def attention_config(self) -> GPTConfig:
        """The :class:`GPTConfig` the reused attention, MLP and MoE blocks are built from.

        Returns:
            A config with this model's widths, attention fields, MoE and dtype.

        Raises:
            ModelConfigError: If the attention fields are invalid.
        """
        return GPTConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            head_dim=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            norm_eps=self.norm_eps,
            dtype=self.dtype,
            init_std=self.init_std,
            attention_backend=self.attention_backend,
            max_position_embeddings=self.max_position_embeddings,
            seed=self.seed,
            moe=self.moe,
        )
