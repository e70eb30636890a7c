"""Error types of mcore-parallel.

Every error raised on bad input derives from :class:`ParallelError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except ParallelError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = ["ParallelError", "ParallelConfigError", "ParallelStateError"]


class ParallelError(Exception):
    """Base class of every error raised by mcore-parallel."""


class ParallelConfigError(ParallelError, ValueError):
    """A parallel layout or configuration is invalid (e.g. world size not divisible)."""


class ParallelStateError(ParallelError, RuntimeError):
    """An operation needs process groups that are not initialised or were destroyed."""
