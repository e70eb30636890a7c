"""Error types of mcore-inference.

Every error raised on bad input derives from :class:`InferenceError` and from the builtin
exception a caller would expect (``ValueError``, ``TypeError`` ...), so both ``except InferenceError``
and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "InferenceError",
    "InvalidRequestError",
    "EngineClosedError",
    "InferenceConfigError",
    "KVCacheExhaustedError",
    "BlockAllocatorError",
    "TokenizerUnavailableError",
    "KVCacheStepError",
    "UnsupportedModelError",
    "WeightUpdateError",
]


class InferenceError(Exception):
    """Base class of every error raised by mcore-inference."""


class InvalidRequestError(InferenceError, ValueError):
    """A generation request or its sampling parameters are invalid."""


class EngineClosedError(InferenceError, RuntimeError):
    """The engine was closed and cannot serve requests."""


class InferenceConfigError(InferenceError, ValueError):
    """An :class:`mcore_inference.InferenceConfig` field holds an invalid value."""


class KVCacheExhaustedError(InferenceError, MemoryError):
    """The block allocator has fewer free KV blocks than requested."""


class BlockAllocatorError(InferenceError, ValueError):
    """A KV block was freed twice or does not belong to the allocator."""


class TokenizerUnavailableError(InferenceError, RuntimeError):
    """A tokenizer is needed but none is configured, or it cannot be loaded."""


class KVCacheStepError(InferenceError, RuntimeError):
    """The paged KV cache was used for attention without the metadata of a step."""


class UnsupportedModelError(InferenceError, ValueError):
    """The engine cannot serve this model (e.g. sequence parallelism, virtual pipeline stages)."""


class WeightUpdateError(InferenceError, ValueError):
    """Weights given to ``InferenceEngine.update_weights`` do not fit the model (nothing was
    copied)."""
