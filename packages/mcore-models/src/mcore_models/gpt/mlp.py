"""The dense feed-forward block of a decoder layer (SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.fused_ops import swiglu_activation

__all__ = ["SwiGLUMLP"]


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
        activation = swiglu_activation(self.gate_proj(x), self.up_proj(x))
        if reduce_output:
            return self.down_proj(activation)
        return F.linear(activation, self.down_proj.weight)
