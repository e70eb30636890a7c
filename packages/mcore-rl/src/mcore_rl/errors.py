"""Error types of mcore-rl.

Every error raised on bad input derives from :class:`RLError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except RLError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = ["RLError", "RLConfigError", "PackingError"]


class RLError(Exception):
    """Base class of every error raised by mcore-rl."""


class RLConfigError(RLError, ValueError):
    """An RL configuration field is invalid."""


class PackingError(RLError, ValueError):
    """Sequences cannot be packed as requested (e.g. a sequence longer than the bin)."""
