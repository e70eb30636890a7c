"""Batch-invariant GEMMs: every output row is computed the same way whatever the batch.

cuBLAS (and CPU BLAS) pick a different algorithm for a different number of rows ``M``: split-K
for a skinny matrix, another tile shape, a matrix-vector path for ``M = 1``. Each changes the
order in which a row's dot products are summed, so one row's result depends on how many other
rows share the call. Here one Triton kernel family (:mod:`mcore_kernels.batch_invariant.gemm`)
serves dense, batched (``bmm``) and grouped (MoE experts) products with a launch configuration
chosen from ``(N, K, dtype)`` only (:mod:`mcore_kernels.batch_invariant.gemm_configs`): a row is
reduced over ``K`` in ascending ``BLOCK_K`` chunks into a float32 accumulator, split over ``K``
only in pieces fixed by ``K`` whose partials are added in order, and its value does not depend
on which tile or group it shares with other rows.

All three take the second operand as ``b[G, K, N]`` (any strides) and the rows of ``a[M, K]``
in ``G`` consecutive groups; group ``g`` is multiplied by ``b[g]``:

- dense: ``G = 1``;
- batched: ``G`` groups of ``M / G`` rows (``torch.bmm``);
- grouped: group ends ``offsets[G]`` on the device (``torch._grouped_mm``), no host sync.

The torch reference (the CPU path) reaches the same property a different way: CPU BLAS takes
another path for fewer than 4 to 8 rows, so it multiplies fixed 16-row chunks (the last one
zero-padded); every BLAS call then has the same shape and a row's value depends on its own data
only. The two paths are each batch-invariant; they agree with each other to rounding.

Eager calls go through ``_InvariantMatmul``; while ``torch.compile`` traces a call it becomes the
custom op ``torch.ops.mcore_kernels.batch_invariant_matmul`` with the registered backward
``batch_invariant_matmul_bwd`` (the same ordinary GEMMs). The torch reference is
:func:`mcore_kernels.batch_invariant.reference.matmul_reference`.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels.batch_invariant.gemm import launch_gemm
from mcore_kernels.batch_invariant.gemm_configs import gemm_config
from mcore_kernels.batch_invariant.reference import REFERENCE_CHUNK_ROWS, matmul_reference
from mcore_kernels.errors import KernelDtypeError, KernelShapeError

__all__ = [
    "REFERENCE_CHUNK_ROWS",
    "bmm_batch_invariant",
    "grouped_mm_batch_invariant",
    "linear_batch_invariant",
    "matmul_reference",
    "mm_batch_invariant",
]

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _check(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.dtype not in _SUPPORTED or b.dtype != a.dtype:
        raise KernelDtypeError(
            f"{name}: a.dtype={a.dtype}, b.dtype={b.dtype}; expected one float dtype of "
            f"{_SUPPORTED}"
        )
    if a.device != b.device:
        raise KernelShapeError(f"{name}: a is on {a.device} and b on {b.device}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise KernelShapeError(
            f"{name}: a{tuple(a.shape)} and b{tuple(b.shape)}; expected a[M, K] and b[G, K, N]"
        )


def _launch(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    config = gemm_config(b.shape[2], a.shape[1], a.dtype, a.device)
    return launch_gemm(a, b, group_ends, rows_per_group, config)


def _grouped_forward(
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None,
    rows_per_group: int,
) -> torch.Tensor:
    if use_triton(a, b):
        return _launch(a, b, group_ends, rows_per_group)
    return matmul_reference(a, b, group_ends, rows_per_group)


class _InvariantMatmul(torch.autograd.Function):
    """Forward through the invariant kernel; backward with ordinary GEMMs (cuBLAS on the GPU).

    The backward needs no batch invariance: log-probs come from the forward, and the engine
    never computes a gradient. It needs determinism, which cuBLAS gives for a given shape, GPU
    and library version (the same algorithm is picked every time, and no algorithm torch uses
    for these products reduces with atomics); the ordinary kernels are 1.5-3x faster than
    the invariant ones.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        group_ends: torch.Tensor | None,
        rows_per_group: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(a, b, group_ends)
        ctx.rows_per_group = rows_per_group
        return _grouped_forward(a, b, group_ends, rows_per_group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        a, b, group_ends = ctx.saved_tensors
        grad_a, grad_b = _backward(ctx, a, b, group_ends, grad)
        return grad_a, grad_b, None, None


def _backward(
    ctx: Any, a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d a, d b)`` by ordinary GEMMs (``ctx`` has ``needs_input_grad`` and
    ``rows_per_group``), with batch-invariant mode suspended."""
    from mcore_kernels.batch_invariant.mode import suspended

    with suspended():
        if group_ends is None:
            return _uniform_backward(ctx, a, b, grad)
        return _grouped_backward(ctx, a, b, group_ends, grad)


def _uniform_backward(
    ctx: Any, a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of equal groups (dense, ``bmm``): one cuBLAS call each, no copies."""
    groups, rows = b.shape[0], ctx.rows_per_group
    grad_a = grad_b = None
    if groups == 1:
        if ctx.needs_input_grad[0]:
            grad_a = grad @ b[0].transpose(0, 1)
        if ctx.needs_input_grad[1]:
            if b.stride(1) == 1:
                # b is a linear layer's weight[N, K] seen as [K, N]: produce the gradient in the
                # weight's own layout, so that accumulating it needs no transposed copy.
                grad_b = (grad.transpose(0, 1) @ a).transpose(0, 1)[None]
            else:
                grad_b = (a.transpose(0, 1) @ grad)[None]
        return grad_a, grad_b
    grads = grad.reshape(groups, rows, grad.shape[-1])
    if ctx.needs_input_grad[0]:
        grad_a = torch.bmm(grads, b.transpose(1, 2)).reshape(a.shape)
    if ctx.needs_input_grad[1]:
        grad_b = torch.bmm(a.reshape(groups, rows, a.shape[-1]).transpose(1, 2), grads)
    return grad_a, grad_b


def _grouped_backward(
    ctx: Any, a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of variable groups (MoE experts), one product per non-empty group."""
    ends = [int(e) for e in group_ends.tolist()]
    grad_a = torch.zeros_like(a) if ctx.needs_input_grad[0] else None
    grad_b = torch.zeros_like(b) if ctx.needs_input_grad[1] else None
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            if grad_a is not None:
                grad_a[start:end] = grad[start:end] @ b[g].transpose(0, 1)
            if grad_b is not None:
                grad_b[g] = a[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return grad_a, grad_b


def grouped_mm_batch_invariant(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """Grouped GEMM ``a[rows of g] @ b[g]`` with a batch-invariant reduction order.

    The semantics of ``torch._grouped_mm(a, b, offs=group_ends)`` for 2-D ``a`` and 3-D ``b``.

    Args:
        a: ``[M, K]`` rows sorted by group.
        b: ``[G, K, N]``.
        group_ends: ``[G]`` integer end row (exclusive) of each group, non-decreasing.

    Returns:
        ``[M, N]``; rows after the last group end are not written by the Triton path
        (left as allocated) and zero on the torch path.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    _check(a, b, "grouped_mm_batch_invariant")
    if group_ends.dim() != 1 or group_ends.shape[0] != b.shape[0]:
        raise KernelShapeError(
            f"group_ends.shape={tuple(group_ends.shape)}; expected [{b.shape[0]}] (one per group)"
        )
    return _apply(a, b, group_ends.contiguous(), 0)


def mm_batch_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands with a batch-invariant reduction order.

    Args:
        a: ``[M, K]``.
        b: ``[K, N]``.

    Returns:
        ``[M, N]`` in ``a.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if b.dim() != 2:
        raise KernelShapeError(f"b.shape={tuple(b.shape)}; expected [K, N]")
    _check(a, b[None], "mm_batch_invariant")
    return _apply(a, b[None], None, a.shape[0])


def bmm_batch_invariant(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` with a batch-invariant reduction order.

    Args:
        a: ``[G, M, K]``.
        b: ``[G, K, N]``.

    Returns:
        ``[G, M, N]`` in ``a.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise KernelShapeError(
            f"a{tuple(a.shape)} and b{tuple(b.shape)}; expected a[G, M, K] and b[G, K, N]"
        )
    groups, rows, _ = a.shape
    flat = a.reshape(groups * rows, a.shape[2])
    _check(flat, b, "bmm_batch_invariant")
    out = _apply(flat, b, None, rows)
    return out.view(groups, rows, b.shape[2])


def linear_batch_invariant(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a batch-invariant reduction order.

    Args:
        x: ``[..., K]`` input.
        weight: ``[N, K]`` weight.
        bias: Optional ``[N]`` bias, added after the product.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        KernelShapeError: If the shapes do not fit.
        KernelDtypeError: If the dtypes are not one supported float dtype.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelShapeError(
            f"x.shape={tuple(x.shape)}, weight.shape={tuple(weight.shape)}; expected x[..., K] "
            "and weight[N, K]"
        )
    flat = x.reshape(-1, x.shape[-1])
    out = mm_batch_invariant(flat, weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _apply(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    if _compile.compiling():
        return _matmul_op(a, b, group_ends, rows_per_group)
    out = _InvariantMatmul.apply(a, b, group_ends, rows_per_group)
    assert isinstance(out, torch.Tensor)
    return out


# --- torch.compile: the custom ops -----------------------------------------------------------


@_compile.custom_op(
    "batch_invariant_matmul",
    "(Tensor a, Tensor b, Tensor? group_ends, int rows_per_group) -> Tensor",
)
def _matmul_op(
    a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor | None, rows_per_group: int
) -> torch.Tensor:
    return _grouped_forward(a, b, group_ends, rows_per_group).contiguous()


_matmul_op.register_fake(lambda a, b, *args: a.new_empty((a.shape[0], b.shape[2])))


class _Needs:
    """What the backward helpers read from an autograd context."""

    __slots__ = ("needs_input_grad", "rows_per_group")

    def __init__(self, rows_per_group: int) -> None:
        self.needs_input_grad = (True, True)
        self.rows_per_group = rows_per_group


@_compile.custom_op(
    "batch_invariant_matmul_bwd",
    "(Tensor grad, Tensor a, Tensor b, Tensor? group_ends, int rows_per_group) -> (Tensor, Tensor)",
)
def _matmul_bwd_op(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    group_ends: torch.Tensor | None,
    rows_per_group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_a, grad_b = _backward(_Needs(rows_per_group), a, b, group_ends, grad)
    assert grad_a is not None and grad_b is not None
    # Outputs may not alias inputs or each other, and take the fake implementation's layout.
    return grad_a.contiguous().clone(), grad_b.contiguous().clone()


_matmul_bwd_op.register_fake(lambda grad, a, b, *args: (a.new_empty(a.shape), b.new_empty(b.shape)))


def _setup_context(ctx, inputs, output):
    a, b, group_ends, rows_per_group = inputs
    ctx.save_for_backward(a, b, group_ends)
    ctx.rows_per_group = rows_per_group


def _op_backward(ctx, grad):
    a, b, group_ends = ctx.saved_tensors
    grad_a, grad_b = _matmul_bwd_op(grad, a, b, group_ends, ctx.rows_per_group)
    return grad_a, grad_b, None, None


_matmul_op.register_autograd(_op_backward, setup_context=_setup_context)
