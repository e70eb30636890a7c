"""Triton kernels of the CUDA-graph-safe row copies (see :mod:`mcore_kernels.tensor_ops`).

One program per destination (or source) row reads the device-side position or index, then
copies the row in chunks. Rows are reinterpreted as integers of the element size, so the copy
is bitwise for every dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mcore_kernels._triton_utils import on_device_of

__all__ = ["slice_after_triton", "merge_triton", "masked_update_triton"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_BLOCK = 4096


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Flatten to ``[rows, row_size]`` integers of the element size (a view when contiguous)."""
    rows = tensor.shape[0]
    flat = tensor.contiguous().view(_BITS[tensor.element_size()])
    return flat.reshape(rows, math.prod(tensor.shape[1:]))


def _block(row_size: int) -> int:
    return min(triton.next_power_of_2(max(row_size, 1)), _MAX_BLOCK)


@triton.jit
def _copy_row(src_row_ptr, dst_row_ptr, row_size, enabled, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    # A disabled row copies nothing: every lane is masked off.
    limit = tl.where(enabled, row_size, 0)
    for start in range(0, row_size, BLOCK):
        offs = start + cols
        mask = offs < limit
        tl.store(dst_row_ptr + offs, tl.load(src_row_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _slice_after_kernel(inp_ptr, pos_ptr, out_ptr, inp_rows, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr).to(tl.int64), 0), inp_rows)
    src = pos + row
    enabled = src < inp_rows
    src = tl.where(enabled, src, 0)
    _copy_row(inp_ptr + src * row_size, out_ptr + row * row_size, row_size, enabled, BLOCK)


@triton.jit
def _merge_kernel(
    a_ptr,
    b_ptr,
    pos_ptr,
    out_ptr,
    a_rows,
    b_rows,
    row_size,
    IN_PLACE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr).to(tl.int64), 0), a_rows)
    from_a = row < pos
    b_row = row - pos
    from_b = (row >= pos) & (b_row < b_rows)
    dst = out_ptr + row * row_size
    if not IN_PLACE:
        _copy_row(a_ptr + tl.where(from_a, row, 0) * row_size, dst, row_size, from_a, BLOCK)
    _copy_row(b_ptr + tl.where(from_b, b_row, 0) * row_size, dst, row_size, from_b, BLOCK)


@triton.jit
def _masked_update_kernel(states_ptr, idx_ptr, new_ptr, num_states, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    enabled = (slot >= 0) & (slot < num_states)
    slot = tl.where(enabled, slot, 0)
    _copy_row(new_ptr + row * row_size, states_ptr + slot * row_size, row_size, enabled, BLOCK)


def slice_after_triton(inp: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch the ``slice_after`` kernel (arguments already validated).

    Args:
        inp: ``[n, ...]`` source rows.
        pos: one-element integer tensor.
        out: ``[m, ...]`` contiguous destination.

    Returns:
        ``out``.
    """
    src, dst = _as_bits(inp), _as_bits(out)
    if dst.shape[0] > 0 and dst.shape[1] > 0:
        with on_device_of(dst):
            _slice_after_kernel[(dst.shape[0],)](
                src, pos, dst, src.shape[0], dst.shape[1], BLOCK=_block(dst.shape[1])
            )
    return out


def merge_triton(
    a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """Launch the ``merge`` kernel (arguments already validated).

    Args:
        a: ``[n_a, ...]`` rows kept before ``pos``.
        b: ``[n_b, ...]`` rows written from ``pos`` on.
        pos: one-element integer tensor.
        out: contiguous destination, or None to write into ``a``.

    Returns:
        The destination tensor.
    """
    target = a if out is None else out
    src_a, src_b, dst = _as_bits(a), _as_bits(b), _as_bits(target)
    if dst.shape[0] > 0 and dst.shape[1] > 0:
        with on_device_of(dst):
            _merge_kernel[(dst.shape[0],)](
                src_a,
                src_b,
                pos,
                dst,
                src_a.shape[0],
                src_b.shape[0],
                dst.shape[1],
                IN_PLACE=out is None,
                BLOCK=_block(dst.shape[1]),
            )
    return target


def masked_update_triton(
    states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor
) -> torch.Tensor:
    """Launch the ``masked_update`` kernel (arguments already validated).

    Args:
        states: ``[num_states, ...]`` contiguous table updated in place.
        idx: ``[k]`` integer slots, ``-1`` to skip.
        new_states: ``[k, ...]`` rows to write.

    Returns:
        ``states``.
    """
    dst, src = _as_bits(states), _as_bits(new_states)
    if src.shape[0] > 0 and src.shape[1] > 0:
        with on_device_of(dst):
            _masked_update_kernel[(src.shape[0],)](
                dst, idx, src, dst.shape[0], dst.shape[1], BLOCK=_block(dst.shape[1])
            )
    return states
