"""Error types of mcore-inference.

Every error raised on bad input derives from :class:`InferenceError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except InferenceError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = ["InferenceError", "InvalidRequestError", "EngineClosedError"]


class InferenceError(Exception):
    """Base class of every error raised by mcore-inference."""


class InvalidRequestError(InferenceError, ValueError):
    """A generation request or its sampling parameters are invalid."""


class EngineClosedError(InferenceError, RuntimeError):
    """The engine was closed and cannot serve requests."""
