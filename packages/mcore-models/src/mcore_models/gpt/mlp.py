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

    supports_partial_output = True
    """``forward(x, reduce_output=False)`` returns the unreduced row-parallel partial sum."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden, ffn, dtype = config.hidden_size, config.ffn_hidden_size, config.dtype
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, *, reduce_output: bool = True) -> torch.Tensor:
        """Apply the MLP.

        Args:
            x: ``[..., hidden]`` normalised hidden states.
            reduce_output: With a row-parallel ``down_proj``, False returns this rank's
                partial sum instead of the reduced output (for a fused reduction downstream).

        Returns:
            ``[..., hidden]`` output, or this rank's partial sum.
        """
        activation = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if reduce_output:
            return self.down_proj(activation)
        return F.linear(activation, self.down_proj.weight)


def build_mlp(config: GPTConfig, layer_idx: int) -> nn.Module:
    """Build the MLP of one decoder layer.

    This is the single place where a layer's MLP type is chosen, so that other block types
    (such as mixture-of-experts) plug in here without touching the decoder layer. A block may
    accept ``forward(x, *, reduce_output=False)`` returning a tensor-parallel partial sum; the
    decoder layer only asks that of blocks whose ``supports_partial_output`` is True.

    Args:
        config: Model config.
        layer_idx: Index of the decoder layer (0-based).

    Returns:
        A module mapping ``[..., hidden]`` to ``[..., hidden]``: a
        :class:`~mcore_models.moe.layer.MoELayer` where ``config.moe`` makes the layer a MoE
        layer, else a :class:`SwiGLUMLP`.
    """
    if config.moe is not None and config.moe.is_moe_layer(layer_idx):
        # Imported here: mcore_models.moe builds on this module.
        from mcore_models.moe.layer import MoELayer

        return MoELayer(config, layer_idx)
    return SwiGLUMLP(config)
