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
    "CheckpointMismatchError",
    "CheckpointConfigError",
    "CheckpointTypeError",
    "CheckpointExistsError",
    "AsyncSaveError",
    "CheckpointWriteError",
]


class CheckpointError(Exception):
    """Base class of every error raised by mcore-ckpt."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint file is missing, truncated or unreadable."""


class CheckpointVersionError(CheckpointError, ValueError):
    """The checkpoint format version cannot be read by this release."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The state dict to load into does not match what the checkpoint holds."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An argument has a value outside of what it accepts."""


class CheckpointTypeError(CheckpointError, TypeError):
    """An argument or a state dict value has a type that cannot be checkpointed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint with the requested name already exists."""


class AsyncSaveError(CheckpointError, RuntimeError):
    """A background save failed; raised by ``wait()`` and by the next save or load."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed; the previous checkpoint is untouched."""
