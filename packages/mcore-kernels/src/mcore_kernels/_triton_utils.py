"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["on_device_of", "round_to", "as_rows"]


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Return a context making ``tensor``'s GPU current (Triton launches on the current device).

    Args:
        tensor: any tensor argument of the launch.

    Returns:
        ``torch.cuda.device(tensor.device)`` for CUDA tensors, else a no-op context.
    """
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` as ``[rows, last_dim]`` with a unit stride along the last dimension.

    Args:
        tensor: any tensor with at least one dimension.

    Returns:
        A view when the layout allows one, else a contiguous copy.
    """
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast float32 ``x`` to ``dtype`` rounding to nearest even.

    bfloat16 is rounded with integer arithmetic because the Triton interpreter truncates in its
    own float32 to bfloat16 conversion; the result is bitwise what the GPU's conversion gives,
    so interpreter tests check the GPU numerics.

    Args:
        x: float32 tensor.
        dtype: destination dtype.

    Returns:
        ``x`` in ``dtype``.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        # NaN payloads in the low half would otherwise round up into infinity.
        rounded = tl.where(x != x, bits | 0x400000, rounded)
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
