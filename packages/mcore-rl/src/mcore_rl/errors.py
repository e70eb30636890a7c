"""Error types of mcore-rl.

Every error raised on bad input derives from :class:`RLError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except RLError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "RLError",
    "RLConfigError",
    "PackingError",
    "TaskError",
    "TokenizerError",
    "RLInputError",
    "RLStateError",
    "RLCheckpointError",
    "RLDataError",
]


class RLError(Exception):
    """Base class of every error raised by mcore-rl."""


class RLConfigError(RLError, ValueError):
    """An RL configuration field is invalid."""


class PackingError(RLError, ValueError):
    """Sequences cannot be packed as requested (e.g. a sequence longer than the bin)."""


class TaskError(RLError, ValueError):
    """A task is unknown, registered twice, or its verifier returned a reward outside [0, 1]."""


class TokenizerError(RLError, ValueError):
    """Text holds a character, or ids hold a value, the tokenizer does not know."""


class RLInputError(RLError, ValueError):
    """Tensors given to an RL function have mismatched shapes or invalid values."""


class RLStateError(RLError, RuntimeError):
    """An operation was called in a state that does not allow it (e.g. a nested weight swap)."""


class RLCheckpointError(RLError, FileNotFoundError):
    """A run directory or checkpoint asked for by ``--resume`` does not exist."""


class RLDataError(RLError, ValueError):
    """A prompt dataset is missing, malformed, lacks a field, or is empty after filtering."""
