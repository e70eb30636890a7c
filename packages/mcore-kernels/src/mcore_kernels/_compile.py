"""What the kernels need to stay opaque to ``torch.compile``.

Dynamo traces Python, and Inductor re-emits any user-defined Triton kernel it finds in a traced
graph; that re-emission is a second compiler our kernels were never written for (it failed on
torch 2.11 with a ``CompilationError`` inside ``round_to``). Every public entry point therefore
checks :func:`compiling` and, while Dynamo traces it, calls a ``torch.library`` custom op
instead of the kernel: the graph holds one opaque node with a fake implementation (shapes and
dtypes only) and, for differentiable kernels, a registered backward; the op picks the Triton
kernel or the torch reference when the compiled graph runs. Outside compilation the custom ops
are never called: an eager call pays one ``torch.compiler.is_compiling()`` check and none of the
dispatcher's custom-op overhead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "NAMESPACE",
    "autograd_inside_op",
    "compiling",
    "custom_op",
    "group_name",
    "resolve_group",
]

NAMESPACE = "mcore_kernels"
"""``torch.library`` namespace of the ops: ``torch.ops.mcore_kernels.<name>``."""

compiling: Callable[[], bool] = torch.compiler.is_compiling
"""Return True while Dynamo traces the caller (never while a compiled graph runs)."""


def custom_op(name: str, schema: str, *, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Return a decorator registering a function as ``torch.ops.mcore_kernels.<name>``.

    The schema is spelled out rather than inferred from type hints, so that the registration
    reads the same on every supported torch release.

    Args:
        name: op name inside the ``mcore_kernels`` namespace.
        schema: the op's schema without its name, e.g. ``"(Tensor x) -> Tensor"``.
        mutates_args: names of the arguments the op writes in place.

    Returns:
        ``torch.library.custom_op(...)`` as a decorator.
    """
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args, schema=schema)


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Let autograd record inside a custom op's implementation.

    A custom op's implementation runs below the autograd dispatch keys, so ``enable_grad``
    alone records nothing there. The backward ops of the torch dispatch differentiate the torch
    reference (instead of keeping a second, hand-written backward formula) and need it back.

    Yields:
        Nothing; autograd records inside the block.
    """
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (
        torch._C.DispatchKey.AutogradCPU,
        torch._C.DispatchKey.AutogradCUDA,
        torch._C.DispatchKey.ADInplaceOrView,
    ):
        excluded = excluded.remove(key)
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded), torch.enable_grad():
        yield


def group_name(group: dist.ProcessGroup | None) -> str:
    """Return the name that identifies ``group`` inside an op schema (``""`` for None).

    Args:
        group: a process group or None.

    Returns:
        ``group.group_name``, or the empty string.
    """
    return "" if group is None else group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """Return the process group registered under ``name`` (None for ``""``).

    Args:
        name: a name returned by :func:`group_name`.

    Returns:
        The process group, or None.
    """
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]
