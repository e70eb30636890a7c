"""SwiGLU of a gate/up product whose input RMSNorm is folded into the weight and the row scale.

``rms_norm(x, w) @ W.T`` equals ``rstd(x) * (x @ (W * w).T)`` row by row: the norm's weight can
live in a copy of the projection weight and its per-row scale ``rstd(x) = 1 / sqrt(mean(x^2) +
eps)`` can be applied to the product afterwards. The decode engine's layers over many tokens
(:mod:`mcore_inference.fused_decode`) use it to drop the post-attention add + RMSNorm launch:
the o projection adds the residual stream in its GEMM (``beta = 1``), the gate/up GEMM reads
that sum ``x`` with the norm weight folded in, and this kernel scales the gate and up columns
by ``rstd(x)`` before ``silu(gate) * up`` (each program reduces its row of ``x``, a few KB read
from L2, instead of a separate kernel writing the normed rows).

Numerics: the product of the un-normalised rows rounds once to the activation dtype where the
unfused path rounds the normed rows, then the product; both are one rounding of the same
magnitude relative to the values (the scale and SwiGLU are computed in float32 here).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import CachedLauncher, jit, next_power_of_2, on_device_of, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.reference import normed_swiglu_reference

__all__ = ["normed_swiglu", "normed_swiglu_reference"]

_BLOCK = 1024
"""Output columns per program (one row per program row of the grid)."""


@jit
def _normed_swiglu_kernel(
    gate_up_ptr,
    x_ptr,
    out_ptr,
    width,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    source = gate_up_ptr + row * 2 * width
    # The product's loads first: they are in flight while the row's scale is reduced.
    gate = tl.load(source + cols, mask=ok, other=0.0)
    up = tl.load(source + width + cols, mask=ok, other=0.0)
    columns = tl.arange(0, HIDDEN_BLOCK)
    h = tl.load(x_ptr + row * hidden + columns, mask=columns < hidden, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    gate = gate.to(tl.float32) * rstd
    up = up.to(tl.float32) * rstd
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


_LAUNCHER = CachedLauncher(_normed_swiglu_kernel)


def normed_swiglu(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``silu(r * gate) * (r * up)`` with ``r = 1 / sqrt(mean(x^2) + eps)`` per row, one launch.

    With ``gate_up = x @ (W * w).T`` (``w`` the RMSNorm weight folded into the gate/up weight
    ``W``) this is ``swiglu(rms_norm(x, w, eps) @ W.T)`` up to rounding.

    Args:
        gate_up: ``[M, 2F]`` contiguous product, the gate columns first.
        x: ``[M, H]`` contiguous rows the product was computed from (the residual stream).
        eps: The folded norm's epsilon.

    Returns:
        ``[M, F]`` activation in the dtype of ``gate_up`` (computed in float32).

    Raises:
        KernelShapeError: If ``gate_up`` is not ``[M, 2F]`` or ``x`` not ``[M, H]``.
        KernelDtypeError: If the inputs are not floating point.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise KernelShapeError(
            f"gate_up.shape={tuple(gate_up.shape)}; expected [rows, 2 * ffn] (gate then up)"
        )
    if x.dim() != 2 or x.shape[0] != gate_up.shape[0] or x.shape[1] == 0:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}; expected [{gate_up.shape[0]}, hidden >= 1]"
        )
    if not (gate_up.dtype.is_floating_point and x.dtype.is_floating_point):
        raise KernelDtypeError(
            f"gate_up.dtype={gate_up.dtype}, x.dtype={x.dtype}; expected floating point"
        )
    if not use_triton(gate_up, x):
        return normed_swiglu_reference(gate_up, x, eps)
    gate_up, x = gate_up.contiguous(), x.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    if rows == 0 or width == 0:
        return out
    block = min(_BLOCK, next_power_of_2(width))
    with on_device_of(gate_up):
        _LAUNCHER(
            (rows, -(-width // block)),
            (gate_up, x, out, width, x.shape[1], float(eps)),
            {"BLOCK": block, "HIDDEN_BLOCK": next_power_of_2(x.shape[1])},
            4,
            gate_up.get_device() if gate_up.is_cuda else 0,
        )
    return out
