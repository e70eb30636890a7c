"""SwiGLU of separate gate and up projections, ``silu(gate) * up``, fused forward and backward.

The unfused activation runs ``silu`` and a product forward (saving ``silu(gate)`` as a third
activation for the backward) and three passes backward. Here one kernel reads both inputs and
writes the product, and one backward kernel reads the two saved inputs and the gradient and
writes both input gradients. Computed in float32 and rounded once to the input dtype, like the
fused kernels of the inference engine (``mcore_kernels.moe.swiglu`` on a fused gate/up GEMM).

Eager calls go to the launchers through :class:`_SwiGLUPairFunction`; while ``torch.compile``
traces a call it becomes the custom op ``torch.ops.mcore_kernels.swiglu_pair_fwd`` with the
registered backward ``swiglu_pair_bwd``. The torch reference is
:func:`mcore_kernels.reference.swiglu_pair_reference`; its autograd is the backward of the
torch dispatch.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import CachedLauncher, jit, on_device_of, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.reference import swiglu_pair_reference

__all__ = ["swiglu_pair"]

_BLOCK = 2048


@jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def _swiglu_bwd_kernel(gate_ptr, up_ptr, grad_ptr, d_gate_ptr, d_up_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    d_gate = grad * u * sig * (1.0 + g * (1.0 - sig))
    d_up = grad * g * sig
    dtype = d_gate_ptr.dtype.element_ty
    tl.store(d_gate_ptr + offs, d_gate.to(dtype), mask=ok)
    tl.store(d_up_ptr + offs, d_up.to(dtype), mask=ok)


_FORWARD = CachedLauncher(_swiglu_fwd_kernel)
_BACKWARD = CachedLauncher(_swiglu_bwd_kernel)


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of contiguous inputs: the Triton kernel, or the torch reference."""
    if not use_triton(gate):
        return swiglu_pair_reference(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        with on_device_of(gate):
            grid = (-(-n // _BLOCK),)
            _FORWARD(grid, (gate, up, out, n), {"BLOCK": _BLOCK}, 4, gate.get_device())
    return out


def _backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)``: the Triton kernel, or autograd of the torch reference."""
    grad = grad.contiguous()
    if not use_triton(gate):
        # Also inside the custom op, where autograd does not record without this.
        with _compile.autograd_inside_op():
            g = gate.detach().requires_grad_(True)
            u = up.detach().requires_grad_(True)
            d_gate, d_up = torch.autograd.grad(swiglu_pair_reference(g, u), (g, u), grad)
        return d_gate, d_up
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        with on_device_of(gate):
            args = (gate, up, grad, d_gate, d_up, n)
            grid = (-(-n // _BLOCK),)
            _BACKWARD(grid, args, {"BLOCK": _BLOCK}, 4, gate.get_device())
    return d_gate, d_up


class _SwiGLUPairFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _backward(grad, gate, up)


# --- torch.compile: the custom ops -----------------------------------------------------------


@_compile.custom_op("swiglu_pair_fwd", "(Tensor gate, Tensor up) -> Tensor")
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate.contiguous(), up.contiguous())


@_compile.custom_op("swiglu_pair_bwd", "(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)")
def _swiglu_bwd_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    d_gate, d_up = _backward(grad, gate.contiguous(), up.contiguous())
    return d_gate.contiguous(), d_up.contiguous()


@_swiglu_fwd_op.register_fake
def _swiglu_fwd_fake(gate, up):
    return gate.new_empty(gate.shape)


@_swiglu_bwd_op.register_fake
def _swiglu_bwd_fake(grad, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return _swiglu_bwd_op(grad, gate, up)


_swiglu_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def swiglu_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of separate gate and up projections, fused forward and backward.

    Args:
        gate: Output of the gate projection (a contiguous copy is made if needed).
        up: Output of the up projection, same shape and dtype.

    Returns:
        The activation, shaped and typed like ``gate`` (computed in float32, rounded once).
        Under ``torch.compile`` the call is the opaque custom op
        ``torch.ops.mcore_kernels.swiglu_pair_fwd`` (with a registered backward).

    Raises:
        KernelShapeError: If the shapes differ.
        KernelDtypeError: If the dtypes differ or are not floating point.
    """
    if gate.shape != up.shape:
        raise KernelShapeError(
            f"gate.shape={tuple(gate.shape)} and up.shape={tuple(up.shape)} must be equal"
        )
    if gate.dtype != up.dtype or not gate.dtype.is_floating_point:
        raise KernelDtypeError(
            f"gate.dtype={gate.dtype} and up.dtype={up.dtype} must be one floating-point dtype"
        )
    if _compile.compiling():
        return _swiglu_fwd_op(gate, up)
    result = _SwiGLUPairFunction.apply(gate.contiguous(), up.contiguous())
    assert isinstance(result, torch.Tensor)
    return result
