"""Bookkeeping of the forward pre-hooks that finish parameter all-gathers.

Production RL runs broke when hook removal walked the *live* module tree: modules added or
deleted after registration (CUDA-graph runners attached to layers) left orphaned handles or
raised ``KeyError`` (see ``seeds/rl-worker-lessons.md``). Here the record of handles is the
only source of truth: hooks are registered on the modules that directly own bucketed
parameters, every handle is remembered, and disabling removes exactly the recorded handles.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from mcore_parallel.distributed.buffers import Bucket
    from mcore_parallel.distributed.ddp import DistributedDataParallel

__all__ = ["ParamSyncHooks"]


class ParamSyncHooks:
    """Registers, records and removes the parameter-sync forward pre-hooks of one DDP.

    Enabling and disabling are idempotent, so calls always balance: ``enable`` twice leaves one
    hook per owner module, ``disable`` when nothing is registered does nothing and never
    raises. The record keeps modules only through weak references, so a module deleted from
    the tree is not kept alive by its hook.

    Args:
        ddp: The wrapper whose buckets the hooks synchronise.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._ddp = weakref.ref(ddp)
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
        ddp = self._ddp()
        if ddp is None:
            return []
        return [
            module
            for module in ddp.module.modules()
            if any(p in ddp.param_bucket for p in module.parameters(recurse=False))
        ]

    def enable(self) -> None:
        """Hooks exactly the current owner modules, one hook each.

        Recorded handles are removed first, so calling it again after the tree changed moves
        the hooks to the modules that own bucketed parameters now; calling it twice in a row
        leaves the same single hook per owner.
        """
        self.disable()
        ddp = self._ddp()
        if ddp is None:
            return
        handles: list[RemovableHandle] = []
        try:
            for module in self.owners():
                buckets = sorted(
                    {
                        ddp.param_bucket[p]
                        for p in module.parameters(recurse=False)
                        if p in ddp.param_bucket
                    },
                    key=lambda b: -b.index,
                )
                hook = functools.partial(_finish_param_sync_hook, self._ddp, tuple(buckets))
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


def _finish_param_sync_hook(
    ddp_ref: weakref.ref[DistributedDataParallel],
    buckets: tuple[Bucket, ...],
    module: nn.Module,
    args: Any,
) -> None:
    ddp = ddp_ref()
    if ddp is None:
        return
    for bucket in buckets:
        ddp.finish_param_sync(bucket)
