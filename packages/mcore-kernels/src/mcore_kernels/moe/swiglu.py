"""Fused SwiGLU of the MoE experts' gate/up GEMM output: ``silu(gate) * up``.

The gate/up projection runs as one GEMM whose ``[M, 2F]`` output holds the gate columns then
the up columns; one kernel reads both halves once and writes the ``[M, F]`` activation (torch
needs three passes), and one backward kernel writes the ``[M, 2F]`` gradient from the saved
GEMM output. :func:`weighted_swiglu` also scales every row by its routing weight (the MoE
combine's weights moved before the down projection, which is linear): its backward gives the
weight gradients from the same pass over the row, so the combine needs no gradient of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._compile import register_function
from mcore_kernels._triton_utils import gdc_launch_dependents, gdc_wait, jit, tl
from mcore_kernels.errors import KernelShapeError
from mcore_kernels.moe.reference import swiglu_reference, weighted_swiglu_reference
from mcore_kernels.pdl import pdl_enabled

__all__ = ["swiglu", "weighted_swiglu"]


@jit
def _gate_up(gate_up_ptr, row, width, cols, mask):
    """Columns ``cols`` of row ``row``'s gate and up halves of a ``[M, 2F]`` GEMM output, in
    float32 (zero where ``mask`` is false)."""
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@jit
def _weighted_swiglu_grad_block(
    gate_up_ptr, grad_ptr, out_ptr, row, width, cols, read, ok, weight, acc
):
    """One column block of the gradient of ``weight * silu(gate) * up`` for row ``row``: stores
    the ``gate_up`` gradient at ``cols`` (where ``ok``; what ``read`` masks out reads as zero)
    and returns ``acc`` plus ``grad * silu(gate) * up``, the block's weight-gradient terms."""
    gate, up = _gate_up(gate_up_ptr, row, width, cols, read)
    grad = tl.load(grad_ptr + row * width + cols, mask=read, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    acc += grad * silu * up
    scaled = grad * weight
    d_gate = scaled * up * sig * (1.0 + gate * (1.0 - sig))
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * 2 * width + cols, d_gate.to(dtype), mask=ok)
    tl.store(out_ptr + row * 2 * width + width + cols, (scaled * silu).to(dtype), mask=ok)
    return acc


@jit
def swiglu_forward_kernel(
    gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False
):
    """``out[m] = silu(gate_up[m, :F]) * gate_up[m, F:]`` for one row block of columns.

    ``USE_PDL``: launched with programmatic dependent launch; wait for the previous kernel (the
    gate/up GEMM) before reading its output or writing anything."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate, up = _gate_up(gate_up_ptr, row, width, cols, ok)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def swiglu_backward_kernel(gate_up_ptr, grad_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """Gradient of :func:`swiglu_forward_kernel` with respect to ``gate_up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate, up = _gate_up(gate_up_ptr, row, width, cols, ok)
    grad = tl.load(grad_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = grad * silu
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * 2 * width + cols, d_gate.to(dtype), mask=ok)
    tl.store(out_ptr + row * 2 * width + width + cols, d_up.to(dtype), mask=ok)


