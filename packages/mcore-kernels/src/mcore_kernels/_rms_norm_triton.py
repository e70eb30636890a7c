"""Triton kernels of the fused residual add + RMSNorm, their launchers and autograd function.

Forward: one program per row. Rows up to ``MAX_BLOCK`` wide are held in registers; wider rows
take a looped variant that first streams the row to accumulate the mean square (storing
``x + residual``) and then streams it again to normalise. Backward: a fixed-size grid of
programs, each owning a contiguous range of rows, writes ``d(x)`` per row and a float32 partial
``d(weight)`` per program; the partials are summed in a fixed order, so the weight gradient is
deterministic. Block sizes depend on the hidden size only, so a row's result never depends on
how many rows share the launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mcore_kernels._triton_utils import as_rows, on_device_of, round_to

__all__ = [
    "BACKWARD_STAGES",
    "MAX_BLOCK",
    "rms_norm_triton",
    "rms_norm_forward",
    "rms_norm_backward",
]

MAX_BLOCK = 8192
"""Widest row held in registers; wider rows are processed in chunks of this many elements."""

BACKWARD_STAGES = 3
"""Software-pipelining depth of the backward's loop over rows (``tl.range(num_stages=...)``) when
the row buffers fit in shared memory; measured on H200, 3 stages cut the 8192 x 8192 bf16
backward by about 19 % against 1 (benchmarks/tune_launch_configs.py)."""


def _block_and_warps(hidden: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


@functools.cache
def _device_limits(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    # torch < 2.5 lacks the opt-in limit; 48 KiB is what every CUDA GPU grants a block.
    shared = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    return props.multi_processor_count, shared


def _backward_launch(
    device: torch.device, rows: int, block: int, row_bytes: int
) -> tuple[int, int]:
    """Return ``(programs, pipelining stages)`` of the backward grid."""
    if device.type != "cuda":
        # The interpreter runs programs one after another; a few are enough to exercise the split.
        return max(1, min(rows, 4)), 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    multiprocessors, shared = _device_limits(index)
    # Measured on H200 (benchmarks/tune_launch_configs.py): one 16-warp program per SM is best
    # for 8192-wide rows, eight 8-warp programs per SM for 2048-wide rows.
    per_sm = 1 if block >= 8192 else 2 if block >= 4096 else 8
    # Each stage buffers one row of every streamed tensor; keep headroom for the reductions.
    stages = BACKWARD_STAGES if BACKWARD_STAGES * row_bytes <= shared - 16 * 1024 else 1
    return max(1, min(rows, multiprocessors * per_sm)), stages


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    rstd_ptr,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    r_row = residual_ptr + row * residual_row_stride
    y_row = y_ptr + row * hidden
    h_row = hidden_out_ptr + row * hidden
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        mask = cols < hidden
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # Rounded to the input dtype before normalising, as Hugging Face models do.
            x = round_to(
                x.to(tl.float32) + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32),
                x.dtype,
            )
            tl.store(h_row + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, round_to(h * rstd * w, y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                x = round_to(
                    x.to(tl.float32) + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32),
                    x.dtype,
                )
                tl.store(h_row + offs, x, mask=mask)
            h = x.to(tl.float32)
            sum_sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            if HAS_RESIDUAL:
                h = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, round_to(h * rstd * w, y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    weight_ptr,
    rstd_ptr,
    dx_ptr,
    dweight_partial_ptr,
    hidden_row_stride,
    rows,
    rows_per_program,
    hidden,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    program = tl.program_id(0)
    first = program.to(tl.int64) * rows_per_program
    count = tl.minimum(first + rows_per_program, rows) - first
    cols = tl.arange(0, BLOCK)
    partial_row = dweight_partial_ptr + program.to(tl.int64) * hidden
    if SINGLE_BLOCK:
        mask = cols < hidden
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        # Pipelining keeps the next rows' loads in flight while this row is reduced.
        for i in tl.range(0, count, num_stages=NUM_STAGES):
            row64 = first + i
            dy = tl.load(dy_ptr + row64 * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(hidden_ptr + row64 * hidden_row_stride + cols, mask=mask, other=0.0).to(
                tl.float32
            )
            rstd = tl.load(rstd_ptr + row64)
            normed = h * rstd
            dyw = dy * w
            correction = tl.sum(dyw * normed, axis=0) / hidden
            dx = rstd * (dyw - normed * correction)
            if HAS_DHIDDEN_OUT:
                dx += tl.load(dhidden_out_ptr + row64 * hidden + cols, mask=mask, other=0.0).to(
                    tl.float32
                )
            tl.store(
                dx_ptr + row64 * hidden + cols, round_to(dx, dx_ptr.dtype.element_ty), mask=mask
            )
            dw += dy * normed
        tl.store(partial_row + cols, dw, mask=mask)
    else:
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            tl.store(partial_row + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < hidden)
        for i in range(0, count):
            row64 = first + i
            rstd = tl.load(rstd_ptr + row64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, hidden, BLOCK):
                offs = start + cols
                mask = offs < hidden
                dy = tl.load(dy_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + row64 * hidden_row_stride + offs, mask=mask, other=0.0).to(
                    tl.float32
                )
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                acc += dy * w * h * rstd
            correction = tl.sum(acc, axis=0) / hidden
            for start in range(0, hidden, BLOCK):
                offs = start + cols
                mask = offs < hidden
                dy = tl.load(dy_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + row64 * hidden_row_stride + offs, mask=mask, other=0.0).to(
                    tl.float32
                )
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                normed = h * rstd
                dx = rstd * (dy * w - normed * correction)
                if HAS_DHIDDEN_OUT:
                    dx += tl.load(dhidden_out_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(
                        tl.float32
                    )
                tl.store(
                    dx_ptr + row64 * hidden + offs, round_to(dx, dx_ptr.dtype.element_ty), mask=mask
                )
                dw = tl.load(partial_row + offs, mask=mask, other=0.0)
                tl.store(partial_row + offs, dw + dy * normed, mask=mask)


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        x: ``[..., hidden]`` input.
        weight: ``[hidden]`` scale.
        eps: variance epsilon.
        residual: optional tensor shaped like ``x``.

    Returns:
        ``(y, hidden_states, rstd)``: ``y`` shaped like ``x``, ``hidden_states`` the tensor that
        was normalised (``x + residual``, or ``x`` itself without residual) and ``rstd`` the
        float32 reciprocal RMS of each row, ``[rows]``.
    """
    hidden = x.shape[-1]
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    rows = x2.shape[0]
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else x2
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows > 0:
        block, warps = _block_and_warps(hidden)
        _rms_norm_fwd_kernel[(rows,)](
            x2,
            r2,
            weight,
            y,
            h,
            rstd,
            x2.stride(0),
            r2.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            SINGLE_BLOCK=hidden <= block,
            num_warps=warps,
        )
    hidden_states = h.reshape(x.shape) if residual is not None else x
    return y.reshape(x.shape), hidden_states, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    dhidden_out: torch.Tensor | None,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel.

    Args:
        dy: gradient of ``y``.
        dhidden_out: gradient of the returned ``x + residual``, or None.
        hidden_states: the normalised input saved by the forward.
        weight: ``[hidden]`` scale.
        rstd: ``[rows]`` float32 reciprocal RMS saved by the forward.

    Returns:
        ``(d_hidden, d_weight)``: the gradient of the normalised input (which is also the
        gradient of ``x`` and of ``residual``) in its dtype, and the weight gradient in the
        weight's dtype.
    """
    hidden = hidden_states.shape[-1]
    h2 = as_rows(hidden_states)
    dy2 = dy.reshape(-1, hidden).contiguous()
    dh2 = dhidden_out.reshape(-1, hidden).contiguous() if dhidden_out is not None else dy2
    rows = h2.shape[0]
    dx = torch.empty((rows, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    if rows == 0:
        return dx.reshape(hidden_states.shape), torch.zeros_like(weight)
    block, warps = _block_and_warps(hidden)
    streamed = 3 if dhidden_out is not None else 2
    row_bytes = block * (streamed * hidden_states.element_size())
    programs, stages = _backward_launch(hidden_states.device, rows, block, row_bytes)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    partial = torch.empty((programs, hidden), dtype=torch.float32, device=hidden_states.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy2,
        dh2,
        h2,
        weight,
        rstd,
        dx,
        partial,
        h2.stride(0),
        rows,
        rows_per_program,
        hidden,
        HAS_DHIDDEN_OUT=dhidden_out is not None,
        BLOCK=block,
        SINGLE_BLOCK=hidden <= block,
        NUM_STAGES=stages,
        num_warps=warps,
    )
    return dx.reshape(hidden_states.shape), partial.sum(dim=0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):  # type: ignore[override]
        y, hidden_states, rstd = rms_norm_forward(x, weight, eps, residual)
        ctx.save_for_backward(hidden_states, weight, rstd)
        ctx.has_residual = residual is not None
        if residual is None:
            return y
        return y, hidden_states

    @staticmethod
    def backward(ctx, dy, dhidden_out=None):  # type: ignore[override]
        hidden_states, weight, rstd = ctx.saved_tensors
        dh, dweight = rms_norm_backward(dy, dhidden_out, hidden_states, weight, rstd)
        dresidual = dh if ctx.has_residual and ctx.needs_input_grad[2] else None
        return dh, dweight, dresidual, None


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm through the Triton kernels (arguments already validated).

    Args:
        x: ``[..., hidden]`` input.
        weight: ``[hidden]`` scale.
        eps: variance epsilon.
        residual: optional tensor shaped like ``x``.

    Returns:
        ``y``; with ``residual``, the pair ``(y, x + residual)``.
    """
    # The autograd engine runs the backward on the device's own thread, with it current.
    with on_device_of(x):
        return _RMSNormFunction.apply(x, weight, residual, float(eps))
