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
    "register_function",
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


def register_function(
    name: str,
    function: type[torch.autograd.Function],
    arguments: str,
    outputs: int,
    differentiable: tuple[int, ...],
    fake: Callable,
) -> Callable:
    """Register an ``autograd.Function`` as the custom op ``torch.ops.mcore_kernels.<name>``.

    The forward op runs ``function.apply`` without autograd; the registered backward is the op
    ``<name>_bwd``, which runs ``function.apply`` again with autograd recording (inside the op)
    and returns ``torch.autograd.grad`` of it, i.e. the Function's own backward after a
    recomputation of its forward. Only ``torch.compile`` goes through these ops (eager calls
    apply the Function directly), so the recomputation costs nothing outside compiled graphs.

    Args:
        name: op name inside the ``mcore_kernels`` namespace.
        function: the ``autograd.Function``; every output must be a fresh tensor.
        arguments: the op's arguments in schema form, in ``function.apply``'s order, e.g.
            ``"Tensor x, Tensor rows, int top_k"``.
        outputs: number of tensor outputs of ``function``.
        differentiable: positions of the arguments that get gradients (tensors).
        fake: the forward's fake implementation (shapes and dtypes of the outputs).

    Returns:
        The forward op.
    """
    returns = "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    forward_op = custom_op(name, f"({arguments}) -> {returns}")

    def forward(*args):
        with torch.no_grad():
            return function.apply(*args)

    forward_op = forward_op(forward)
    forward_op.register_fake(fake)

    def backward_impl(grads, *args):
        with autograd_inside_op():
            inputs = list(args)
            leaves = []
            for index in differentiable:
                inputs[index] = args[index].detach().requires_grad_()
                leaves.append(inputs[index])
            results = function.apply(*inputs)
            results = results if isinstance(results, tuple) else (results,)
            pairs = [
                (out, grad)
                for out, grad in zip(results, grads, strict=True)
                if grad is not None and out.requires_grad
            ]
            found = torch.autograd.grad(
                [out for out, _ in pairs], leaves, [grad for _, grad in pairs], allow_unused=True
            )
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(found, leaves)]

    backward_op = custom_op(f"{name}_bwd", f"(Tensor?[] grads, {arguments}) -> Tensor[]")(
        backward_impl
    )
    backward_op.register_fake(
        lambda grads, *args: [args[i].new_empty(args[i].shape) for i in differentiable]
    )

    def setup_context(ctx, inputs, output):
        tensors = [i for i, arg in enumerate(inputs) if isinstance(arg, torch.Tensor)]
        ctx.tensor_positions = tensors
        ctx.others = [None if isinstance(arg, torch.Tensor) else arg for arg in inputs]
        ctx.save_for_backward(*(inputs[i] for i in tensors))

    def backward(ctx, *grads):
        args = list(ctx.others)
        for index, tensor in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            args[index] = tensor
        found = backward_op(list(grads), *args)
        result: list = [None] * len(args)
        for index, grad in zip(differentiable, found, strict=True):
            result[index] = grad
        return tuple(result)

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op
