"""Dropless routed SwiGLU experts as one autograd operation: permute, gate/up GEMM, weighted
SwiGLU, down GEMM and combine.

The same computation as chaining :func:`~mcore_kernels.moe.permute_tokens`, two
``torch._grouped_mm`` calls, :func:`~mcore_kernels.moe.weighted_swiglu` and
:func:`~mcore_kernels.moe.unpermute_sum`, with one autograd node instead of seven and the
routing weights read through each row's assignment (no gathered copy of them and no gather of
their gradient): less host work per step, the same kernels and GEMMs on the device. Every pass
reads through an index and writes each output element once (no atomics), so forward and
backward are bitwise reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._compile import register_function
from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.moe._launch import cdiv, launch, next_power_of_2
from mcore_kernels.moe.expert_gemms import ExpertGemmRunner, ExpertGemms
from mcore_kernels.moe.permute import _device, _gather_rows, _sum_rows
from mcore_kernels.moe.reference import routed_experts_reference
from mcore_kernels.moe.swiglu import _weighted_swiglu_grad_block

__all__ = ["grouped_experts", "routed_experts", "routed_experts_reference"]


@jit
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


@jit
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
    for start in range(0, width, BLOCK):
        cols = start + base
        ok = cols < width
        read = cols < limit
        acc = _weighted_swiglu_grad_block(
            gate_up_ptr, grad_ptr, out_ptr, row, width, cols, read, ok, weight, acc
        )
    # Rows without an assignment store their zero sum in a spare last entry of grad_w, which
    # the launcher allocates and drops.
    total = tl.sum(acc, axis=0).to(grad_w_ptr.dtype.element_ty)
    tl.store(grad_w_ptr + tl.where(used, assignment, num_assignments), total)


def _swiglu_launch_block(width: int) -> int:
    return min(1024, next_power_of_2(width))


def _routed_swiglu(
    gate_up: torch.Tensor, weights: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:

    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    if rows and width:
        block = _swiglu_launch_block(width)
        launch(
            routed_swiglu_forward_kernel,
            (rows, cdiv(width, block)),
            (gate_up, weights, order, out, width),
            dict(BLOCK=block),
            device=gate_up.device,
        )
    return out


def _routed_swiglu_backward(
    gate_up: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty_like(gate_up)
    # Assignments without a row (dropped) keep a zero gradient; one spare entry takes the
    # rows without an assignment.
    grad_w = torch.zeros(weights.numel() + 1, dtype=weights.dtype, device=weights.device)
    if rows and width:
        launch(
            routed_swiglu_backward_kernel,
            (rows,),
            (gate_up, weights, order, grad, out, grad_w, width, weights.numel()),
            dict(BLOCK=_swiglu_launch_block(width)),
            device=gate_up.device,
        )
    return out, grad_w[:-1]


class RoutedExpertsFunction(torch.autograd.Function):
    """Autograd operation of :func:`routed_experts` (Triton kernels and ``torch._grouped_mm``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weights: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        order: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        top_k: int,
        gemms: ExpertGemms | None = None,
        host_ends: Callable[[], list[int]] | None = None,
    ) -> torch.Tensor:
        """Gather, gate/up GEMM, weighted SwiGLU, down GEMM and sum of :func:`routed_experts`.

        Args:
            ctx: Autograd context; keeps the inputs, the gathered rows, the gate/up output and the
                activation, and the GEMM runner for the backward.
            x: ``[T, H]`` tokens (already in expert order when ``top_k`` is 0).
            weights: ``[T, top_k]`` routing weights.
            w_gate_up: ``[E, 2F, H]`` gate rows then up rows of each expert.
            w_down: ``[E, H, F]`` down projection of each expert.
            order: ``[M]`` int64 assignment in each row, -1 in a row without one.
            inverse: ``[T * top_k]`` int64 row of each assignment, -1 for one without a row.
            offsets: ``[E]`` int32 cumulative row counts of the experts.
            top_k: Assignments per token; 0 when ``x`` is already the ``[M, H]`` expert rows.
            gemms: Kernel of each expert GEMM, or None for ``torch._grouped_mm`` everywhere.
            host_ends: Returns ``offsets`` as a host list for cuBLAS loops, or None.

        Returns:
            ``[T, H]`` (``[M, H]`` when ``top_k`` is 0) in the dtype of ``x``.
        """
        flat_w = weights.reshape(-1)
        gemms = gemms if gemms is not None else ExpertGemms()
        with _device(x):
            # top_k 0: the rows are already in expert order (no gather and no combine).
            permuted = _gather_rows(x, order, top_k, None) if top_k else x
            run = ExpertGemmRunner(gemms, offsets, permuted.shape[0], host_ends)
            fused = run.gate_up_swiglu(permuted, w_gate_up, flat_w, order)
            if fused is None:
                gate_up = run.gate_up(permuted, w_gate_up)
                fused = gate_up, _routed_swiglu(gate_up, flat_w, order)
            gate_up, act = fused
            y = run.down(act, w_down)
            out = _sum_rows(y, inverse, top_k, None) if top_k else y
        ctx.save_for_backward(
            flat_w, w_gate_up, w_down, order, inverse, offsets, permuted, gate_up, act
        )
        ctx.top_k = top_k
        ctx.weights_shape = weights.shape
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Gradients of the tokens, routing weights and both expert weights, each only when needed.

        Args:
            ctx: Autograd context saved by :meth:`forward`.
            grad: Gradient of the output, shaped like it.

        Returns:
            ``(grad_x, grad_weights, grad_w_gate_up, grad_w_down)`` (each None when not needed)
            followed by None for the six non-differentiable inputs.
        """
        flat_w, w_gate_up, w_down, order, inverse, _, permuted, gate_up, act = ctx.saved_tensors
        top_k = ctx.top_k
        needs_x, needs_w, needs_gu, needs_down = ctx.needs_input_grad[:4]
        grad = grad.contiguous()
        grad_x = grad_w = grad_gu = grad_down = None
        run = ctx.run
        with _device(grad):
            grad_y = _gather_rows(grad, order, top_k, None) if top_k else grad
            if needs_down:
                grad_down = run.w_down(grad_y, act)
            fused = run.d_act_swiglu(grad_y, w_down, gate_up, flat_w, order)
            if fused is None:
                grad_act = run.d_act(grad_y, w_down)
                fused = _routed_swiglu_backward(gate_up, flat_w, order, grad_act)
                del grad_act
            del grad_y
            grad_gate_up, grad_flat_w = fused
            if needs_gu:
                grad_gu = run.w_gate_up(grad_gate_up, permuted)
            if needs_x:
                grad_perm = run.d_x(grad_gate_up, w_gate_up)
                grad_x = _sum_rows(grad_perm, inverse, top_k, None) if top_k else grad_perm
        if needs_w:
            grad_w = grad_flat_w.view(ctx.weights_shape)
        return grad_x, grad_w, grad_gu, grad_down, None, None, None, None, None, None


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    order: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    gemms: ExpertGemms | None = None,
    host_ends: Callable[[], list[int]] | None = None,
) -> torch.Tensor:
    """Run every routing assignment through its SwiGLU expert and sum each token's outputs.

    Assignment ``a`` is token ``a // top_k``; the rows of the experts' GEMMs are the
    assignments sorted by expert (``order``), expert ``e`` holding rows ``offsets[e-1]`` to
    ``offsets[e]``. Row ``r`` computes ``w[order[r]] * silu(x W_gate^T) * (x W_up^T)`` then its
    down projection; each token's ``top_k`` results are summed in float32. No host
    synchronisation. Dropless when every assignment has a row; for capacity routing the
    dropped assignments have none (``inverse`` -1, they count zero) and the rows past
    ``offsets[-1]`` hold no assignment (``order`` -1): they are neither computed by the GEMMs
    nor read. Uses ``torch._grouped_mm`` for the GEMMs (or the persistent Triton kernels that
    ``gemms`` names); on tensors the Triton kernels do
    not handle, the per-expert torch reference runs instead (a host sync).

    Args:
        x: ``[T, H]`` tokens.
        weights: ``[T, top_k]`` routing weights (differentiable).
        w_gate_up: ``[E, 2F, H]`` gate rows then up rows of each expert (differentiable).
        w_down: ``[E, H, F]`` down projection of each expert (differentiable).
        order: ``[M]`` int64 assignment in each row, -1 in a row without one: past
            ``offsets[-1]``, padding between experts
            (:func:`mcore_kernels.moe.rows.aligned_rows`) or an empty capacity slot (equal
            slots per expert for the batched GEMMs of
            :data:`~mcore_kernels.moe.expert_gemms.BATCHED`).
        inverse: ``[T * top_k]`` int64 row of each assignment (``inverse[order[r]] == r``), -1
            for an assignment without a row.
        offsets: ``[E]`` int32 cumulative row counts of the experts.
        gemms: Kernel of each expert GEMM (default: ``torch._grouped_mm`` for all six).
        host_ends: For plans with cuBLAS loops: returns ``offsets`` as a host list (e.g. from
            a copy started on the stream earlier, so the host waits while the gather and other
            queued kernels run); None reads ``offsets`` on the host when the first loop needs
            it.

    Returns:
        ``[T, H]`` in the dtype of ``x``.

    Raises:
        KernelShapeError: If the shapes do not match.
        KernelDtypeError: If an index has the wrong dtype.
    """
    if x.dim() != 2 or weights.dim() != 2 or weights.shape[0] != x.shape[0]:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)} and weights.shape={tuple(weights.shape)} must be "
            "[tokens, hidden] and [tokens, top_k]"
        )
    experts, two_ffn, hidden = w_gate_up.shape
    if hidden != x.shape[1] or tuple(w_down.shape) != (experts, hidden, two_ffn // 2):
        raise KernelShapeError(
            f"w_gate_up.shape={tuple(w_gate_up.shape)} and w_down.shape={tuple(w_down.shape)} "
            f"must be [E, 2F, {x.shape[1]}] and [E, {x.shape[1]}, F]"
        )
    for name, index in (("order", order), ("inverse", inverse)):
        rows_ok = index.dim() == 1 and (name == "order" or index.shape[0] == weights.numel())
        if index.dtype != torch.int64 or not rows_ok:
            shape = "(rows,)" if name == "order" else f"({weights.numel()},)"
            raise KernelDtypeError(
                f"{name} must be int64 of shape {shape}, got dtype {index.dtype} and shape "
                f"{tuple(index.shape)}"
            )
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (experts,):
        raise KernelDtypeError(
            f"offsets must be int32 of shape ({experts},), got dtype {offsets.dtype} and shape "
            f"{tuple(offsets.shape)}"
        )
    if not use_triton(x):
        return routed_experts_reference(x, weights, w_gate_up, w_down, order, offsets)
    args = (x.contiguous(), weights.contiguous(), w_gate_up, w_down, order, inverse, offsets)
    if _compile.compiling():
        # A plan is not an op argument: the traced op runs the default plan (torch._grouped_mm).
        return torch.ops.mcore_kernels.moe_routed_experts(*args, weights.shape[1])
    return RoutedExpertsFunction.apply(*args, weights.shape[1], gemms, host_ends)


def grouped_experts(
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    gemms: ExpertGemms | None = None,
) -> torch.Tensor:
    """The experts of :func:`routed_experts` alone, on rows already in expert order: ``w[r] *
    silu(x W_gate^T) * (x W_up^T)`` then the down projection, row by row (no gather, no
    combine).

    Args:
        rows: ``[M, H]`` rows sorted by expert.
        row_weights: ``[M]`` routing weight of each row (differentiable).
        w_gate_up: ``[E, 2F, H]``.
        w_down: ``[E, H, F]``.
        offsets: ``[E]`` int32 end row of each expert (``offsets[-1] == M``).
        gemms: Kernel of each expert GEMM (default: ``torch._grouped_mm`` for all six).

    Returns:
        ``[M, H]`` in the dtype of ``rows``.

    Raises:
        KernelShapeError: If the shapes do not match.
    """
    if rows.dim() != 2 or row_weights.shape != (rows.shape[0],):
        raise KernelShapeError(
            f"rows.shape={tuple(rows.shape)} and row_weights.shape={tuple(row_weights.shape)} "
            "must be [M, hidden] and [M]"
        )
    index = torch.arange(rows.shape[0], device=rows.device)
    return RoutedExpertsFunction.apply(
        rows.contiguous(),
        row_weights.contiguous(),
        w_gate_up,
        w_down,
        index,
        index,
        offsets,
        0,
        gemms if gemms is not None else ExpertGemms(),
    )


# --- torch.library: the op torch.compile traces (forward, and its backward through the
# Function's own gradients; see mcore_kernels._compile.register_function) ---------------

register_function(
    "moe_routed_experts",
    RoutedExpertsFunction,
    "Tensor x, Tensor weights, Tensor w_gate_up, Tensor w_down, Tensor order, "
    "Tensor inverse, Tensor offsets, int top_k",
    1,
    (0, 1, 2, 3),
    lambda x, *args: x.new_empty(x.shape),
)
