"""Depthwise causal 1-D convolution of Mamba layers over packed sequences (torch).

Each channel is convolved with its own ``K``-tap filter over the current and the ``K - 1``
previous tokens of the same sequence. Before a sequence's first token the taps read the
sequence's initial convolution state (the last ``K - 1`` inputs of an earlier chunk of the same
request, zeros for a fresh one), so a prompt prefilled in several chunks gives the same outputs
as in one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_kernels.errors import KernelShapeError, KernelValueError
from mcore_kernels.ssd._checks import default_cu_seqlens

__all__ = ["causal_conv1d", "causal_conv1d_update"]


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation == "silu":
        return F.silu(x)
    raise KernelValueError(f"activation={activation!r} is not supported; expected 'silu' or None")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of packed sequences.

    Args:
        x: ``[T, channels]`` inputs of all packed tokens.
        weight: ``[channels, K]`` filters.
        bias: ``[channels]`` or None.
        cu_seqlens: ``[S + 1]`` sequence starts (default: one sequence).
        initial_states: ``[S, channels, K - 1]`` inputs preceding each sequence (default 0).
        activation: ``"silu"`` or None.

    Returns:
        ``(y, final_states)``: ``y`` ``[T, channels]`` in ``x.dtype``, and each sequence's last
        ``K - 1`` inputs ``[S, channels, K - 1]`` (its state for a following chunk).

    Raises:
        KernelShapeError: A shape does not match.
        KernelValueError: The activation is unknown.
    """
    tokens, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise KernelShapeError(
            f"weight.shape={tuple(weight.shape)} must be [channels={channels}, kernel]"
        )
    taps = weight.shape[1]
    if cu_seqlens is None:
        cu_seqlens = default_cu_seqlens(tokens, x.device)
    cu = cu_seqlens.long()
    num_seqs = cu.numel() - 1
    if initial_states is None:
        initial_states = x.new_zeros((num_seqs, channels, taps - 1))
    elif tuple(initial_states.shape) != (num_seqs, channels, taps - 1):
        raise KernelShapeError(
            f"initial_states.shape={tuple(initial_states.shape)} does not match "
            f"{(num_seqs, channels, taps - 1)}"
        )
    positions = torch.arange(tokens, device=x.device)
    # Sequence of each token: the starts <= its position, less one. (Searching the whole
    # ``cu`` rather than its slice ``cu[1:]``, which Inductor of torch 2.11 could not lower
    # on CUDA: ``NotImplementedError: SliceView`` in ``searchsorted``.)
    seq_of = (torch.searchsorted(cu, positions, right=True) - 1).clamp(0, max(num_seqs - 1, 0))
    offset = positions - cu[seq_of]
    history = initial_states.to(x.dtype).transpose(1, 2)  # [S, K - 1, channels]
    out = x.new_zeros((tokens, channels), dtype=torch.float32)
    for tap in range(taps):
        shift = taps - 1 - tap
        inside = offset >= shift
        from_x = x[(positions - shift).clamp(min=0)]
        from_history = history[seq_of, (taps - 1 - shift + offset).clamp(0, taps - 2)]
        value = torch.where(inside[:, None], from_x, from_history) if shift else x
        out = out + value.float() * weight[:, tap].float()
    if bias is not None:
        out = out + bias.float()
    lengths = cu[1:] - cu[:-1]
    back = torch.arange(taps - 1, device=x.device) - (taps - 1)  # -(K-1) .. -1
    index = lengths[:, None] + back[None, :]  # position inside the sequence
    from_x = x[(cu[:-1, None] + index).clamp(0, max(tokens - 1, 0))]
    from_history = history[
        torch.arange(num_seqs, device=x.device)[:, None], (taps - 1 + index).clamp(0, taps - 2)
    ]
    finals = torch.where((index >= 0)[..., None], from_x, from_history).transpose(1, 2)
    return _activate(out, activation).to(x.dtype), finals.contiguous()


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    state_indices: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of the causal convolution, shifting the state slots in place.

    Args:
        x: ``[Bt, channels]`` the new token of each request.
        conv_state: ``[num_slots, channels, K - 1]`` previous inputs per slot, updated in place.
        weight: ``[channels, K]`` filters.
        bias: ``[channels]`` or None.
        state_indices: ``[Bt]`` distinct slot per request (default ``0 .. Bt - 1``); padding
            rows of a CUDA-graph bucket point at a scratch slot of their own.
        activation: ``"silu"`` or None.

    Returns:
        ``[Bt, channels]`` outputs in ``x.dtype``.

    Raises:
        KernelShapeError: A shape does not match.
    """
    batch, channels = x.shape
    taps = weight.shape[1]
    if tuple(conv_state.shape[1:]) != (channels, taps - 1):
        raise KernelShapeError(
            f"conv_state.shape={tuple(conv_state.shape)} does not match [slots, {channels}, "
            f"{taps - 1}]"
        )
    if state_indices is None:
        state_indices = torch.arange(batch, device=x.device)
    slots = state_indices.long()
    window = torch.cat([conv_state[slots].to(x.dtype), x[:, :, None]], dim=2)
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return _activate(out, activation).to(x.dtype)
