"""The move-only floor of the add + RMSNorm forward: its bytes moved by a kernel that computes
nothing, over a space of launch configurations.

The forward of any implementation reads ``x`` and ``residual`` and writes ``y`` and
``x + residual``. :func:`move_kernel` reads the same two tensors and writes two fresh tensors of
the same size, with no arithmetic: what is left is the launch, the loads, the stores and the
kernel's end. It is launched like mcore's forward (outputs allocated per call with
``empty_like``, inputs loaded with the evict-first hint where the call fits in half of the L2
cache, as ``rms_norm`` does) over the same kind of launch space: ``elements`` per program
(a share of a row, a row, several rows) and warps. The fastest configuration at a shape, timed
like the implementations, is the least time any kernel that moves those bytes in one launch
was measured to need there: a peer within 1.1x of it cannot be beaten by 1.1x.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

ELEMENTS_PER_THREAD = (8, 16, 32)
"""Elements of each tensor a thread moves (16-byte vectors of bf16: one, two or four)."""
WARPS = (2, 4, 8, 16, 32)
"""Warps of a program."""
ROW_SHARES = (4, 2, 1, 1 / 2, 1 / 4)
"""Program sizes in rows: a quarter of a row up to four rows."""


@triton.jit
def move_kernel(x_ptr, r_ptr, out_ptr, residual_out_ptr, BLOCK: tl.constexpr, HINT: tl.constexpr):
    # Program p moves elements [p * BLOCK, (p + 1) * BLOCK) of both tensors (no masks: the
    # launches are whole blocks; offsets stay below 2**31 for the benchmark's tensors).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if HINT:
        x = tl.load(x_ptr + offs, eviction_policy="evict_first")
        r = tl.load(r_ptr + offs, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + offs)
        r = tl.load(r_ptr + offs)
    tl.store(residual_out_ptr + offs, r)
    tl.store(out_ptr + offs, x)


def move_configs(rows: int, hidden: int) -> list[tuple[int, int]]:
    """The ``(elements per program, warps)`` timed at a shape: programs of a quarter of a row to
    four rows (at most the whole call) whose threads move 8, 16 or 32 elements each."""
    total = rows * hidden
    found = []
    for share in ROW_SHARES:
        elements = int(share * hidden)
        if elements > total or total % elements:
            continue
        for warps in WARPS:
            if elements // (32 * warps) in ELEMENTS_PER_THREAD:
                found.append((elements, warps))
    return found


def evict_first(x: torch.Tensor) -> bool:
    """Whether mcore's forward loads a call's rows with the evict-first hint (``x`` within half
    of the L2 cache)."""
    if not x.is_cuda:
        return False
    l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", 0)
    return x.numel() * x.element_size() <= l2 // 2


def move_call(elements: int, warps: int) -> Callable[..., Any]:
    """``fn(x, residual, weight) -> (out, residual_out)``: the move-only kernel on programs of
    ``elements`` elements and ``warps`` warps (``weight`` is not read)."""
    grid_cache: dict[int, tuple[int]] = {}

    def call(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        total = x.numel()
        grid = grid_cache.get(total)
        if grid is None:
            if total % elements or total >= 2**31:
                raise ValueError(f"{total} elements do not split into programs of {elements}")
            grid = grid_cache[total] = (total // elements,)
        move_kernel[grid](
            x, residual, out, residual_out, BLOCK=elements, HINT=evict_first(x), num_warps=warps
        )
        return out, residual_out

    return call


def move_floor_calls(rows: int, hidden: int) -> dict[str, Callable[..., Any]]:
    """Every configuration of :func:`move_configs` as a named call ``move:ELEMENTSxWARPS``."""
    return {f"move:{e}x{w}": move_call(e, w) for e, w in move_configs(rows, hidden)}
