"""Named hybrid-model shapes: tiny test models and published Mamba-2 / Nemotron-H shapes.

Published shapes (shapes only, no weights) are taken from:

- Mamba-2 (``state-spaces/mamba2-*``, Dao & Gu 2024): ``d_model`` and ``n_layer`` of each size,
  the Mamba-2 block defaults ``headdim=64``, ``d_state=128``, ``ngroups=1``, ``expand=2``,
  ``d_conv=4`` and the GPT-NeoX vocabulary of 50277 tokens padded to a multiple of 16.
- Nemotron-H 8B (``nvidia/Nemotron-H-8B-Base-8K``): the defaults of transformers'
  ``NemotronHConfig`` (which describe that model) and its 52-layer pattern; Nemotron-H 4B:
  Megatron-Bridge's model documentation (hidden 3072, FFN 12288, 112 Mamba heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_models.errors import ModelConfigError
from mcore_models.mamba.config import HybridConfig

__all__ = ["hybrid_preset", "hybrid_preset_names"]

_NEMOTRON_H_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _mamba2(hidden: int, layers: int) -> dict[str, Any]:
    return {
        "vocab_size": 50288,
        "hidden_size": hidden,
        "layer_pattern": "M" * layers,
        "mamba_num_heads": 2 * hidden // 64,
        "mamba_head_dim": 64,
        "mamba_num_groups": 1,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 256,
        "residual_in_fp32": True,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }


def _nemotron_h(hidden: int, ffn: int, mamba_heads: int) -> dict[str, Any]:
    return {
        "vocab_size": 131072,
        "hidden_size": hidden,
        "layer_pattern": _NEMOTRON_H_52,
        "mamba_num_heads": mamba_heads,
        "mamba_head_dim": 64,
        "mamba_num_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_limit": (0.001, float("inf")),
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "head_dim": 128,
        "ffn_hidden_size": ffn,
        "mlp_activation": "relu2",
        "dtype": "bfloat16",
        "max_position_embeddings": 8192,
    }


_PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny-mamba2": lambda: {
        "vocab_size": 128,
        "hidden_size": 32,
        "layer_pattern": "MMM",
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_num_groups": 2,
        "ssm_state_size": 16,
        "chunk_size": 16,
    },
    "tiny-hybrid": lambda: {
        "vocab_size": 128,
        "hidden_size": 32,
        "layer_pattern": "M*M-",
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_num_groups": 2,
        "ssm_state_size": 16,
        "chunk_size": 16,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 64,
    },
    "mamba2-130m": lambda: _mamba2(768, 24),
    "mamba2-370m": lambda: _mamba2(1024, 48),
    "mamba2-780m": lambda: _mamba2(1536, 48),
    "mamba2-1.3b": lambda: _mamba2(2048, 48),
    "mamba2-2.7b": lambda: _mamba2(2560, 64),
    "nemotron-h-4b": lambda: _nemotron_h(3072, 12288, 112),
    "nemotron-h-8b": lambda: _nemotron_h(4096, 21504, 128),
}


def hybrid_preset_names() -> list[str]:
    """Names accepted by :func:`hybrid_preset`.

    Returns:
        The preset names, sorted.
    """
    return sorted(_PRESETS)


def hybrid_preset(name: str, **overrides: Any) -> HybridConfig:
    """Build the config of a named shape.

    Args:
        name: One of :func:`hybrid_preset_names`.
        **overrides: :class:`HybridConfig` fields to change (e.g. ``dtype``, ``num_layers``
            through ``layer_pattern``).

    Returns:
        The config.

    Raises:
        ModelConfigError: If the name is unknown or an override is invalid.
    """
    if name not in _PRESETS:
        raise ModelConfigError(
            f"name={name!r} is not a preset; expected one of {hybrid_preset_names()}"
        )
    return HybridConfig(**{**_PRESETS[name](), **overrides})
