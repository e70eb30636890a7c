"""Row copies steered by device tensors: no host synchronisation, capturable in CUDA graphs.

Inference engines replaying CUDA graphs keep batch boundaries in device tensors (how many
requests are in prefill, which state slot each request owns). These ops move rows of the first
dimension according to such tensors without reading them on the host, so a captured graph
stays valid when the boundary changes between replays. The operation set follows Megatron-LM's
inference ``tensor_ops`` (``tensor_get_slice_after``, ``tensor_merge``, ``tensor_masked_update``
in ``megatron/core/inference/contexts/attention_context/triton/tensor_ops.py``).

The file holds the Triton kernels, their launchers, the ``torch.library`` registrations and
the entry points; the torch references live in :mod:`mcore_kernels.reference`. Copies are bitwise (tensors are reinterpreted as integers of their element size), so any dtype
works and NaN payloads survive. The Triton kernels clamp ``pos`` into range and skip state
indices outside ``[0, num_states)``, because validating them would need a host sync; pass
``check_bounds=True`` to have them validated (with a sync) and rejected with an error instead.
The torch references read ``pos`` on the host.

Under ``torch.compile`` each function is an opaque in-place custom op
(``torch.ops.mcore_kernels.slice_after_``, ``merge_``, ``masked_update_``) that declares the
tensor it writes, so the functions compile with ``fullgraph=True``; they are not differentiable.
"""

from __future__ import annotations

import math

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import jit, next_power_of_2, on_device_of, tl
from mcore_kernels._validation import check_same_device, check_tensor
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.reference import masked_update_reference, merge_reference, slice_after_reference

