"""``rms_norm`` as the custom ops ``mcore_kernels::rms_norm_fwd`` / ``rms_norm_bwd``.

Used while ``torch.compile`` traces :func:`mcore_kernels.rms_norm` (see :mod:`._compile`). The
forward returns the statistics the backward needs (the normalised input and the reciprocal RMS
of every row), and each op picks the Triton kernel or the torch formula at run time, as the
eager entry point does.
"""

from __future__ import annotations

import math

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton

__all__ = ["rms_norm_via_op"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _triton(*tensors: torch.Tensor) -> bool:
    return tensors[0].dtype != torch.float64 and use_triton(*tensors)


@_compile.custom_op(
    "rms_norm_fwd",
    "(Tensor x, Tensor weight, Tensor? residual, float eps) -> (Tensor, Tensor, Tensor)",
)
def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Outputs of a custom op may not alias its inputs: without a residual the normalised input
    # is ``x`` itself, which the autograd setup saves directly, and an empty tensor stands in.
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if _triton(*tensors):
        from mcore_kernels._rms_norm_triton import rms_norm_forward
        from mcore_kernels._triton_utils import on_device_of

        with on_device_of(x):
            y, hidden_states, rstd = rms_norm_forward(x, weight, eps, residual)
    else:
        hidden_states = x if residual is None else x + residual
        compute = _compute_dtype(x.dtype)
        h = hidden_states.to(compute)
        rstd = torch.rsqrt(h.pow(2).mean(dim=-1) + eps)
        y = (h * rstd.unsqueeze(-1) * weight.to(compute)).to(x.dtype)
        rstd = rstd.reshape(-1)
    # Elementwise results follow the layout of a permuted input; the fake promises contiguous.
    hidden_out = hidden_states.contiguous() if residual is not None else x.new_empty(0)
    return y.contiguous(), hidden_out, rstd


@_compile.custom_op(
    "rms_norm_bwd",
    "(Tensor dy, Tensor? dhidden, Tensor hidden, Tensor weight, Tensor rstd) -> (Tensor, Tensor)",
)
def _rms_norm_bwd(
    dy: torch.Tensor,
    dhidden: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(hidden, weight):
        from mcore_kernels._rms_norm_triton import rms_norm_backward
        from mcore_kernels._triton_utils import on_device_of

        with on_device_of(hidden):
            return rms_norm_backward(dy, dhidden, hidden, weight, rstd)
    compute = _compute_dtype(hidden.dtype)
    size = hidden.shape[-1]
    normed = hidden.reshape(-1, size).to(compute) * rstd.to(compute).unsqueeze(-1)
    dy2 = dy.reshape(-1, size).to(compute)
    dyw = dy2 * weight.to(compute)
    correction = (dyw * normed).mean(dim=-1, keepdim=True)
    dx = rstd.to(compute).unsqueeze(-1) * (dyw - normed * correction)
    if dhidden is not None:
        dx = dx + dhidden.reshape(-1, size).to(compute)
    dweight = (dy2 * normed).sum(dim=0)
    return dx.to(hidden.dtype).reshape(hidden.shape), dweight.to(weight.dtype)


def _rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


if _compile.CUSTOM_OPS:

    @_rms_norm_fwd.register_fake
    def _(x, weight, residual, eps):
        rstd_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        hidden = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
        return x.new_empty(x.shape), hidden, x.new_empty(_rows(x), dtype=rstd_dtype)

    @_rms_norm_bwd.register_fake
    def _(dy, dhidden, hidden, weight, rstd):
        return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)

    def _setup_context(ctx, inputs, output):
        x, weight, residual, _ = inputs
        _, hidden, rstd = output
        ctx.has_residual = residual is not None
        ctx.save_for_backward(hidden if residual is not None else x, weight, rstd)

    def _backward(ctx, dy, dhidden, _drstd):
        hidden, weight, rstd = ctx.saved_tensors
        dhidden = dhidden if ctx.has_residual else None
        dx, dweight = _rms_norm_bwd(dy, dhidden, hidden, weight, rstd)
        return dx, dweight, dx if ctx.has_residual else None, None

    _rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_via_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm through the custom op (arguments already validated).

    Args:
        x: ``[..., hidden]`` input.
        weight: ``[hidden]`` scale.
        eps: variance epsilon.
        residual: optional tensor shaped like ``x``.

    Returns:
        ``y``; with ``residual``, the pair ``(y, x + residual)``.
    """
    y, hidden, _ = _rms_norm_fwd(x, weight, residual, float(eps))
    return y if residual is None else (y, hidden)
