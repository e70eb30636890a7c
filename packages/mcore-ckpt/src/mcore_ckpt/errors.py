"""Error types of mcore-ckpt.

Every error raised on bad input derives from :class:`CheckpointError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except CheckpointError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointVersionError",
]


class CheckpointError(Exception):
    """Base class of every error raised by mcore-ckpt."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint file is missing, truncated or unreadable."""


class CheckpointVersionError(CheckpointError, ValueError):
    """The checkpoint format version cannot be read by this release."""
