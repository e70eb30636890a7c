"""Configuration of the GPT (Llama/Qwen family) decoder and its named presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mcore_models.errors import ModelConfigError
from mcore_models.gpt.presets import PRESETS

if TYPE_CHECKING:
    from mcore_models.gpt.mla_config import MLAConfig
    from mcore_models.moe.config import MoEConfig

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_TYPES", "GPTConfig", "RopeScaling"]

ATTENTION_BACKENDS = ("sdpa", "flex", "eager")
"""Names accepted by :attr:`GPTConfig.attention_backend`."""

ATTENTION_TYPES = ("gqa", "mla")
"""Names accepted by :attr:`GPTConfig.attention_type`."""

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(kw_only=True, slots=True, frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3`` in Hugging Face)."""

    factor: float = 8.0
    """Factor by which low frequencies are slowed down."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with before scaling."""

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ModelConfigError(f"RopeScaling.factor={self.factor} must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ModelConfigError(
                f"RopeScaling.low_freq_factor={self.low_freq_factor} and high_freq_factor="
                f"{self.high_freq_factor}: expected 0 < low_freq_factor < high_freq_factor"
            )
        if self.original_max_position_embeddings <= 0:
            raise ModelConfigError(
                "RopeScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be positive"
            )


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape and behaviour of a Llama/Qwen-style decoder-only transformer.

    Build one directly, from a preset with :meth:`from_name`, or from a Hugging Face checkpoint
    through :meth:`mcore_models.GPTModel.from_hf`. Use :func:`dataclasses.replace` (or
    :meth:`replace`) to derive variants.
    """

    vocab_size: int = 256
    """Number of token ids (rows of the embedding and of the output layer)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int | None = None
    """Number of key/value heads (GQA; 1 is MQA). None means one per query head (MHA)."""
    head_dim: int | None = None
    """Width of one attention head. None means ``hidden_size // num_attention_heads``."""
    ffn_hidden_size: int = 128
    """Inner width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 style frequency scaling of RoPE, or None for plain RoPE."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    add_qkv_bias: bool = False
    """Add a bias to the query, key and value projections (Qwen2)."""
    qk_layernorm: bool = False
    """Apply a per-head RMSNorm to queries and keys before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    """Share the output layer weight with the input embedding."""
    max_position_embeddings: int = 4096
    """Largest position the model is meant to see (size of the precomputed RoPE table)."""
    dtype: Any = torch.float32
    """Parameter dtype: a torch.dtype or one of "float32", "bfloat16", "float16"."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    attention_backend: str = "sdpa"
    """Attention implementation: "sdpa" (torch SDPA: flash / memory-efficient), "flex"
    (FlexAttention with document masks) or "eager" (plain torch reference)."""
    perform_initialization: bool = True
    """Randomly initialise weights; turn off when weights will be loaded right after."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass instead of storing its activations."""
    seed: int = 1234
    """Seed of the weight initialisation (the same seed gives the same weights at any TP size)."""
    sequence_parallel: bool = False
    """Under TP > 1, split activations outside attention/MLP along the sequence over the TP
    ranks (Korthikanti et al., 2022); the sequence length must be divisible by the TP size."""
    inference_fuse_tp_communication: bool = False
    """Under TP > 1 and without autograd, replace all-reduce + residual add + RMSNorm after the
    row-parallel projections by one fused reduce-scatter + add + RMSNorm + all-gather
    (``mcore_kernels.comm.fused_rs_add_rmsnorm_ag``). Ignored under sequence parallelism."""
    qk_clip_tracking: bool = False
    """Record the maximum pre-softmax attention logit of every head in each forward pass
    without a KV cache (for :func:`mcore_models.clip_qk`)."""
    batch_invariant: bool = False
    """Batch-invariant numerics (``mcore_kernels.batch_invariant``): GEMMs and attention reduce
    every token in an order that does not depend on the batch, so the inference engine's
    decode and the packed training forward give bitwise-identical log-probs. Slower; see the
    user guide. Not supported with context parallelism."""
    moe: MoEConfig | None = None
    """Mixture-of-experts MLP (a :class:`mcore_models.MoEConfig` or a dict of its fields), or
    None for dense MLPs in every layer."""
    attention_type: str = "gqa"
    """Attention of every layer: "gqa" (multi-head, grouped-query or multi-query attention
    with ``num_query_groups`` key/value heads) or "mla" (Multi-head Latent Attention of
    DeepSeek-V3 / Kimi K2, shaped by ``mla``)."""
    mla: MLAConfig | None = None
    """Shapes of Multi-head Latent Attention (a :class:`mcore_models.MLAConfig` or a dict of
    its fields) when ``attention_type="mla"`` (None there means DeepSeek-V3's shapes); must be
    None otherwise. ``rope_theta`` is its RoPE base, ``head_dim``/``num_query_groups``/
    ``rope_scaling``/``add_qkv_bias``/``qk_layernorm`` do not apply to it."""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise ModelConfigError(
                    f"dtype={self.dtype!r} is not supported; expected one of {sorted(_DTYPES)}"
                )
            self.dtype = _DTYPES[self.dtype]
        if self.dtype not in _DTYPES.values():
            raise ModelConfigError(
                f"dtype={self.dtype!r} is not supported; expected float32, bfloat16 or float16"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "ffn_hidden_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}={value!r} must be a positive int")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        for name in ("num_query_groups", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ModelConfigError(f"{name}={value!r} must be an int")
        if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups:
            raise ModelConfigError(
                f"num_query_groups={self.num_query_groups} must be positive and divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be a positive even number")
        if not isinstance(self.batch_invariant, bool):
            raise ModelConfigError(f"batch_invariant={self.batch_invariant!r} must be a bool")
        if self.rope_theta <= 0:
            raise ModelConfigError(f"rope_theta={self.rope_theta} must be positive")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ModelConfigError(
                f"rope_scaling={self.rope_scaling!r} must be a RopeScaling, a dict or None"
            )
        if self.norm_eps <= 0:
            raise ModelConfigError(f"norm_eps={self.norm_eps} must be positive")
        if not (self.init_std > 0 and math.isfinite(self.init_std)):
            raise ModelConfigError(f"init_std={self.init_std} must be a positive finite float")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ModelConfigError(
                f"attention_backend={self.attention_backend!r} is unknown; expected one of "
                f"{ATTENTION_BACKENDS}"
            )
        if self.moe is not None:
            # Imported here: mcore_models.moe builds on this module.
            from mcore_models.moe.config import MoEConfig

            if isinstance(self.moe, dict):
                self.moe = MoEConfig(**self.moe)
            if not isinstance(self.moe, MoEConfig):
                raise ModelConfigError(f"moe={self.moe!r} must be a MoEConfig, a dict or None")
        self._check_mla()

    def _check_mla(self) -> None:
        if self.attention_type not in ATTENTION_TYPES:
            raise ModelConfigError(
                f"attention_type={self.attention_type!r} is unknown; expected one of "
                f"{ATTENTION_TYPES}"
            )
        if self.attention_type != "mla":
            if self.mla is not None:
                raise ModelConfigError(
                    f"mla={self.mla!r} is set but attention_type={self.attention_type!r}; "
                    "expected attention_type='mla' or mla=None"
                )
            return
        # Imported here: the MLA config is only needed for MLA models.
        from mcore_models.gpt.mla_config import MLAConfig

        if self.mla is None:
            self.mla = MLAConfig()
        elif isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if not isinstance(self.mla, MLAConfig):
            raise ModelConfigError(f"mla={self.mla!r} must be an MLAConfig, a dict or None")
        unsupported = [
            name
            for name, value in (
                ("rope_scaling", self.rope_scaling),
                ("add_qkv_bias", self.add_qkv_bias),
                ("qk_layernorm", self.qk_layernorm),
            )
            if value
        ]
        if unsupported or self.num_kv_heads != self.num_attention_heads:
            raise ModelConfigError(
                f"attention_type='mla' does not take {unsupported or ['num_query_groups']}: "
                "expected rope_scaling=None (use MLAConfig.yarn), add_qkv_bias=False, "
                "qk_layernorm=False and num_query_groups=None"
            )

    @property
    def kv_channels(self) -> int:
        """Width of one attention head (``head_dim`` after defaults are resolved)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads (``num_query_groups`` after defaults are resolved)."""
        assert self.num_query_groups is not None
        return self.num_query_groups

    def replace(self, **changes: Any) -> GPTConfig:
        """Return a copy with some fields changed (validated again).

        Derived defaults follow the change: when ``hidden_size`` or ``num_attention_heads``
        changes, a ``head_dim`` that equalled ``hidden_size // num_attention_heads`` is derived
        again, and a ``num_query_groups`` that equalled ``num_attention_heads`` (plain
        multi-head attention) follows the new head count, unless those fields are changed too.

        Args:
            **changes: Field names and their new values.

        Returns:
            The new config.

        Raises:
            ModelConfigError: If a changed value is invalid.
        """
        if "hidden_size" in changes or "num_attention_heads" in changes:
            if "head_dim" not in changes and (
                self.kv_channels == self.hidden_size // self.num_attention_heads
            ):
                changes["head_dim"] = None
            if "num_query_groups" not in changes and self.num_kv_heads == self.num_attention_heads:
                changes["num_query_groups"] = None
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        """Count the parameters of the model this config describes (embeddings included).

        Returns:
            The number of parameters.
        """
        hidden, heads, groups, dim = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_kv_heads,
            self.kv_channels,
        )
        attention = hidden * dim * (2 * heads + 2 * groups)
        if self.add_qkv_bias:
            attention += dim * (heads + 2 * groups)
        if self.qk_layernorm:
            attention += 2 * dim
        if self.mla is not None:
            attention = self.mla.attention_parameters(hidden, heads)
        layers = sum(
            attention + 2 * hidden + self._mlp_parameters(i, active=False)
            for i in range(self.num_layers)
        )
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings + hidden

    def _mlp_parameters(self, layer_idx: int, *, active: bool) -> int:
        """Parameters of one layer's MLP: all of them, or those one token uses (``active``)."""
        if self.moe is None or not self.moe.is_moe_layer(layer_idx):
            return 3 * self.hidden_size * self.ffn_hidden_size
        return self.moe.mlp_parameters(self.hidden_size, self.ffn_hidden_size, active=active)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at sequence length ``seq_len``.

        Uses the PaLM accounting (Chowdhery et al., 2022, appendix B): 6 FLOPs per matmul
        parameter (the output layer included, the embedding lookup not; for MoE layers the
        parameters one token uses: router, ``top_k`` experts, shared expert) plus
        ``12 * layers * heads * head_dim * seq_len`` for the attention products, without
        discounting the causal mask, so that figures compare with published MFU numbers.

        Args:
            seq_len: Length of each sequence.

        Returns:
            FLOPs per token.
        """
        hidden, heads, groups, dim = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_kv_heads,
            self.kv_channels,
        )
        attention = hidden * dim * (2 * heads + 2 * groups)
        if self.mla is not None:
            # Norm weights are not matmul parameters; the products use the mean head width.
            mla = self.mla
            attention = mla.attention_parameters(hidden, heads) - mla.kv_lora_rank
            attention -= mla.q_lora_rank or 0
            dim = (mla.qk_head_dim + mla.v_head_dim) // 2
        matmul_params = self.vocab_size * hidden + sum(
            attention + self._mlp_parameters(i, active=True) for i in range(self.num_layers)
        )
        return 6.0 * matmul_params + 12.0 * self.num_layers * heads * dim * seq_len

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """Build a named preset.

        Args:
            name: One of :func:`preset_names` ("tiny", "llama-3.2-1b", "llama-3-8b",
                "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b",
                "tiny-mla", "tiny-mla-moe", "deepseek-v3", "kimi-k2").
            **overrides: Fields to change in the preset.

        Returns:
            The config.

        Raises:
            ModelConfigError: If the name is unknown or an override is invalid.
        """
        key = name.lower()
        if key not in PRESETS:
            raise ModelConfigError(
                f"name={name!r} is not a preset; expected one of {sorted(PRESETS)}"
            )
        fields = PRESETS[key]()
        fields.update(overrides)
        return cls(**fields)