@jit
def weighted_swiglu_forward_kernel(gate_up_ptr, w_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """``out[m] = w[m] * silu(gate_up[m, :F]) * gate_up[m, F:]`` for one row block of columns."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate, up = _gate_up(gate_up_ptr, row, width, cols, ok)
    weight = tl.load(w_ptr + row).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up * weight
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def weighted_swiglu_backward_kernel(
    gate_up_ptr, w_ptr, grad_ptr, out_ptr, grad_w_ptr, width, BLOCK: tl.constexpr
):
    """Gradients of :func:`weighted_swiglu_forward_kernel` for one row: ``gate_up`` (``[2F]``)
    and the row weight (a float32 sum over the row's columns in one program: no atomics)."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.arange(0, BLOCK)
    weight = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + base
        ok = cols < width
        acc = _weighted_swiglu_grad_block(
            gate_up_ptr, grad_ptr, out_ptr, row, width, cols, ok, ok, weight, acc
        )
    tl.store(grad_w_ptr + row, tl.sum(acc, axis=0))


def _launch(
    kernel: Any, gate_up: torch.Tensor, *args: torch.Tensor, out: torch.Tensor, pdl: bool = False
) -> None:
    """Launch a row-by-column-block kernel; ``pdl``: with programmatic dependent launch (the
    kernel takes ``USE_PDL``)."""
    import triton

    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if rows == 0 or width == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    grid = (rows, triton.cdiv(width, block))
    options: dict[str, Any] = {"USE_PDL": True, "launch_pdl": True} if pdl else {}
    if gate_up.is_cuda:
        with torch.cuda.device(gate_up.device):
            kernel[grid](gate_up, *args, out, width, BLOCK=block, **options)
    else:
        kernel[grid](gate_up, *args, out, width, BLOCK=block, **options)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper of the fused SwiGLU kernels."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of every row (with PDL inside a programmatic-launch region).

        Args:
            ctx: Autograd context; keeps ``gate_up`` for the backward.
            gate_up: ``[M, 2F]`` contiguous, the gate columns first.

        Returns:
            ``[M, F]`` in the dtype of ``gate_up``.
        """
        ctx.save_for_backward(gate_up)
        if not use_triton(gate_up):
            return swiglu_reference(gate_up)
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        # Inside mcore_kernels.pdl.programmatic_dependent_launch (the engine's decode steps).
        _launch(swiglu_forward_kernel, gate_up, out=out, pdl=pdl_enabled(gate_up.device))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        """Gradient of ``gate_up`` from the saved input, computed in float32.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[M, F]`` gradient of the activation.

        Returns:
            ``[M, 2F]`` gradient of ``gate_up`` in its dtype.
        """
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        if not use_triton(gate_up, grad):
            with torch.enable_grad():
                leaf = gate_up.detach().requires_grad_(True)
                (result,) = torch.autograd.grad(swiglu_reference(leaf), leaf, grad)
            return result
        out = torch.empty_like(gate_up)
        _launch(swiglu_backward_kernel, gate_up, grad, out=out)
        return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up GEMM output, fused forward and backward.

    Args:
        gate_up: ``[M, 2F]`` with the gate columns first (a contiguous copy is made if needed).

    Returns:
        ``[M, F]`` in the dtype of ``gate_up`` (computed in float32).

    Raises:
        KernelShapeError: If ``gate_up`` is not 2-D with an even number of columns.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise KernelShapeError(
            f"gate_up.shape={tuple(gate_up.shape)} must be [rows, 2 * ffn] (gate then up)"
        )
    if _compile.compiling():
        return torch.ops.mcore_kernels.moe_swiglu(gate_up.contiguous())
    return SwiGLUFunction.apply(gate_up.contiguous())


class WeightedSwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper of the weighted SwiGLU kernels."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``w[m] * silu(gate) * up`` of every row.

        Args:
            ctx: Autograd context; keeps ``gate_up`` and ``weights`` for the backward.
            gate_up: ``[M, 2F]`` contiguous, the gate columns first.
            weights: ``[M]`` contiguous weight of each row.

        Returns:
            ``[M, F]`` in the dtype of ``gate_up``.
        """
        ctx.save_for_backward(gate_up, weights)
        if not use_triton(gate_up, weights):
            return weighted_swiglu_reference(gate_up, weights)
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        _launch(weighted_swiglu_forward_kernel, gate_up, weights, out=out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of ``gate_up`` and of the row weights in one pass over each row.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: ``[M, F]`` gradient of the activation.

        Returns:
            ``(grad_gate_up [M, 2F], grad_weights [M])`` in the dtypes of the inputs.
        """
        gate_up, weights = ctx.saved_tensors
        grad = grad.contiguous()
        if not use_triton(gate_up, weights, grad):
            with torch.enable_grad():
                leaf = gate_up.detach().requires_grad_(True)
                w = weights.detach().requires_grad_(True)
                result = torch.autograd.grad(weighted_swiglu_reference(leaf, w), (leaf, w), grad)
            return result[0], result[1]
        import triton

        out = torch.empty_like(gate_up)
        grad_w = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        if rows and width:
            block = min(1024, triton.next_power_of_2(width))
            with _on(gate_up):
                weighted_swiglu_backward_kernel[(rows,)](
                    gate_up, weights, grad, out, grad_w, width, BLOCK=block
                )
        elif rows:
            grad_w.zero_()
        return out, grad_w.to(weights.dtype)


def _on(tensor: torch.Tensor) -> Any:
    import contextlib

    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def weighted_swiglu(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``w[m] * silu(gate) * up`` of every row, fused forward and backward.

    Args:
        gate_up: ``[M, 2F]`` with the gate columns first (a contiguous copy is made if needed).
        weights: ``[M]`` weight of each row (its gradient is returned in its dtype).

    Returns:
        ``[M, F]`` in the dtype of ``gate_up`` (computed in float32).

    Raises:
        KernelShapeError: If ``gate_up`` is not 2-D with an even number of columns or
            ``weights`` is not ``[M]``.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise KernelShapeError(
            f"gate_up.shape={tuple(gate_up.shape)} must be [rows, 2 * ffn] (gate then up)"
        )
    if tuple(weights.shape) != (gate_up.shape[0],):
        raise KernelShapeError(
            f"weights.shape={tuple(weights.shape)} must be ({gate_up.shape[0]},): one per row"
        )
    if _compile.compiling():
        return torch.ops.mcore_kernels.moe_weighted_swiglu(
            gate_up.contiguous(), weights.contiguous()
        )
    return WeightedSwiGLUFunction.apply(gate_up.contiguous(), weights.contiguous())


# --- torch.library: the op torch.compile traces (forward, and its backward through the
# Function's own gradients; see mcore_kernels._compile.register_function) ---------------


def _half_width(gate_up: torch.Tensor, *args: object) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


register_function("moe_swiglu", SwiGLUFunction, "Tensor gate_up", 1, (0,), _half_width)
register_function(
    "moe_weighted_swiglu",
    WeightedSwiGLUFunction,
    "Tensor gate_up, Tensor weights",
    1,
    (0, 1),
    _half_width,
)
