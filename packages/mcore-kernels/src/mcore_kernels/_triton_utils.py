"""Helpers shared by the Triton kernels: the optional import, devices, layouts, rounding.

Triton is a Linux-only dependency. The kernel modules define their kernels with :func:`jit`,
which is ``triton.jit`` where Triton is installed and leaves the function a plain (never called)
Python function elsewhere, so the package imports everywhere and the torch references run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a linux-only dependency
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = [
    "as_rows",
    "device_limits",
    "jit",
    "next_power_of_2",
    "on_device_of",
    "round_to",
    "tl",
    "triton",
]

_SAME_DEVICE = contextlib.nullcontext()


def jit(fn: Callable[..., Any]) -> Any:
    """Compile ``fn`` with ``triton.jit`` when Triton is installed, else return it unchanged.

    Args:
        fn: the kernel function.

    Returns:
        The Triton ``JITFunction``, or ``fn`` where Triton is missing.
    """
    return triton.jit(fn) if triton is not None else fn


def next_power_of_2(n: int) -> int:
    """Return the smallest power of two ``>= n`` (1 for ``n <= 1``).

    Args:
        n: a non-negative int.

    Returns:
        The power of two.
    """
    return 1 << max(n - 1, 0).bit_length()


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Return a context making ``tensor``'s GPU current (Triton launches on the current device).

    Args:
        tensor: any tensor argument of the launch.

    Returns:
        ``torch.cuda.device(tensor.device)`` for a CUDA tensor on another GPU than the current
        one, else a shared no-op context (the common case costs no device switch).
    """
    if tensor.is_cuda and tensor.get_device() != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return _SAME_DEVICE


@functools.cache
def device_limits(device: torch.device) -> tuple[int, int]:
    """Return ``(multiprocessors, shared memory bytes per block)`` of a device, cached.

    Args:
        device: a CUDA device, or the CPU (the interpreter: 4 "multiprocessors").

    Returns:
        The multiprocessor count and the opt-in shared-memory limit of one block.
    """
    if device.type != "cuda":
        return 4, 228 * 1024
    props = torch.cuda.get_device_properties(device)
    # torch < 2.5 lacks the opt-in limit; 48 KiB is what every CUDA GPU grants a block.
    return props.multi_processor_count, int(
        getattr(props, "shared_memory_per_block_optin", 48 * 1024)
    )


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` as ``[rows, last_dim]`` with a unit stride along the last dimension.

    Args:
        tensor: any tensor with at least one dimension.

    Returns:
        A view when the layout allows one, else a contiguous copy.
    """
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


@jit
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
