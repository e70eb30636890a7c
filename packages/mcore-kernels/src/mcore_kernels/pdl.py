"""Programmatic dependent launch (PDL) of the decode kernels, switched on by a context.

A GPU runs the kernels of a stream one after the other: the next kernel's programs start only
once the previous kernel has finished and its writes are flushed, then each must wait for its
first loads. At decode, where one step is ~150 small kernels of a few microseconds, that gap
costs as much as the work. Under programmatic dependent launch (Hopper and newer) a kernel
launched with the PDL attribute may start as soon as every program of the previous kernel has
signalled (``gdc_launch_dependents``, issued at their start here); it then does what does not
depend on that kernel (the projections request their weight tiles) and waits
(``gdc_wait``) for the previous kernel to complete, with its writes visible, before reading its
inputs or writing anything. Since that kernel waited for its own predecessor in the same way,
every earlier kernel has completed too: the results are those of plain launches.

Kernels that take part (:func:`~mcore_kernels.decode_gemv.decode_gemv`,
:func:`~mcore_kernels.rotary_kv_write.rotary_kv_write` and the paged decode attention) are
launched with PDL inside :func:`programmatic_dependent_launch` on devices that support it
(:func:`pdl_enabled`); CUDA graphs captured inside the context keep the attribute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from mcore_kernels._triton_utils import pdl_supported

__all__ = ["pdl_enabled", "pdl_supported", "programmatic_dependent_launch"]

_REQUESTED: ContextVar[bool] = ContextVar("mcore_kernels_pdl", default=False)


@contextlib.contextmanager
def programmatic_dependent_launch(enabled: bool = True) -> Iterator[None]:
    """Launch the participating kernels with programmatic dependent launch inside the block.

    Args:
        enabled: False leaves the launches plain (a convenience for callers with a flag).

    Yields:
        None; the previous setting is restored on exit.
    """
    token = _REQUESTED.set(bool(enabled))
    try:
        yield
    finally:
        _REQUESTED.reset(token)


def pdl_enabled(device: torch.device) -> bool:
    """Whether a participating kernel launched now on ``device`` uses PDL.

    Args:
        device: The device of the launch's tensors.

    Returns:
        True inside :func:`programmatic_dependent_launch` on a device that supports it (a
        CUDA GPU of compute capability 9.0 or more, with a Triton that has grid dependency
        control); False otherwise (the CPU interpreter included).
    """
    return _REQUESTED.get() and pdl_supported(device)
