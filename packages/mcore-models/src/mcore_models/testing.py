"""Shapes of tiny Hugging Face hybrid Mamba checkpoints, for the tests of this package and of
the packages built on it (the machines that run them are offline, so the tests build random
checkpoints with transformers from these keyword arguments)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["TINY_MAMBA2", "TINY_NEMOTRON_H"]

TINY_MAMBA2: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_heads": 8,
        "head_dim": 8,
        "n_groups": 2,
        "state_size": 16,
        "expand": 2,
        "chunk_size": 16,
        "conv_kernel": 4,
    }
)
"""Keyword arguments of a tiny ``transformers.Mamba2Config``: 8 SSD heads of 8 channels in 2
groups, state size 16, chunks of 16 tokens (give ``num_hidden_layers``)."""

TINY_NEMOTRON_H: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 64,
        "hidden_size": 32,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 16,
        "hybrid_override_pattern": "M*M-M",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "chunk_size": 16,
        # A floor below every time step the random weights produce: transformers clamps dt at
        # time_step_min in prefill but not in its decode step; mcore clamps in both.
        "time_step_min": 1e-6,
    }
)
"""Keyword arguments of a tiny ``transformers.NemotronHConfig``: Mamba, attention (4 heads, 2
KV heads), Mamba, MLP and Mamba layers (``hybrid_override_pattern="M*M-M"``) with the Mamba
shape of :data:`TINY_MAMBA2`."""
