"""The feed-forward block of a decoder layer and the factory every layer builds it through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.gpt.config import GPTConfig

__all__ = ["SwiGLUMLP", "build_mlp"]


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, the MLP of Llama and Qwen (Shazeer, 2020).

    Args:
        config: Model config (hidden and FFN sizes, dtype).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden, ffn, dtype = config.hidden_size, config.ffn_hidden_size, config.dtype
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP.

        Args:
            x: ``[..., hidden]`` normalised hidden states.

        Returns:
            ``[..., hidden]`` output (a partial sum when ``down_proj`` is a row-parallel layer
            that skips its reduction).
        """
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_mlp(config: GPTConfig, layer_idx: int) -> nn.Module:
    """Build the MLP of one decoder layer.

    This is the single place where a layer's MLP type is chosen, so that other block types
    (such as mixture-of-experts) plug in here without touching the decoder layer.

    Args:
        config: Model config.
        layer_idx: Index of the decoder layer (0-based).

    Returns:
        A module mapping ``[..., hidden]`` to ``[..., hidden]``.
    """
    del layer_idx  # every layer is dense today; MoE configs will choose per layer
    return SwiGLUMLP(config)
