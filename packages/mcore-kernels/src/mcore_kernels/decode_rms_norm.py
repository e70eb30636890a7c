"""RMSNorm of a few rows as one programmatic-dependent-launch participant (a decode step's
final norm, between the last projection and the LM head).

At decode the final norm is one small launch between the last layer's down projection and the
LM head. Launched plainly, it waits for the down projection to drain, and the LM head (the
largest weight of the step) cannot start streaming until the norm has finished. This kernel,
under :func:`mcore_kernels.pdl.programmatic_dependent_launch`, lets the next kernel start at
once (the LM head's programs request their weight tiles meanwhile), requests the norm weight,
then waits for the previous kernel before it reads the rows.

One program per row, the row in one tile (``K`` up to :data:`DECODE_RMS_NORM_MAX_K`). The
arithmetic is that of :func:`mcore_kernels.decode_gemv.decode_gemv`'s norm prologue:
``rsqrt(mean(x**2) + eps)`` in float32, times the weight, rounded once to the dtype of ``x``.

Dispatch: Triton on CUDA, :func:`mcore_kernels.reference.rms_norm_reference` elsewhere (with
``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    pdl_supported,
    round_to,
    tl,
)
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import rms_norm_reference

__all__ = ["DECODE_RMS_NORM_MAX_K", "decode_rms_norm"]

DECODE_RMS_NORM_MAX_K = 16384
"""Longest row the kernel normalises in one tile (longer rows run the torch reference)."""


@jit
def _decode_rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    K,
    stride_xm,
    stride_om,
    eps,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    # The weight does not depend on the previous kernel: requested before the wait.
    gamma = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    out = round_to(x * scale * gamma, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + offs, out, mask=mask)


def decode_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, pdl: bool | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` of a few ``[M, K]`` rows, one launch.

    Args:
        x: ``[M, K]`` rows (last dimension contiguous).
        weight: ``[K]`` norm weight.
        eps: Epsilon inside the square root.
        pdl: Launch with programmatic dependent launch where supported (None: inside
            :func:`mcore_kernels.pdl.programmatic_dependent_launch` only).

    Returns:
        ``[M, K]`` in the dtype of ``x``.

    Raises:
        KernelShapeError: If ``x`` is not 2-D or ``weight`` not ``[K]``.
        KernelDtypeError: If ``x`` is not a floating-point tensor.
    """
    if x.dim() != 2 or tuple(weight.shape) != (x.shape[1],):
        raise KernelShapeError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}; expected [M, K] and [K]"
        )
    if not x.dtype.is_floating_point:
        raise KernelDtypeError(f"x is {x.dtype}; expected a floating-point dtype")
    rows, k = x.shape
    if (
        not use_triton(x, weight)
        or k > DECODE_RMS_NORM_MAX_K
        or x.stride(1) != 1
        or not weight.is_contiguous()
    ):
        normed = rms_norm_reference(x, weight, eps)
        assert isinstance(normed, torch.Tensor)
        return normed
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0 or k == 0:
        return out
    use_pdl = pdl_enabled(x.device) if pdl is None else pdl and pdl_supported(x.device)
    _decode_rms_norm_kernel[(rows,)](
        x,
        weight,
        out,
        k,
        x.stride(0),
        out.stride(0),
        float(eps),
        BLOCK_K=next_power_of_2(k),
        USE_PDL=use_pdl,
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out
