"""Launches of the MoE Triton kernels with less host work per call.

``kernel[grid](...)`` binds the arguments, specialises each one and looks the compiled kernel up
on every call: about 25 us of Python per launch on the GPU hosts, and a training step of the
fused MoE layer launches 14 such kernels (Qwen3-30B-A3B shape). On CUDA tensors :func:`launch`
goes through one :class:`~mcore_kernels._triton_utils.CachedLauncher` per kernel, which keeps
the compiled kernel of each specialisation and launches it directly; the kernels, their
arguments and so their results are the same. Elsewhere (the Triton interpreter on CPU tensors)
and with :data:`CACHED_LAUNCH` off it is ``kernel[grid](...)`` as before.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels._triton_utils import CachedLauncher, next_power_of_2

__all__ = ["CACHED_LAUNCH", "cdiv", "launch", "next_power_of_2"]

CACHED_LAUNCH = True
"""Launch the MoE kernels on CUDA tensors through a :class:`CachedLauncher` (False: through
``kernel[grid](...)`` on every call, the path before; for A/B timings and tests)."""

# By the kernel's id, with the kernel itself to tell a reused id apart.
_LAUNCHERS: dict[int, tuple[Any, CachedLauncher]] = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b`` (``triton.cdiv`` is a constexpr function in Triton
    3.6: a few microseconds of host time per call from Python).

    Args:
        a: Dividend.
        b: Positive divisor.

    Returns:
        The rounded-up quotient.
    """
    return -(-a // b)


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple,
    constexprs: dict[str, Any],
    *,
    device: torch.device,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps[, num_stages=num_stages])``.

    Args:
        kernel: A ``@triton.jit`` kernel whose constexpr parameters follow the others.
        grid: Program counts (one to three).
        args: The runtime arguments in signature order (tensors, ints, floats, host tensor
            descriptors).
        constexprs: Every constexpr argument by name, defaulted ones included.
        device: Device of the tensors; the launch runs on its current stream (the caller
            makes it the current device).
        num_warps: Warps per program (Triton's default is 4).
        num_stages: Software-pipelining depth (None: Triton's default).
    """
    if CACHED_LAUNCH and device.type == "cuda":
        entry = _LAUNCHERS.get(id(kernel))
        if entry is None or entry[0] is not kernel:
            entry = _LAUNCHERS[id(kernel)] = (kernel, CachedLauncher(kernel))
        launcher = entry[1]
        index = device.index if device.index is not None else torch.cuda.current_device()
        launcher(grid, args, constexprs, num_warps, index, num_stages)
        return
    options: dict[str, Any] = {} if num_stages is None else {"num_stages": num_stages}
    kernel[grid](*args, **constexprs, num_warps=num_warps, **options)
