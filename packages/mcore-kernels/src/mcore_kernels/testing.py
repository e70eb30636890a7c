"""Test helpers: a probe for aten ops that read device values back to the host.

On CUDA such a read (``.item()``, ``int(t)``, ``bool(t)``, ``torch.nonzero``, a boolean mask
...) waits for the device: a synchronisation that stalls a decode loop or breaks CUDA-graph
capture. :class:`HostReadProbe` sees the same ops on the CPU, where a test runs without a GPU,
so a test can assert that a code path reads nothing back.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReadProbe"]


class HostReadProbe(TorchDispatchMode):
    """Records every aten op that copies a device value to the host (a sync on CUDA).

    A dispatch mode: use it as a context manager around the code under test; every op in
    :attr:`READS` that runs inside it is appended, by name, to :attr:`seen`. Ops that only
    read a tensor's metadata (shape, dtype, device) or stay on the device are not recorded.
    On a CPU tensor ``.cpu()``, ``.tolist()`` and ``.numpy()`` never reach the dispatcher, and
    boolean-mask indexing arrives as ``aten.index``: the probe does not see these.

    Example::

        with HostReadProbe() as probe:
            step()
        assert probe.seen == []

    Attributes:
        READS: The aten overloads whose result depends on device data read on the host: the
            scalar read behind ``.item()``/``int()``/``bool()``, and ops whose output shape or
            Python result depends on the values (``nonzero``, ``masked_select``,
            ``unique_consecutive``, ``repeat_interleave`` with tensor repeats, ``equal``,
            ``allclose``, ``is_nonzero``).
        seen: The names of the recorded ops, in the order they ran.
    """

    READS: ClassVar[frozenset[Any]] = frozenset(
        {
            torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.nonzero.default,
            torch.ops.aten.is_nonzero.default,
            torch.ops.aten.equal.default,
            torch.ops.aten.allclose.default,
            torch.ops.aten.masked_select.default,
            torch.ops.aten.unique_consecutive.default,
            torch.ops.aten.repeat_interleave.Tensor,
        }
    )

    def __init__(self) -> None:
        """Starts with nothing seen."""
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Records ``func`` when it is a host read, then runs it unchanged.

        Args:
            func: The aten overload being dispatched.
            types: The tensor subclasses taking part (unused).
            args: Its positional arguments.
            kwargs: Its keyword arguments, or None.

        Returns:
            What ``func`` returns.
        """
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
