"""Blocks of a hybrid model: one pre-norm residual block per pattern character."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_kernels import RMSNorm
from mcore_models.gpt.attention_backends import AttentionMask
from mcore_models.gpt.kv_cache import KVCache
from mcore_models.gpt.layer import Attention
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.mamba.config import HybridConfig
from mcore_models.mamba.mixer import Mamba2Mixer
from mcore_models.mamba.state import MambaStepState
from mcore_models.moe.layer import MoELayer

__all__ = ["HybridLayer", "SquaredReLUMLP"]


class SquaredReLUMLP(nn.Module):
    """``down(relu(up(x)) ** 2)``, the dense MLP of Nemotron-H (So et al., 2021, Primer).

    Args:
        config: Model config (hidden and FFN sizes, dtype).
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        hidden, ffn, dtype = config.hidden_size, config.ffn_hidden_size, config.dtype
        self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP.

        Args:
            x: ``[..., hidden]`` normalised hidden states.

        Returns:
            ``[..., hidden]`` output.
        """
        return self.down_proj(F.relu(self.up_proj(x)).square())


class HybridLayer(nn.Module):
    """``h + mixer(norm(h))`` with the mixer chosen by the layer's pattern character.

    The attention mixer is :class:`mcore_models.gpt.layer.Attention` (grouped-query, through
    the caller's KV cache in inference) fed with identity rotations, since Nemotron-H's
    attention has no positional embedding; the MoE mixer is :class:`mcore_models.MoELayer`.

    Args:
        config: Model config.
        layer_idx: Global index of the layer.
    """

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = config.layer_kinds[layer_idx]
        """``"mamba"``, ``"attention"``, ``"mlp"`` or ``"moe"``."""
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=config.dtype)
        mixer: nn.Module
        if self.kind == "mamba":
            mixer = Mamba2Mixer(config, layer_idx)
        elif self.kind == "attention":
            mixer = Attention(config.attention_config(), layer_idx)
        elif self.kind == "moe":
            mixer = MoELayer(config.attention_config(), layer_idx)
        elif config.mlp_activation == "swiglu":
            mixer = SwiGLUMLP(config.attention_config())
        else:
            mixer = SquaredReLUMLP(config)
        self.mixer = mixer

    @property
    def self_attention(self) -> nn.Module | None:
        """The attention mixer of an attention layer (None otherwise), as GPT layers name it."""
        return self.mixer if self.kind == "attention" else None

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | None,
        kv_cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        mamba_state: MambaStepState | None = None,
    ) -> torch.Tensor:
        """Run the block.

        Args:
            hidden: ``[B, T, hidden]`` residual stream.
            cos: Rotation cosines of attention layers (ones: no positional embedding).
            sin: Rotation sines (zeros).
            mask: Attention mask of a forward without KV cache.
            kv_cache: Caller-owned KV cache, or None.
            cu_seqlens: Packed-sequence boundaries for Mamba layers (B = 1), or None.
            mamba_state: Inference state slots of Mamba layers, or None.

        Returns:
            The residual stream after the block.
        """
        normed = self.norm(hidden.to(self.norm.weight.dtype))
        if self.kind == "mamba":
            out = self.mixer(normed, cu_seqlens=cu_seqlens, state=mamba_state)
        elif self.kind == "attention":
            out = self.mixer(normed, cos, sin, mask, kv_cache)
        else:
            out = self.mixer(normed)
        residual = hidden.float() if self.residual_in_fp32 else hidden
        return residual + out
