"""The latent KV-cache interface of MLA's absorbed attention and a contiguous reference.

An MLA layer given a cache with ``attend_latent`` hands it, per new token, the latent
``c_kv`` and the shared rotary key (``kv_lora_rank + qk_rope_head_dim`` channels: everything
the cache stores) together with the queries mapped into latent space; the cache returns each
head's attention output in latent space, which the layer maps back through ``W_UV``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from mcore_kernels.mla_paged_attention import paged_mla_attention
from mcore_models.errors import KVCacheError
from mcore_models.gpt.config import GPTConfig

__all__ = ["ContiguousLatentKVCache", "LatentKVCache"]


@runtime_checkable
class LatentKVCache(Protocol):
    """Storage of past latents plus absorbed attention of new tokens over them."""

    def attend_latent(
        self,
        layer_idx: int,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Store the new latents of a layer and attend the new queries over the history.

        Args:
            layer_idx: Index of the decoder layer (0-based).
            q_latent: ``[T, H, kv_lora_rank]`` no-position queries mapped by ``W_UK^T``.
            q_rope: ``[T, H, qk_rope_head_dim]`` rotated rotary queries.
            c_kv: ``[T, kv_lora_rank]`` new latents.
            k_rope: ``[T, qk_rope_head_dim]`` new rotated shared keys.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, H, kv_lora_rank]``: each head's softmax-weighted sum of the latents of its
            request's history (the new tokens included).
        """
        ...


class ContiguousLatentKVCache:
    """Latent KV cache of one sequence in preallocated contiguous buffers.

    Stores ``kv_lora_rank + qk_rope_head_dim`` channels per token and layer, whatever the
    number of heads. Every call appends ``T`` tokens; they attend causally, through
    :func:`mcore_kernels.mla_paged_attention.paged_mla_attention` over the buffer seen as one
    block.

    Args:
        config: Config of the MLA model the cache serves.
        max_seq_len: Most tokens the cache holds.

    Raises:
        KVCacheError: If the model is not MLA or ``max_seq_len`` is not positive.
    """

    def __init__(self, config: GPTConfig, max_seq_len: int) -> None:
        if config.mla is None:
            raise KVCacheError(
                f"attention_type={config.attention_type!r}: a latent KV cache serves MLA "
                "models only; expected attention_type='mla'"
            )
        if max_seq_len <= 0:
            raise KVCacheError(f"max_seq_len={max_seq_len} must be positive")
        self.num_layers = config.num_layers
        self.max_seq_len = max_seq_len
        self.kv_lora_rank = config.mla.kv_lora_rank
        self.latent_dim = config.mla.latent_dim
        self._latents: list[torch.Tensor | None] = [None] * config.num_layers
        self._lengths = [0] * config.num_layers

    def length(self, layer_idx: int = 0) -> int:
        """Number of tokens stored for a layer.

        Args:
            layer_idx: Decoder layer index.

        Returns:
            The number of cached tokens.
        """
        return self._lengths[layer_idx]

    @property
    def nbytes(self) -> int:
        """Bytes of the latent buffers allocated so far."""
        return sum(t.nbytes for t in self._latents if t is not None)

    def attend_latent(
        self,
        layer_idx: int,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Append the latents and attend the new queries causally (see :class:`LatentKVCache`).

        Args:
            layer_idx: Index of the decoder layer (0-based).
            q_latent: ``[T, H, kv_lora_rank]``.
            q_rope: ``[T, H, qk_rope_head_dim]``.
            c_kv: ``[T, kv_lora_rank]``.
            k_rope: ``[T, qk_rope_head_dim]``.
            scale: Multiplier of the query-key products.

        Returns:
            ``[T, H, kv_lora_rank]``.

        Raises:
            KVCacheError: If the layer is out of range, the widths do not match the config or
                the cache would overflow (the cache is left unchanged).
        """
        if not 0 <= layer_idx < self.num_layers:
            raise KVCacheError(f"layer_idx={layer_idx} is outside [0, {self.num_layers})")
        new = c_kv.shape[0]
        if c_kv.shape[-1] + k_rope.shape[-1] != self.latent_dim or k_rope.shape[0] != new:
            raise KVCacheError(
                f"c_kv {tuple(c_kv.shape)} and k_rope {tuple(k_rope.shape)}: expected [T, "
                f"{self.kv_lora_rank}] and [T, {self.latent_dim - self.kv_lora_rank}]"
            )
        start = self._lengths[layer_idx]
        if start + new > self.max_seq_len:
            raise KVCacheError(
                f"{new} new tokens after {start} cached exceed max_seq_len={self.max_seq_len}"
            )
        latents = self._latents[layer_idx]
        if latents is None:
            # Zeros, not empty: masked positions must not hold NaN (0 * NaN in the sum).
            latents = c_kv.new_zeros((self.max_seq_len, self.latent_dim))
            self._latents[layer_idx] = latents
        latents[start : start + new] = torch.cat((c_kv, k_rope), dim=-1).to(latents.dtype)
        self._lengths[layer_idx] = start + new
        # The contiguous buffer is one block of max_seq_len slots; new token i sees positions
        # 0 .. start + i.
        table = torch.zeros((new, 1), dtype=torch.int32, device=c_kv.device)
        context = start + 1 + torch.arange(new, dtype=torch.int32, device=c_kv.device)
        return paged_mla_attention(
            q_latent.to(latents.dtype),
            q_rope.to(latents.dtype),
            latents[None],
            table,
            context,
            scale=scale,
            split_size=self.max_seq_len,
        ).to(q_latent.dtype)
