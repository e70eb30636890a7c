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

__all__ = ["normed_swiglu", "normed_swiglu_reference"]

_BLOCK = 1024
"""Output columns per program (one row per program row of the grid)."""


def normed_swiglu_reference(
    gate_up: torch.Tensor, x: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Torch reference of :func:`normed_swiglu` (float32 math, one rounding at the end).

    Args:
        gate_up: ``[M, 2F]`` product of ``x`` with the norm-folded gate then up weights, or
            float32 ``[S, M, 2F]`` split-K partials of it (summed in order, then rounded to
            ``dtype`` as a GEMM rounds its output).
        x: ``[M, H]`` rows the product was computed from.
        eps: The folded norm's epsilon.
        dtype: Dtype of the result (None: that of ``gate_up``, or of ``x`` for partials).

    Returns:
        ``[M, F]``.
    """
    if gate_up.dim() == 3:
        dtype = x.dtype if dtype is None else dtype
        total = gate_up[0]
        for part in gate_up[1:]:
            total = total + part
        gate_up = total.to(dtype)
    dtype = gate_up.dtype if dtype is None else dtype
    h = x.float()
    rstd = 1.0 / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate * rstd
    up = up * rstd
    return (gate / (1.0 + torch.exp(-gate)) * up).to(dtype)


@jit
def _normed_swiglu_kernel(
    gate_up_ptr,
    x_ptr,
    out_ptr,
    width,
    hidden,
    eps,
    stride_split,
    BLOCK: tl.constexpr,
    HIDDEN_BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, HIDDEN_BLOCK)
    h = tl.load(x_ptr + row * hidden + columns, mask=columns < hidden, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    source = gate_up_ptr + row * 2 * width
    gate = tl.load(source + cols, mask=ok, other=0.0)
    up = tl.load(source + width + cols, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if SPLITS > 0:
        # float32 split-K partials, summed in split order and rounded as a GEMM output.
        for split in tl.static_range(1, SPLITS):
            gate += tl.load(source + split * stride_split + cols, mask=ok, other=0.0)
            up += tl.load(source + split * stride_split + width + cols, mask=ok, other=0.0)
        gate = gate.to(dtype)
        up = up.to(dtype)
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
        gate_up: ``[M, 2F]`` contiguous product, the gate columns first; or float32
            ``[S, M, 2F]`` split-K partials of it (``mcore_kernels.split_sum_rms_norm.
            split_k_partials``), summed in split order and rounded to the dtype of ``x``
            first, as a GEMM rounds its output.
        x: ``[M, H]`` contiguous rows the product was computed from (the residual stream).
        eps: The folded norm's epsilon.

    Returns:
        ``[M, F]`` activation in the dtype of ``gate_up`` (of ``x`` for partials; computed in
        float32).

    Raises:
        KernelShapeError: If ``gate_up`` is not ``[M, 2F]`` / ``[S, M, 2F]`` or ``x`` not
            ``[M, H]``.
        KernelDtypeError: If the inputs are not floating point or partials not float32.
    """
    partials = gate_up.dim() == 3
    if gate_up.dim() not in (2, 3) or gate_up.shape[-1] % 2 or (partials and not gate_up.shape[0]):
        raise KernelShapeError(
            f"gate_up.shape={tuple(gate_up.shape)}; expected [rows, 2 * ffn] (gate then up) "
            "or [splits, rows, 2 * ffn]"
        )
    rows = gate_up.shape[-2]
    if x.dim() != 2 or x.shape[0] != rows or x.shape[1] == 0:
        raise KernelShapeError(f"x.shape={tuple(x.shape)}; expected [{rows}, hidden >= 1]")
    if not (gate_up.dtype.is_floating_point and x.dtype.is_floating_point):
        raise KernelDtypeError(
            f"gate_up.dtype={gate_up.dtype}, x.dtype={x.dtype}; expected floating point"
        )
    if partials and gate_up.dtype != torch.float32:
        raise KernelDtypeError(
            f"gate_up.dtype={gate_up.dtype}; split-K partials must be torch.float32"
        )
    if not use_triton(gate_up, x):
        return normed_swiglu_reference(gate_up, x, eps)
    gate_up, x = gate_up.contiguous(), x.contiguous()
    width = gate_up.shape[-1] // 2
    out = torch.empty((rows, width), dtype=x.dtype if partials else gate_up.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    block = min(_BLOCK, next_power_of_2(width))
    splits = gate_up.shape[0] if partials else 0
    with on_device_of(gate_up):
        _LAUNCHER(
            (rows, -(-width // block)),
            (gate_up, x, out, width, x.shape[1], float(eps), rows * 2 * width),
            {"BLOCK": block, "HIDDEN_BLOCK": next_power_of_2(x.shape[1]), "SPLITS": splits},
            4,
            gate_up.get_device() if gate_up.is_cuda else 0,
        )
    return out
