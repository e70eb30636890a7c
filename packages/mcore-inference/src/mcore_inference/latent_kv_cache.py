"""Paged latent KV cache of Multi-head Latent Attention (MLA) models.

An MLA model run with absorbed weights needs, per token and layer, only the latent ``c_kv``
(``kv_lora_rank`` channels) and the rotary key shared by all heads (``qk_rope_head_dim``
channels), whatever the number of heads: DeepSeek-V3 caches 576 channels per token and layer
where its 128 up-projected heads would take ``2 * 128 * 192 = 49152``. :class:`PagedLatentKVCache`
keeps those rows in the blocks of the engine's allocator and attends with
:func:`mcore_kernels.mla_paged_attention.paged_mla_attention`.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_inference.errors import KVCacheStepError
from mcore_inference.kv_cache import PagedKVCache
from mcore_kernels.mla_paged_attention import paged_mla_attention

__all__ = ["PagedLatentKVCache", "build_paged_kv_cache", "kv_cache_shape"]


def kv_cache_shape(model_config: Any, attention: Any, latent: bool) -> tuple[int, int, int]:
    """Heads, channels per head and stored copies (2 for keys + values, 1 for latents) per token.

    Args:
        model_config: The model's ``GPTConfig``.
        attention: The first layer's attention module (its ``num_kv_heads`` are the local
            heads under tensor parallelism), or None.
        latent: For MLA models, cache latents (True) or up-projected heads (False).

    Returns:
        ``(heads, channels, copies)``: one latent row of ``kv_lora_rank + qk_rope_head_dim``
        channels for a latent cache; else the key/value heads and their width.
    """
    mla = getattr(model_config, "mla", None)
    if mla is not None and latent:
        return 1, mla.latent_dim, 1
    heads = getattr(attention, "num_kv_heads", model_config.num_kv_heads)
    width = mla.qk_head_dim if mla is not None else model_config.kv_channels
    return heads, width, 2


def build_paged_kv_cache(
    *,
    latent: bool,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    split_size: int,
    first_layer: int = 0,
    layer_indices: list[int] | None = None,
) -> PagedKVCache:
    """Build the engine's paged cache: per-head keys and values, or MLA latent rows.

    Args:
        latent: Build a :class:`PagedLatentKVCache` (``head_dim`` is then the latent width and
            ``num_kv_heads`` is 1) instead of a :class:`~mcore_inference.kv_cache.PagedKVCache`.
        num_layers: Decoder layers held.
        num_blocks: Blocks per layer.
        block_size: Tokens per block.
        num_kv_heads: Key/value heads (1 for latents).
        head_dim: Channels per head (the latent width for latents).
        dtype: Storage dtype.
        device: Storage device.
        split_size: Split size of the split-KV attention kernels.
        first_layer: Global index of the first layer held.
        layer_indices: Global indices of the layers held when they are not contiguous (the
            attention layers of a hybrid model); per-head caches only.

    Returns:
        The cache.
    """
    if latent:
        return PagedLatentKVCache(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            latent_dim=head_dim,
            dtype=dtype,
            device=device,
            split_size=split_size,
            first_layer=first_layer,
        )
    return PagedKVCache(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        split_size=split_size,
        first_layer=first_layer,
        layer_indices=layer_indices,
    )


class PagedLatentKVCache(PagedKVCache):
    """Latent rows (``c_kv`` then the rotary key) of every layer in the engine's paged blocks.

    Same step interface as :class:`~mcore_inference.kv_cache.PagedKVCache`
    (``set_step``/``prepare_step``/``clear_step``, graph-safe); MLA layers call
    :meth:`attend_latent` instead of ``attend``. ``keys`` holds the rows, shaped
    ``[layers, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``; ``values`` is empty.

    Args:
        num_layers: Decoder layers held.
        num_blocks: Blocks per layer (block 0 is the scratch block of padded rows).
        block_size: Tokens per block.
        latent_dim: ``kv_lora_rank + qk_rope_head_dim``.
        dtype: Storage dtype.
        device: Storage device.
        split_size: Split size of the split-KV attention kernel.
        first_layer: Global index of the first layer held.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        latent_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        split_size: int,
        first_layer: int = 0,
    ) -> None:
        super().__init__(
            num_layers=0,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=1,
            head_dim=latent_dim,
            dtype=dtype,
            device=device,
            split_size=split_size,
            first_layer=first_layer,
        )
        shape = (num_layers, num_blocks, block_size, 1, latent_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """Refuse per-head keys and values: this cache holds latents only.

        Args:
            layer_idx: Global index of the decoder layer.
            q: Unused.
            k: Unused.
            v: Unused.
            scale: Unused.

        Returns:
            Never returns.

        Raises:
            KVCacheStepError: Always (the model is not MLA or does not absorb its weights).
        """
        raise KVCacheStepError(
            f"PagedLatentKVCache.attend(layer_idx={layer_idx}): a latent cache serves MLA "
            "layers through attend_latent; build the engine with mla_latent_kv_cache=False "
            "for per-head keys and values"
        )

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
        """Store the new latent rows of a layer and attend each new token over its history.

        Args:
            layer_idx: Global index of the decoder layer (0-based).
            q_latent: ``[T, H, kv_lora_rank]`` queries mapped into latent space.
            q_rope: ``[T, H, qk_rope_head_dim]`` rotated rotary queries.
            c_kv: ``[T, kv_lora_rank]`` new latents.
            k_rope: ``[T, qk_rope_head_dim]`` new rotated shared keys.
            scale: Softmax scale.

        Returns:
            ``[T, H, kv_lora_rank]`` in the dtype of ``q_latent``.

        Raises:
            KVCacheStepError: If no step metadata was installed.
        """
        if self._slot_mapping is None or self._block_tables is None or self._context_lens is None:
            raise KVCacheStepError(
                f"PagedLatentKVCache.attend_latent(layer_idx={layer_idx}) called without step "
                "metadata; expected set_step() or prepare_step() before the forward"
            )
        rows = self.keys[layer_idx - self.first_layer, :, :, 0]
        new_rows = torch.cat((c_kv, k_rope), dim=-1).to(rows.dtype)
        rows.view(-1, rows.shape[-1]).index_copy_(0, self._slot_mapping, new_rows)
        return paged_mla_attention(
            q_latent.to(rows.dtype),
            q_rope.to(rows.dtype),
            rows,
            self._block_tables,
            self._context_lens,
            scale=scale,
            split_size=self.split_size,
        )
