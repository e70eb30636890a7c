"""Sum the split-K partials of a projection, add the residual stream and RMS-normalise.

At decode over a few dozen rows cuBLAS runs a projection with a long reduction dimension (the
MLP's down projection, 4864 inputs for 896 outputs) as a split-K GEMM: float32 partial products
of slices of the inputs, then a reduction kernel, then the next layer's add + RMSNorm kernel.
Computing the partials with one batched GEMM of float32 output (:func:`split_k_partials`) and
this one kernel instead saves a launch per layer: it reads the partials, sums them in split
order, rounds the sum to the activation dtype (the projection's output, as cuBLAS rounds it),
adds the residual, rounds again, and normalises, with the roundings of
:func:`mcore_kernels.rms_norm` (``rms_norm(x, weight, eps, residual=residual)``).

Inside :func:`mcore_kernels.pdl.programmatic_dependent_launch` the kernel is launched with PDL
on devices that support it (it loads the norm weight before waiting for the GEMM).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    CachedLauncher,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    on_device_of,
    round_to,
    tl,
)
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import split_sum_add_rms_norm_reference

__all__ = ["split_k_partials", "split_sum_add_rms_norm", "split_sum_add_rms_norm_reference"]


def split_k_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """float32 partial products of ``x @ weight.T`` over ``splits`` equal slices of the inputs.

    One strided batched GEMM (``torch.bmm`` with a float32 output) reading ``x`` and ``weight``
    in place: slice ``s`` multiplies columns ``[s * K / splits, (s + 1) * K / splits)``.

    Args:
        x: ``[M, K]`` contiguous activations.
        weight: ``[N, K]`` contiguous weight (an ``nn.Linear`` weight).
        splits: Slices of ``K``; must divide it.

    Returns:
        float32 ``[splits, M, N]``.

    Raises:
        KernelShapeError: If the shapes do not match or ``splits`` does not divide ``K``.
        KernelValueError: If ``splits`` is below 1.
    """
    if splits < 1:
        raise KernelValueError(f"splits={splits}; expected at least 1")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)} and weight.shape={tuple(weight.shape)}; expected [M, K] "
            "and [N, K]"
        )
    rows, inputs = x.shape
    if inputs % splits:
        raise KernelShapeError(f"splits={splits} does not divide the {inputs} input columns")
    x, weight = x.contiguous(), weight.contiguous()
    chunk = inputs // splits
    a = x.as_strided((splits, rows, chunk), (chunk, inputs, 1))
    b = weight.as_strided((splits, chunk, weight.shape[0]), (chunk, 1, inputs))
    if x.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


@jit
def _split_sum_add_rms_norm_kernel(
    partials_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    rows,
    hidden,
    eps,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    r = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
    total = tl.load(partials_ptr + row * hidden + cols, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):
        offset = (split * rows + row) * hidden
        total += tl.load(partials_ptr + offset + cols, mask=mask, other=0.0)
    dtype = r.dtype
    x = round_to(round_to(total, dtype).to(tl.float32) + r.to(tl.float32), dtype)
    tl.store(hidden_out_ptr + row * hidden + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    tl.store(y_ptr + row * hidden + cols, round_to(h * rstd * w, dtype), mask=mask)


_LAUNCHER = CachedLauncher(_split_sum_add_rms_norm_kernel)
_LAUNCHER_PDL = CachedLauncher(_split_sum_add_rms_norm_kernel, launch_pdl=True)


def split_sum_add_rms_norm(
    partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(sum(partials).to(dtype), weight, eps, residual=residual)`` in one kernel.

    Args:
        partials: float32 ``[S, M, H]`` partial sums (:func:`split_k_partials`), summed in
            order ``0 .. S - 1``.
        residual: ``[M, H]`` residual stream (its dtype is the activation dtype).
        weight: ``[H]`` norm weight.
        eps: Norm epsilon.

    Returns:
        ``(normed, new_residual)``, both ``[M, H]`` in the residual's dtype.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If ``partials`` is not float32.
    """
    if partials.dim() != 3 or residual.shape != partials.shape[1:]:
        raise KernelShapeError(
            f"partials.shape={tuple(partials.shape)} and residual.shape="
            f"{tuple(residual.shape)}; expected [S, M, H] and [M, H]"
        )
    if weight.shape != (partials.shape[2],):
        raise KernelShapeError(
            f"weight.shape={tuple(weight.shape)}; expected ({partials.shape[2]},)"
        )
    if partials.dtype != torch.float32:
        raise KernelDtypeError(f"partials.dtype={partials.dtype}; expected torch.float32")
    if not use_triton(partials):
        return split_sum_add_rms_norm_reference(partials, residual, weight, eps)
    partials, residual, weight = partials.contiguous(), residual.contiguous(), weight.contiguous()
    splits, rows, hidden = partials.shape
    y = torch.empty_like(residual)
    new_residual = torch.empty_like(residual)
    if rows == 0:
        return y, new_residual
    pdl = pdl_enabled(partials.device)
    with on_device_of(partials):
        (_LAUNCHER_PDL if pdl else _LAUNCHER)(
            (rows,),
            (partials, residual, weight, y, new_residual, rows, hidden, float(eps)),
            {"SPLITS": splits, "BLOCK": next_power_of_2(hidden), "USE_PDL": pdl},
            4,
            partials.get_device() if partials.is_cuda else 0,
        )
    return y, new_residual
