"""Rotary embedding of MLA's decoupled rope channels, with optional YaRN frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from mcore_models.gpt.mla_config import MLAConfig, YarnScaling

__all__ = ["MLARotaryEmbedding", "deinterleave", "yarn_inverse_frequencies"]


def _correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """Dimension whose wavelength makes ``rotations`` turns over ``context`` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inverse_frequencies(dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN "NTK-by-parts" inverse frequencies (arXiv:2309.00071, section 3.2).

    Frequencies that turn more than ``beta_fast`` times over the original context keep their
    value, those that turn fewer than ``beta_slow`` times are divided by ``factor``, and a
    linear ramp over the dimensions in between blends the two.

    Args:
        dim: Rotary channels (even).
        theta: RoPE base.
        yarn: Scaling parameters.

    Returns:
        float32 tensor ``[dim // 2]``.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    extrapolated = 1.0 / theta**exponents
    interpolated = extrapolated / yarn.factor
    context = yarn.original_max_position_embeddings
    low = _correction_dim(yarn.beta_fast, dim, theta, context)
    high = _correction_dim(yarn.beta_slow, dim, theta, context)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # A one-point ramp would divide by zero.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    return interpolated * (1.0 - keep) + extrapolated * keep


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder interleaved rotary pairs ``(x0, x1), (x2, x3) ...`` into two halves.

    After this permutation the pairs rotate like the half-split layout of
    :func:`mcore_models.gpt.rope.apply_rotary`; queries and keys are permuted alike, so their
    products do not change.

    Args:
        x: ``[..., D]`` tensor.

    Returns:
        ``cat(x[..., 0::2], x[..., 1::2])``.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLARotaryEmbedding(nn.Module):
    """Cosine and sine tables of MLA's ``qk_rope_head_dim`` rotary channels.

    With YaRN the tables carry its magnitude correction (``YarnScaling.rotary_magnitude``),
    as in DeepSeek-V3; the matching softmax-scale correction is in
    :attr:`MLAConfig.softmax_scale`.

    Args:
        mla: MLA config.
        theta: RoPE base.
        device: Device of the frequency buffer.
    """

    def __init__(
        self, mla: MLAConfig, theta: float, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self._spec = (mla.qk_rope_head_dim, theta, mla.yarn)
        self.magnitude = mla.yarn.rotary_magnitude if mla.yarn is not None else 1.0
        """Factor applied to both tables."""
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", self._frequencies().to(device), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        dim, theta, yarn = self._spec
        if yarn is None:
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
            return 1.0 / theta**exponents
        return yarn_inverse_frequencies(dim, theta, yarn)

    def reset_buffers(self) -> None:
        """Recompute the frequencies in place (after the module moved off the meta device)."""
        self.inv_freq = self._frequencies().to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute ``cos`` and ``sin`` of the rotation angles.

        Args:
            position_ids: Integer tensor ``[B, T]``.

        Returns:
            ``(cos, sin)``, each float32 ``[B, T, qk_rope_head_dim // 2]``.
        """
        angles = position_ids.to(torch.float32)[..., None] * self.inv_freq
        if self.magnitude == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.magnitude, angles.sin() * self.magnitude
