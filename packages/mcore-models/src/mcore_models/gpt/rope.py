"""Rotary position embedding (RoPE) with optional Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from mcore_models.gpt.config import RopeScaling

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inverse_frequencies"]


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Compute the ``head_dim // 2`` inverse frequencies of RoPE in float32.

    With ``scaling``, frequencies whose wavelength exceeds the original context are divided by
    ``scaling.factor`` and a band in between is interpolated smoothly, as introduced with
    Llama 3.1 (Meta, "The Llama 3 Herd of Models", 2024).

    Args:
        head_dim: Width of one attention head (even).
        theta: RoPE base.
        scaling: Optional Llama-3 scaling.

    Returns:
        float32 tensor ``[head_dim // 2]``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turn position ids into the cosine and sine tables of RoPE.

    The inverse frequencies are a non-persistent buffer (not in the state dict); the tables are
    computed per call from the positions in float32, so any position (also beyond
    ``max_position_embeddings``) and any packing of sequences works without a cache.

    Args:
        head_dim: Width of one attention head.
        theta: RoPE base.
        scaling: Optional Llama-3 scaling.
        device: Device of the frequency buffer.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self._spec = (head_dim, theta, scaling)
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the frequencies in place (after the module moved off the meta device)."""
        self.inv_freq = rope_inverse_frequencies(*self._spec).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute ``cos`` and ``sin`` of the rotation angles.

        Args:
            position_ids: Integer tensor ``[B, T]``.

        Returns:
            ``(cos, sin)``, each float32 ``[B, T, head_dim // 2]``.
        """
        angles = position_ids.to(torch.float32)[..., None] * self.inv_freq
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head (the Hugging Face "rotate_half" layout).

    Args:
        x: ``[B, T, H, D]`` queries or keys.
        cos: ``[B, T, D // 2]`` float32 cosines.
        sin: ``[B, T, D // 2]`` float32 sines.

    Returns:
        Rotated tensor shaped and typed like ``x``; the products run in the dtype of ``x``
        (like Hugging Face) so that bf16 results match it.
    """
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
