"""The caller-owned attention KV-cache interface and a contiguous reference implementation.

The model never keeps a cache: an inference engine passes an object implementing
:class:`KVCache` to :meth:`mcore_models.GPTModel.forward`, and every decoder layer hands its new
queries, keys and values to :meth:`KVCache.attend`. The engine decides how keys and values are
stored (contiguous, paged ...) and which earlier tokens each new token sees.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from mcore_models.errors import KVCacheError
from mcore_models.gpt.config import GPTConfig

__all__ = ["ContiguousKVCache", "KVCache"]


@runtime_checkable
class KVCache(Protocol):
    """Storage of past keys/values plus attention of new tokens over them.

    For a step whose ``input_ids`` is ``[1, T]`` (the new tokens of possibly several requests
    flattened into one row, positions given explicitly in ``position_ids``) each layer calls
    ``attend`` once.
    """

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """Store the new keys/values of a layer and attend the new queries over the history.

        Args:
            layer_idx: Index of the decoder layer (0-based).
            q: ``[T, Hq, D]`` new queries after RoPE (and QK-norm).
            k: ``[T, Hkv, D]`` new keys after RoPE (and QK-norm).
            v: ``[T, Hkv, D]`` new values.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, Hq, D]``: each new token's causal attention over its own request's history
            (the new tokens included).
        """
        ...


class ContiguousKVCache:
    """KV cache of one sequence in preallocated contiguous buffers (the reference).

    Every call appends ``T`` tokens to the layer's history; the new tokens sit at positions
    ``length .. length + T - 1`` and attend causally. Buffers are allocated at the first call of
    each layer with the dtype, device and head count of the keys, so the same class serves a
    tensor-parallel shard.

    Args:
        config: Config of the model the cache serves (for the number of layers).
        max_seq_len: Most tokens the cache holds.

    Raises:
        KVCacheError: If ``max_seq_len`` is not positive.
    """

    def __init__(self, config: GPTConfig, max_seq_len: int) -> None:
        if max_seq_len <= 0:
            raise KVCacheError(f"max_seq_len={max_seq_len} must be positive")
        self.num_layers = config.num_layers
        self.max_seq_len = max_seq_len
        self._keys: list[torch.Tensor | None] = [None] * config.num_layers
        self._values: list[torch.Tensor | None] = [None] * config.num_layers
        self._lengths = [0] * config.num_layers

    def length(self, layer_idx: int = 0) -> int:
        """Number of tokens stored for a layer.

        Args:
            layer_idx: Decoder layer index.

        Returns:
            The number of cached tokens.
        """
        return self._lengths[layer_idx]

    def reset(self) -> None:
        """Forget every stored token (buffers are kept for reuse)."""
        self._lengths = [0] * self.num_layers

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """Append ``k``/``v`` and attend ``q`` causally over the layer's whole history.

        Args:
            layer_idx: Index of the decoder layer (0-based).
            q: ``[T, Hq, D]`` new queries.
            k: ``[T, Hkv, D]`` new keys.
            v: ``[T, Hkv, D]`` new values.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, Hq, D]`` attention output.

        Raises:
            KVCacheError: If the layer index is out of range, the shapes disagree (also with
                the cached tokens) or the cache would overflow (the cache is left unchanged).
        """
        if not 0 <= layer_idx < self.num_layers:
            raise KVCacheError(f"layer_idx={layer_idx} is outside [0, {self.num_layers})")
        if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0]:
            raise KVCacheError(
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                "[T, Hq, D] and two [T, Hkv, D]"
            )
        start, new = self._lengths[layer_idx], k.shape[0]
        if start + new > self.max_seq_len:
            raise KVCacheError(
                f"{new} new tokens after {start} cached exceed max_seq_len={self.max_seq_len}"
            )
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        mismatch = keys is not None and (
            keys.shape[1:] != k.shape[1:] or keys.dtype != k.dtype or keys.device != k.device
        )
        if mismatch and start > 0:
            assert keys is not None
            raise KVCacheError(
                f"k of shape {tuple(k.shape)} ({k.dtype}, {k.device}) does not match the "
                f"{start} cached tokens of layer {layer_idx} ({tuple(keys.shape[1:])}, "
                f"{keys.dtype}, {keys.device}); call reset() first"
            )
        if keys is None or mismatch:
            keys = k.new_empty((self.max_seq_len, *k.shape[1:]))
            values = v.new_empty((self.max_seq_len, *v.shape[1:]))
            self._keys[layer_idx], self._values[layer_idx] = keys, values
        assert values is not None
        keys[start : start + new] = k
        values[start : start + new] = v
        self._lengths[layer_idx] = end = start + new
        # Query i (absolute position start + i) may see keys 0 .. start + i.
        allowed = torch.arange(end, device=q.device)[None, :] <= (
            start + torch.arange(new, device=q.device)[:, None]
        )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[:end].transpose(0, 1)[None],
            values[:end].transpose(0, 1)[None],
            attn_mask=allowed,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)
