"""The batch-invariant mode: a context manager that routes torch's GEMMs to invariant kernels.

Inside ``batch_invariant_mode()`` a ``TorchFunctionMode`` replaces ``F.linear``, ``torch.mm``,
``torch.addmm``, ``torch.bmm``, ``torch.matmul`` (and ``@``) with a 2-D or batched second
operand, and ``torch._grouped_mm`` by the kernels of :mod:`mcore_kernels.batch_invariant.matmul`,
so the linear layers of any model (dense, tensor-parallel, MoE experts and router) give each row
a value that does not depend on the other rows of the call. Other ops pass through: row-wise
ops (RMSNorm, softmax, log-softmax, the token log-prob kernel) already reduce each row on its
own. Attention is not a torch op here; models ask :func:`is_batch_invariant` and call
:func:`mcore_kernels.batch_invariant.attention_batch_invariant` themselves.

The mode is thread-local, nests, and is restored on exit (also on exceptions); the backward
pass of the replaced ops runs ordinary GEMMs (gradients need no invariance).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mcore_kernels.batch_invariant.matmul import (
    _SUPPORTED,
    bmm_batch_invariant,
    grouped_mm_batch_invariant,
    linear_batch_invariant,
    mm_batch_invariant,
)

__all__ = ["batch_invariant_mode", "is_batch_invariant"]

_local = threading.local()


def is_batch_invariant() -> bool:
    """Whether the calling thread is inside :func:`batch_invariant_mode`.

    Returns:
        True inside an enabled ``batch_invariant_mode()`` block.
    """
    return getattr(_local, "depth", 0) > 0


def _floats(*tensors: Any) -> bool:
    return (
        all(
            isinstance(t, torch.Tensor) and t.dtype in _SUPPORTED and not t.is_complex()
            for t in tensors
        )
        and len({t.dtype for t in tensors}) == 1
    )


def _linear(x: Any, weight: Any, bias: Any = None) -> Any:
    if not _floats(x, weight) or weight.dim() != 2 or (bias is not None and not _floats(bias)):
        return NotImplemented
    return linear_batch_invariant(x, weight, bias)


def _mm(a: Any, b: Any, **kwargs: Any) -> Any:
    if kwargs or not _floats(a, b) or a.dim() != 2 or b.dim() != 2:
        return NotImplemented
    return mm_batch_invariant(a, b)


def _addmm(bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1, **kwargs: Any) -> Any:
    if kwargs or beta != 1 or alpha != 1 or not _floats(bias, a, b) or a.dim() != 2:
        return NotImplemented
    return mm_batch_invariant(a, b) + bias


def _bmm(a: Any, b: Any, **kwargs: Any) -> Any:
    if kwargs or not _floats(a, b) or a.dim() != 3 or b.dim() != 3:
        return NotImplemented
    return bmm_batch_invariant(a, b)


def _matmul(a: Any, b: Any, **kwargs: Any) -> Any:
    if kwargs or not _floats(a, b) or a.dim() < 2:
        return NotImplemented
    if b.dim() == 2:
        out = mm_batch_invariant(a.reshape(-1, a.shape[-1]), b)
        return out.view(*a.shape[:-1], b.shape[1])
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        return bmm_batch_invariant(a, b)
    return NotImplemented


def _grouped_mm(a: Any, b: Any, *args: Any, offs: Any = None, **kwargs: Any) -> Any:
    if args or kwargs or offs is None or not _floats(a, b) or a.dim() != 2 or b.dim() != 3:
        return NotImplemented
    return grouped_mm_batch_invariant(a, b, offs)


def _handlers() -> dict[Callable[..., Any], Callable[..., Any]]:
    table: dict[Callable[..., Any], Callable[..., Any]] = {
        F.linear: _linear,
        torch.mm: _mm,
        torch.Tensor.mm: _mm,
        torch.addmm: _addmm,
        torch.bmm: _bmm,
        torch.Tensor.bmm: _bmm,
        torch.matmul: _matmul,
        torch.Tensor.matmul: _matmul,
        torch.Tensor.__matmul__: _matmul,
    }
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:
        table[grouped] = _grouped_mm
    return table


_HANDLERS = _handlers()


class _BatchInvariantFunctions(TorchFunctionMode):
    """Routes the GEMM entry points of torch to the batch-invariant kernels."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None and not getattr(_local, "suspended", False):
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Let the GEMMs of this block run the ordinary kernels (backward recomputation).

    Yields:
        Nothing.
    """
    previous = getattr(_local, "suspended", False)
    _local.suspended = True
    try:
        yield
    finally:
        _local.suspended = previous


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the block in batch-invariant mode (a no-op when ``enabled`` is False).

    Nested blocks are allowed; leaving the outermost one restores the previous state, also
    when the block raises.

    Args:
        enabled: Whether to enter the mode.

    Yields:
        Nothing.
    """
    if not enabled or is_batch_invariant():
        yield
        return
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with _BatchInvariantFunctions():
            yield
    finally:
        _local.depth -= 1
