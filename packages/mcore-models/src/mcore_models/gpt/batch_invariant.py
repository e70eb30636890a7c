"""Hooks of the batch-invariant mode in the model (``GPTConfig.batch_invariant``).

The model enters :func:`mcore_kernels.batch_invariant.batch_invariant_mode` for its forward and
logit head, which routes every GEMM to the invariant kernels, and its attention without a KV
cache goes through :func:`invariant_attention`: the same kernel and per-token reduction order as
the inference engine's paged cache, so a packed training row and an incremental decode give
bitwise-equal outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mcore_kernels.batch_invariant import batch_invariant_mode, packed_attention_batch_invariant
from mcore_models.errors import ModelConfigError
from mcore_models.gpt.attention_backends import AttentionMask

__all__ = ["invariant_attention", "with_batch_invariance"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def with_batch_invariance(method: _Method) -> _Method:
    """Run a model method inside the batch-invariant mode when its config asks for it.

    Args:
        method: A method of a module whose ``config`` has a ``batch_invariant`` field.

    Returns:
        The wrapped method.
    """

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with batch_invariant_mode(bool(getattr(self.config, "batch_invariant", False))):
            return method(self, *args, **kwargs)

    return wrapped  # type: ignore[return-value]


def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """Causal (document-masked) attention with the engine's batch-invariant numerics.

    Args:
        q: ``[B, T, Hq, D]`` queries.
        k: ``[B, T, Hkv, D]`` keys.
        v: ``[B, T, Hkv, D]`` values.
        mask: The forward pass's mask (packed sequences through ``segment_bounds``).
        scale: Multiplier of the query-key products.

    Returns:
        ``[B, T, Hq, D]``.

    Raises:
        ModelConfigError: Under context parallelism (a rank does not hold whole sequences)
            or with shared prefixes.
    """
    if mask.cu_seqlens is not None:
        raise ModelConfigError(
            "batch_invariant=True is not supported with context parallelism; use cp=1"
        )
    if mask.prefix_of is not None:
        raise ModelConfigError(
            "batch_invariant=True does not support shared prefixes (packed_seq_params."
            "prefix_of); expected packed sequences without prefix_of"
        )
    batch, seq_len = q.shape[0], q.shape[1]
    segments = mask.segment_bounds or [(0, seq_len)]
    bounds = [(row * seq_len + s, row * seq_len + e) for row in range(batch) for s, e in segments]
    out = packed_attention_batch_invariant(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), bounds, scale=scale
    )
    return out.view(q.shape)
