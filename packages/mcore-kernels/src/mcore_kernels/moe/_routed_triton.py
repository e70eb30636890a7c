"""Triton kernels of :mod:`mcore_kernels.moe.routed`: SwiGLU reading each row's routing
weight through the row's assignment (no gathered copy of the weights)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["routed_swiglu_backward_kernel", "routed_swiglu_forward_kernel"]


@triton.jit
def routed_swiglu_forward_kernel(
    gate_up_ptr, w_ptr, order_ptr, out_ptr, width, BLOCK: tl.constexpr
):
    """``out[m] = w[order[m]] * silu(gate_up[m, :F]) * gate_up[m, F:]`` for one row block of
    columns (``w`` holds one weight per assignment, ``order[m]`` the assignment of row ``m``;
    a row without one, ``order[m] < 0``, is written as zeros without reading ``gate_up``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    assignment = tl.load(order_ptr + row)
    used = assignment >= 0
    # A row mask as a column bound (the interpreter rejects scalar-and-vector masks).
    limit = tl.where(used, width, 0)
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=cols < limit, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=cols < limit, other=0.0)
    weight = tl.load(w_ptr + tl.where(used, assignment, 0)).to(tl.float32)
    gate = gate.to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32) * tl.where(used, weight, 0.0)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def routed_swiglu_backward_kernel(
    gate_up_ptr,
    w_ptr,
    order_ptr,
    grad_ptr,
    out_ptr,
    grad_w_ptr,
    width,
    num_assignments,
    BLOCK: tl.constexpr,
):
    """Gradients of :func:`routed_swiglu_forward_kernel` for one row: ``gate_up`` (``[2F]``)
    and the weight of the row's assignment, written at that assignment in the weights' dtype (a
    float32 sum over the row in one program, rounded once; every assignment has at most one
    row, so each is written once: no atomics). A row without an assignment gets a zero
    gradient and reads nothing."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.arange(0, BLOCK)
    assignment = tl.load(order_ptr + row)
    used = assignment >= 0
    limit = tl.where(used, width, 0)
    weight = tl.load(w_ptr + tl.where(used, assignment, 0)).to(tl.float32)
    weight = tl.where(used, weight, 0.0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    dtype = out_ptr.dtype.element_ty
    for start in range(0, width, BLOCK):
        cols = start + base
        ok = cols < width
        read = cols < limit
        gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=read, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=read, other=0.0).to(
            tl.float32
        )
        grad = tl.load(grad_ptr + row * width + cols, mask=read, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        acc += grad * silu * up
        scaled = grad * weight
        d_gate = scaled * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(out_ptr + row * 2 * width + cols, d_gate.to(dtype), mask=ok)
        tl.store(out_ptr + row * 2 * width + width + cols, (scaled * silu).to(dtype), mask=ok)
    # Rows without an assignment store their zero sum in a spare last entry of grad_w, which
    # the launcher allocates and drops.
    total = tl.sum(acc, axis=0).to(grad_w_ptr.dtype.element_ty)
    tl.store(grad_w_ptr + tl.where(used, assignment, num_assignments), total)
