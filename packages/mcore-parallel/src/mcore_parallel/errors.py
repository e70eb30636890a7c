"""Error types of mcore-parallel.

Every error raised on bad input derives from :class:`ParallelError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except ParallelError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "ParallelError",
    "ParallelConfigError",
    "ParallelStateError",
    "ParallelTypeError",
    "DistributedRunError",
    "DistributedTimeoutError",
    "OptimizerStateError",
    "GradientNotFiniteError",
]


class ParallelError(Exception):
    """Base class of every error raised by mcore-parallel."""


class ParallelConfigError(ParallelError, ValueError):
    """A parallel layout or configuration is invalid (e.g. world size not divisible)."""


class ParallelStateError(ParallelError, RuntimeError):
    """An operation needs process groups that are not initialised or were destroyed."""


class ParallelTypeError(ParallelError, TypeError):
    """An argument has the wrong type (e.g. a state that is not a ParallelState)."""


class DistributedRunError(ParallelError, RuntimeError):
    """A rank spawned by :func:`mcore_parallel.testing.run_distributed` failed or died."""


class DistributedTimeoutError(ParallelError, TimeoutError):
    """Ranks spawned by :func:`mcore_parallel.testing.run_distributed` ran past the timeout."""


class OptimizerStateError(ParallelError, ValueError):
    """An optimizer state dict lacks an entry or holds a block of the wrong size."""


class GradientNotFiniteError(ParallelError, FloatingPointError):
    """A reduced gradient holds NaN or Inf (``DDPConfig.check_for_nan_in_grad``)."""