__all__ = [
    "slice_after",
    "merge",
    "masked_update",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_rows(
    name: str, tensor: object, reference_name: str, reference: torch.Tensor
) -> torch.Tensor:
    tensor = check_tensor(name, tensor)
    if tensor.dim() != reference.dim() or tensor.shape[1:] != reference.shape[1:]:
        raise KernelShapeError(
            f"{name}.shape={tuple(tensor.shape)} must match {reference_name}.shape={tuple(reference.shape)} "
            "in every dimension but the first"
        )
    if tensor.dtype != reference.dtype:
        raise KernelDtypeError(
            f"{name}.dtype={tensor.dtype} must equal {reference_name}.dtype={reference.dtype}"
        )
    return tensor


def _check_index(name: str, value: object, *, scalar: bool) -> torch.Tensor:
    index = check_tensor(name, value)
    if index.dtype not in _INDEX_DTYPES:
        raise KernelDtypeError(
            f"{name}.dtype={index.dtype} is not supported; expected torch.int32 or torch.int64"
        )
    if scalar and index.numel() != 1:
        raise KernelShapeError(f"{name}.shape={tuple(index.shape)} must hold exactly one element")
    if not scalar and index.dim() != 1:
        raise KernelShapeError(f"{name}.shape={tuple(index.shape)} must be one-dimensional")
    return index


def _check_output(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() < 1:
        raise KernelShapeError(f"{name} must have at least one dimension, got a scalar")
    if not tensor.is_contiguous():
        raise KernelShapeError(f"{name} must be contiguous: it is written in place")


def _check_pos(pos: torch.Tensor, upper: int, upper_name: str) -> None:
    value = int(pos.reshape(()).item())
    if not 0 <= value <= upper:
        raise KernelValueError(f"pos={value} is outside [0, {upper}] ({upper_name})")


# --- Triton kernels and launchers ----------------------------------------------------------

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_BLOCK = 4096


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Flatten to ``[rows, row_size]`` integers of the element size (a view when contiguous)."""
    rows = tensor.shape[0]
    flat = tensor.contiguous().view(_BITS[tensor.element_size()])
    return flat.reshape(rows, math.prod(tensor.shape[1:]))


def _block(row_size: int) -> int:
    return min(next_power_of_2(max(row_size, 1)), _MAX_BLOCK)


@jit
def _copy_row(src_row_ptr, dst_row_ptr, row_size, enabled, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    # A disabled row copies nothing: every lane is masked off.
    limit = tl.where(enabled, row_size, 0)
    for start in range(0, row_size, BLOCK):
        offs = start + cols
        mask = offs < limit
        tl.store(dst_row_ptr + offs, tl.load(src_row_ptr + offs, mask=mask), mask=mask)


@jit
def _slice_after_kernel(inp_ptr, pos_ptr, out_ptr, inp_rows, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr).to(tl.int64), 0), inp_rows)
    src = pos + row
    enabled = src < inp_rows
    src = tl.where(enabled, src, 0)
    _copy_row(inp_ptr + src * row_size, out_ptr + row * row_size, row_size, enabled, BLOCK)


@jit
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


@jit
def _masked_update_kernel(states_ptr, idx_ptr, new_ptr, num_states, row_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    enabled = (slot >= 0) & (slot < num_states)
    slot = tl.where(enabled, slot, 0)
    _copy_row(new_ptr + row * row_size, states_ptr + slot * row_size, row_size, enabled, BLOCK)


def _slice_after_triton(inp: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    src, dst = _as_bits(inp), _as_bits(out)
    if dst.shape[0] > 0 and dst.shape[1] > 0:
        with on_device_of(dst):
            _slice_after_kernel[(dst.shape[0],)](
                src, pos, dst, src.shape[0], dst.shape[1], BLOCK=_block(dst.shape[1])
            )
    return out


def _merge_triton(
    a: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
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


def _masked_update_triton(
    states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor
) -> torch.Tensor:
    dst, src = _as_bits(states), _as_bits(new_states)
    if src.shape[0] > 0 and src.shape[1] > 0:
        with on_device_of(dst):
            _masked_update_kernel[(src.shape[0],)](
                dst, idx, src, dst.shape[0], dst.shape[1], BLOCK=_block(dst.shape[1])
            )
    return states


# --- entry points and custom ops --------------------------------------------------------------


def slice_after(
    inp: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, *, check_bounds: bool = False
) -> torch.Tensor:
    """Copy ``inp[pos:]`` into the first rows of ``out``, with ``pos`` read on the device.

    ``k = min(n - pos, m)`` rows are copied; the other rows of ``out`` keep their values.

    Args:
        inp: ``[n, ...]`` source rows.
        pos: one-element int32/int64 tensor on the device of ``inp``; clamped into ``[0, n]``.
        out: ``[m, ...]`` contiguous destination of the same trailing shape and dtype.
        check_bounds: read ``pos`` on the host and raise if it lies outside ``[0, n]`` (a host
            sync: not for CUDA graph capture).

    Returns:
        ``out``.

    Raises:
        KernelShapeError: shapes do not line up, ``pos`` is not one element, or ``out`` is not
            contiguous.
        KernelDtypeError: dtypes differ or ``pos`` is not an integer tensor.
        KernelDeviceError: tensors on different devices.
        KernelValueError: with ``check_bounds``, ``pos`` out of range.
    """
    inp = check_tensor("inp", inp)
    out = _check_rows("out", out, "inp", inp)
    pos = _check_index("pos", pos, scalar=True)
    _check_output("out", out)
    check_same_device(inp=inp, pos=pos, out=out)
    if _compile.compiling():
        _slice_after_op(inp, pos, out, check_bounds)
        return out
    return _slice_after_run(inp, pos, out, check_bounds)


def _slice_after_run(
    inp: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, check_bounds: bool
) -> torch.Tensor:
    if check_bounds:
        _check_pos(pos, inp.shape[0], "inp.shape[0]")
    if use_triton(inp, pos, out):
        return _slice_after_triton(inp, pos, out)
    return slice_after_reference(inp, pos, out)


@_compile.custom_op(
    "slice_after_",
    "(Tensor inp, Tensor pos, Tensor(a!) out, bool check_bounds) -> ()",
    mutates_args=("out",),
)
def _slice_after_op(
    inp: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, check_bounds: bool
) -> None:
    _slice_after_run(inp, pos, out, check_bounds)


def merge(
    a: torch.Tensor,
    b: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check_bounds: bool = False,
) -> torch.Tensor:
    """Write ``a[:pos]`` followed by ``b`` into ``out``, with ``pos`` read on the device.

    Rows ``[0, pos)`` of ``out`` get ``a[:pos]``; rows ``[pos, pos + k)`` get ``b[:k]`` with
    ``k = min(n_b, m - pos)``; later rows keep their values. With ``out=None`` the merge happens
    in place in ``a`` (then ``m = n_a``).

    Args:
        a: ``[n_a, ...]`` rows kept before ``pos``.
        b: ``[n_b, ...]`` rows written from ``pos`` on.
        pos: one-element int32/int64 tensor on the device; clamped into ``[0, n_a]``.
        out: ``[m, ...]`` contiguous destination with ``m >= n_a``, or None for ``a``.
        check_bounds: read ``pos`` on the host and raise if it lies outside ``[0, n_a]`` (a
            host sync: not for CUDA graph capture).

    Returns:
        The destination tensor.

    Raises:
        KernelShapeError: shapes do not line up, ``out`` has fewer rows than ``a``, ``pos`` is
            not one element, or the destination is not contiguous.
        KernelDtypeError: dtypes differ or ``pos`` is not an integer tensor.
        KernelDeviceError: tensors on different devices.
        KernelValueError: with ``check_bounds``, ``pos`` out of range.
    """
    a = check_tensor("a", a)
    b = _check_rows("b", b, "a", a)
    pos = _check_index("pos", pos, scalar=True)
    if out is None:
        _check_output("a", a)
    else:
        out = _check_rows("out", out, "a", a)
        _check_output("out", out)
        if out.shape[0] < a.shape[0]:
            raise KernelShapeError(
                f"out.shape[0]={out.shape[0]} must be >= a.shape[0]={a.shape[0]}"
            )
    check_same_device(a=a, b=b, pos=pos, out=out)
    if _compile.compiling():
        # The op writes one declared tensor: ``a`` for an in-place merge, else ``out``.
        if out is None:
            _merge_op(a, None, b, pos, check_bounds)
            return a
        _merge_op(out, a, b, pos, check_bounds)
        return out
    return _merge_run(a, b, pos, out, check_bounds)


def _merge_run(
    a: torch.Tensor,
    b: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor | None,
    check_bounds: bool,
) -> torch.Tensor:
    if check_bounds:
        _check_pos(pos, a.shape[0], "a.shape[0]")
    if use_triton(a, b, pos):
        return _merge_triton(a, b, pos, out)
    return merge_reference(a, b, pos, out)


@_compile.custom_op(
    "merge_",
    "(Tensor(a!) dst, Tensor? a, Tensor b, Tensor pos, bool check_bounds) -> ()",
    mutates_args=("dst",),
)
def _merge_op(
    dst: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor,
    pos: torch.Tensor,
    check_bounds: bool,
) -> None:
    if a is None:
        _merge_run(dst, b, pos, None, check_bounds)
    else:
        _merge_run(a, b, pos, dst, check_bounds)


def masked_update(
    states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor, *, check_bounds: bool = False
) -> torch.Tensor:
    """Scatter rows: ``states[idx[i]] = new_states[i]`` for every ``i`` with ``idx[i] != -1``.

    Works for any number of trailing dimensions (2-D, 3-D, 4-D state tables ...). Two rows with
    the same valid index race; callers pass distinct slots.

    Args:
        states: ``[num_states, ...]`` contiguous table updated in place.
        idx: ``[k]`` int32/int64 slots on the device; ``-1`` (and, without ``check_bounds``, any
            index outside ``[0, num_states)``) skips the row.
        new_states: ``[k, ...]`` rows of the same trailing shape and dtype as ``states``.
        check_bounds: read ``idx`` on the host and raise on indices outside
            ``[-1, num_states)`` (a host sync: not for CUDA graph capture).

    Returns:
        ``states``.

    Raises:
        KernelShapeError: shapes do not line up or ``states`` is not contiguous.
        KernelDtypeError: dtypes differ or ``idx`` is not an integer tensor.
        KernelDeviceError: tensors on different devices.
        KernelValueError: with ``check_bounds``, an index out of range.
    """
    states = check_tensor("states", states)
    new_states = _check_rows("new_states", new_states, "states", states)
    idx = _check_index("idx", idx, scalar=False)
    _check_output("states", states)
    if idx.shape[0] != new_states.shape[0]:
        raise KernelShapeError(
            f"idx.shape={tuple(idx.shape)} must have new_states.shape[0]={new_states.shape[0]} rows"
        )
    check_same_device(states=states, idx=idx, new_states=new_states)
    if _compile.compiling():
        _masked_update_op(states, idx, new_states, check_bounds)
        return states
    return _masked_update_run(states, idx, new_states, check_bounds)


def _masked_update_run(
    states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor, check_bounds: bool
) -> torch.Tensor:
    if check_bounds and idx.numel() > 0:
        bad = (idx < -1) | (idx >= states.shape[0])
        if bool(bad.any()):
            raise KernelValueError(
                f"idx holds {int(idx[bad][0])}, outside [0, {states.shape[0]}) and not -1 (states.shape[0])"
            )
    if use_triton(states, idx, new_states):
        return _masked_update_triton(states, idx, new_states)
    return masked_update_reference(states, idx, new_states)


@_compile.custom_op(
    "masked_update_",
    "(Tensor(a!) states, Tensor idx, Tensor new_states, bool check_bounds) -> ()",
    mutates_args=("states",),
)
def _masked_update_op(
    states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor, check_bounds: bool
) -> None:
    _masked_update_run(states, idx, new_states, check_bounds)


# In-place ops return nothing: their fake implementations have nothing to compute.
_slice_after_op.register_fake(lambda inp, pos, out, check_bounds: None)
_merge_op.register_fake(lambda dst, a, b, pos, check_bounds: None)
_masked_update_op.register_fake(lambda states, idx, new_states, check_bounds: None)
