"""What the kernels need to stay opaque to ``torch.compile``.

Dynamo traces Python, and Inductor re-emits any user-defined Triton kernel it finds in a traced
graph; that re-emission is a second compiler our kernels were never written for (it failed on
torch 2.11 with a ``CompilationError`` inside ``round_to``). Every public entry point therefore
checks :func:`compiling` and, while Dynamo traces it, calls a ``torch.library`` custom op
instead of the kernel: the graph holds one opaque node with a fake implementation (shapes and
dtypes only) and, for differentiable kernels, a registered backward, and the op's real
implementation is the eager entry point, run when the compiled graph executes. Outside
compilation nothing changes: the eager path pays one ``torch.compiler.is_compiling()`` call.

On a torch without ``torch.library.custom_op`` and ``register_autograd`` (older than 2.4, below
what mcore supports, kept as a guard) the entry points fall back to ``torch.compiler.disable``,
which makes Dynamo break the graph around the call and run it eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CUSTOM_OPS",
    "NAMESPACE",
    "compiling",
    "custom_op",
    "group_name",
    "resolve_group",
    "run_eagerly",
]

NAMESPACE = "mcore_kernels"
"""``torch.library`` namespace of the ops: ``torch.ops.mcore_kernels.<name>``."""

CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")
"""Whether this torch registers custom ops; when False (or set False) compiled callers graph-break."""


def compiling() -> bool:
    """Return True while Dynamo traces the caller (never while a compiled graph runs).

    Returns:
        ``torch.compiler.is_compiling()`` where it exists, else False.
    """
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def custom_op(name: str, schema: str, *, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Return a decorator registering a function as ``torch.ops.mcore_kernels.<name>``.

    The schema is spelled out rather than inferred from type hints, so that the registration
    reads the same on every supported torch release.

    Args:
        name: op name inside the ``mcore_kernels`` namespace.
        schema: the op's schema without its name, e.g. ``"(Tensor x) -> Tensor"``.
        mutates_args: names of the arguments the op writes in place.

    Returns:
        ``torch.library.custom_op(...)`` as a decorator; without custom ops, the identity.
    """
    if not CUSTOM_OPS:
        return lambda fn: fn
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args, schema=schema)


def run_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` outside the traced graph (a graph break): the fallback without custom ops.

    Args:
        fn: the eager entry point.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        Whatever ``fn`` returns.
    """
    return torch.compiler.disable(fn)(*args, **kwargs)


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
