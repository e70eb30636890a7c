"""Warm the L2 cache with tensors a later kernel will read (a hint; no values change).

At decode over a few dozen rows the projections of a layer are latency-bound: cuBLAS streams a
q/k/v weight of 2 MB in 4-5 us, a tenth of the memory bandwidth, because each program's loads
wait for DRAM in a short chain. The DRAM sits mostly idle meanwhile. :func:`l2_prefetch`
requests every 128-byte line of up to two tensors into L2 (``prefetch.global.L2``: no data
returns to the program, so a few programs keep many lines in flight); launched on a side stream
while the kernels before a projection run, it lets that projection read its weight from L2.

It is a hint: L2 is coherent, so a prefetched line written later is read correctly, and on the
CPU (the Triton interpreter, or no Triton) the call does nothing.
"""

from __future__ import annotations

import torch

from mcore_kernels._triton_utils import CachedLauncher, jit, on_device_of, prefetch_l2, tl
from mcore_kernels.errors import KernelDeviceError, KernelValueError

__all__ = ["L2_LINE_BYTES", "L2_PREFETCH_PROGRAMS", "l2_prefetch"]

L2_LINE_BYTES = 128
"""Bytes of one L2 line (one prefetch request)."""
L2_PREFETCH_PROGRAMS = 32
"""Default programs of a prefetch launch (each of 4 warps, 1024 lines a round)."""
_LINES_PER_ROUND = 1024


@jit
def _l2_prefetch_kernel(
    first_ptr,
    first_lines,
    second_ptr,
    second_lines,
    LINE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Every program requests lines ``pid * BLOCK + k * programs * BLOCK + [0, BLOCK)`` of the
    two tensors' lines laid end to end (``LINE`` elements a line); out-of-range lines are
    clamped onto the last line (a repeated request is harmless)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    total = first_lines + second_lines
    offsets = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, total, programs * BLOCK):
        lines = start + offsets
        if start < first_lines:
            clamped = tl.minimum(lines, first_lines - 1).to(tl.int64)
            prefetch_l2(first_ptr + clamped * LINE)
        if (start + BLOCK > first_lines) & (second_lines > 0):
            second = tl.minimum(tl.maximum(lines - first_lines, 0), second_lines - 1)
            prefetch_l2(second_ptr + second.to(tl.int64) * LINE)


_LAUNCHER = CachedLauncher(_l2_prefetch_kernel)


def l2_prefetch(
    first: torch.Tensor,
    second: torch.Tensor | None = None,
    *,
    programs: int = L2_PREFETCH_PROGRAMS,
) -> None:
    """Request the bytes of ``first`` (and ``second``) into the GPU's L2 cache.

    One launch on the current stream; it returns at once and computes nothing. Call it on a
    side stream ahead of the kernel that reads the tensors.

    Args:
        first: A contiguous tensor on a CUDA device (a CPU tensor: nothing happens).
        second: Another contiguous tensor on the same device and of the same element size,
            or None.
        programs: Programs of the launch.

    Raises:
        KernelValueError: If ``programs`` is below 1, a tensor is not contiguous, or the
            element sizes differ.
        KernelDeviceError: If ``second`` is on another device than ``first``.
    """
    if programs < 1:
        raise KernelValueError(f"programs={programs}; expected at least 1")
    tensors = [first] if second is None else [first, second]
    for name, tensor in zip(("first", "second"), tensors, strict=False):
        if not tensor.is_contiguous():
            raise KernelValueError(f"{name} is not contiguous; expected a contiguous tensor")
    if second is not None:
        if second.device != first.device:
            raise KernelDeviceError(
                f"second is on {second.device}; expected first's device {first.device}"
            )
        if second.element_size() != first.element_size():
            raise KernelValueError(
                f"second has {second.element_size()}-byte elements; expected "
                f"{first.element_size()} like first"
            )
    if first.device.type != "cuda" or tl is None:
        return
    per_line = max(1, L2_LINE_BYTES // first.element_size())
    spans = [(t, -(-t.numel() // per_line)) for t in tensors if t.numel()]
    if not spans:
        return
    (first, first_lines), (other, second_lines) = spans[0], [*spans, (spans[0][0], 0)][1]
    blocks = -(-(first_lines + second_lines) // _LINES_PER_ROUND)
    with on_device_of(first):
        _LAUNCHER(
            (min(programs, blocks),),
            (first, first_lines, other, second_lines),
            {"LINE": per_line, "BLOCK": _LINES_PER_ROUND},
            4,
            first.get_device(),
        )
