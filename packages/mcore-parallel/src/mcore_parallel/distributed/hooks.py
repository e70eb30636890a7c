"""Bookkeeping of the forward pre-hooks that finish parameter all-gathers.

Production RL runs broke when hook removal walked the *live* module tree: modules added or
deleted after registration (CUDA-graph runners attached to layers) left orphaned handles or
raised ``KeyError``. Here the record of handles is the only source of truth: hooks are
registered on the modules that directly own bucketed parameters, every handle is remembered,
and disabling removes exactly the recorded handles.

The hooks know nothing of the data-parallel wrapper: they are given the module tree, the bucket
of every parameter and a callback that finishes one bucket's all-gather.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from mcore_parallel.distributed.buffers import Bucket

__all__ = ["ParamSyncHooks"]


class ParamSyncHooks:
    """Registers, records and removes the parameter-sync forward pre-hooks of one model.

    Enabling and disabling are idempotent, so calls always balance: ``enable`` twice leaves one
    hook per owner module, ``disable`` when nothing is registered does nothing and never
    raises. The record and the hooks keep modules and the callback's owner only through weak
    references, so neither a deleted module nor the wrapper is kept alive by a hook.

    Args:
        module: The root of the module tree to hook.
        param_bucket: The bucket of every parameter whose all-gather the hooks finish.
        finish_bucket: Called with a bucket before a module using its parameters runs; a bound
            method is held through a weak reference.
    """

    def __init__(
        self,
        module: nn.Module,
        param_bucket: Mapping[nn.Parameter, Bucket],
        finish_bucket: Callable[[Bucket], None],
    ) -> None:
        self._root = weakref.ref(module)
        self._param_bucket = param_bucket
        self._finish: Callable[[], Callable[[Bucket], None] | None]
        if hasattr(finish_bucket, "__self__"):
            self._finish = weakref.WeakMethod(finish_bucket)  # type: ignore[arg-type]
        else:
            self._finish = lambda: finish_bucket
        self._handles: list[RemovableHandle] = []
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    @property
    def enabled(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)

    def hooked_modules(self) -> list[nn.Module]:
        """Returns the modules that carry a hook now (alive ones only).

        Returns:
            The hooked modules, in no particular order.
        """
        return list(self._modules)

    def owners(self) -> list[nn.Module]:
        """Returns the modules of the current tree that directly own bucketed parameters.

        Returns:
            The modules, in ``modules()`` order.
        """
        root = self._root()
        if root is None:
            return []
        return [
            module
            for module in root.modules()
            if any(p in self._param_bucket for p in module.parameters(recurse=False))
        ]

    def enable(self) -> None:
        """Hooks exactly the current owner modules, one hook each.

        Recorded handles are removed first, so calling it again after the tree changed moves
        the hooks to the modules that own bucketed parameters now; calling it twice in a row
        leaves the same single hook per owner.
        """
        self.disable()
        handles: list[RemovableHandle] = []
        try:
            for module in self.owners():
                buckets = sorted(
                    {
                        self._param_bucket[p]
                        for p in module.parameters(recurse=False)
                        if p in self._param_bucket
                    },
                    key=lambda b: -b.index,
                )
                hook = functools.partial(_finish_buckets_hook, self._finish, tuple(buckets))
                handles.append(module.register_forward_pre_hook(hook))
                self._modules.add(module)
        except BaseException:
            for handle in handles:
                handle.remove()
            self._modules.clear()
            raise
        self._handles = handles

    def disable(self) -> None:
        """Removes exactly the recorded handles, whatever the module tree looks like now."""
        handles, self._handles = self._handles, []
        self._modules.clear()
        for handle in handles:
            handle.remove()


def _finish_buckets_hook(
    finish: Callable[[], Callable[[Bucket], None] | None],
    buckets: tuple[Bucket, ...],
    module: nn.Module,
    args: Any,
) -> None:
    callback = finish()
    if callback is None:
        return
    for bucket in buckets:
        callback(bucket)
