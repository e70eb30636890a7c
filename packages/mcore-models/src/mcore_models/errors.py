"""Error types of mcore-models.

Every error raised on bad input derives from :class:`ModelError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except ModelError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "ModelError",
    "ModelConfigError",
    "CheckpointFormatError",
    "AttentionBackendError",
    "ModelInputError",
    "PackedSeqError",
    "KVCacheError",
]


class ModelError(Exception):
    """Base class of every error raised by mcore-models."""


class ModelConfigError(ModelError, ValueError):
    """A model configuration field is invalid."""


class CheckpointFormatError(ModelError, ValueError):
    """A Hugging Face checkpoint is unsupported or a tensor does not match the model."""


class AttentionBackendError(ModelError, ValueError):
    """The selected attention backend cannot serve the request."""


class ModelInputError(ModelError, ValueError):
    """An argument of a model's forward pass has the wrong shape, dtype or value."""


class PackedSeqError(ModelError, ValueError):
    """Packed-sequence boundaries are malformed or do not match the input."""


class KVCacheError(ModelError, ValueError):
    """A KV cache request does not fit the cache (too long, wrong layer or shape)."""
