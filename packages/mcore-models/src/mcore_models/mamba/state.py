"""What a Mamba layer reads and writes during an inference step (the engine owns the buffers).

The model keeps no state between calls. An inference engine keeps, for every Mamba layer, a
convolution-state tensor ``[slots, conv_dim, K - 1]`` and an SSM-state tensor
``[slots, H, P, N]`` (float32), gives each live request a slot, and passes a
:class:`MambaStepState` to the model's forward with the slots of the requests in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MambaStepState"]


@dataclass(kw_only=True, slots=True)
class MambaStepState:
    """Per-step view of the engine's Mamba state slots.

    The step's tokens are the new tokens of ``S`` requests flattened into one row, request
    ``i`` holding tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``. Each Mamba layer starts every
    request from its slot's states and writes the states after its last token back to the
    slot, so a prompt may arrive in several chunks. A fresh request's slot must hold zeros.
    """

    conv_states: dict[int, torch.Tensor]
    """Global layer index -> ``[slots, conv_dim, K - 1]`` convolution states (this rank's
    channels)."""
    ssm_states: dict[int, torch.Tensor]
    """Global layer index -> ``[slots, H, P, N]`` float32 SSM states (this rank's heads)."""
    cu_seqlens: torch.Tensor
    """``[S + 1]`` int32 token offsets of the requests in the step (on the model's device)."""
    slot_indices: torch.Tensor
    """``[S]`` int64 slot of each request; distinct (padding rows use scratch slots)."""
    decode: bool = False
    """Every request feeds exactly one token (the single-step kernels run)."""
