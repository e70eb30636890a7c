"""The engine's paged KV cache: which layers it holds, and how many blocks fit."""

from __future__ import annotations

from typing import Any

import torch

from mcore_inference.block_allocator import BlockAllocator
from mcore_inference.config import InferenceConfig
from mcore_inference.distributed import EngineGroups
from mcore_inference.errors import UnsupportedModelError
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.latent_kv_cache import build_paged_kv_cache, kv_cache_shape
from mcore_inference.mamba_state import has_mamba_layers

__all__ = ["build_engine_cache"]


def _local_layers(model: Any) -> tuple[int, int]:
    """``(first global layer index, number of layers)`` of a model or pipeline stage."""
    layers = getattr(model, "layers", None)
    if layers is None:  # a wrapper with GPTModel's forward: all layers of the config
        return 0, model.config.num_layers
    indices = [getattr(layer, "layer_idx", i) for i, layer in enumerate(layers)]
    if indices and indices != list(range(indices[0], indices[0] + len(indices))):
        raise UnsupportedModelError(
            f"model holds layers {indices}; expected a contiguous range (one pipeline chunk "
            "per rank: virtual pipeline stages are not served)"
        )
    return (indices[0] if indices else 0), len(indices)


def build_engine_cache(
    model: Any, config: InferenceConfig, groups: EngineGroups, device: torch.device
) -> tuple[BlockAllocator, PagedKVCache]:
    """The block allocator and the paged KV cache of an engine serving ``model``.

    The cache holds this rank's layers (a pipeline stage's; a hybrid model's attention layers
    only) and key/value heads. Its block count comes from ``config.num_blocks``, else from
    ``config.kv_memory_bytes``, else enough for ``max_batch_size`` full-length sequences; the
    ranks of a replica agree on the smallest (stages with more layers fit fewer blocks). One
    more block is the scratch block that padding rows write to.

    Args:
        model: The model or this rank's pipeline stage.
        config: The engine configuration.
        groups: The engine's process groups.
        device: The model's device.

    Returns:
        ``(allocator, kv_cache)``.

    Raises:
        UnsupportedModelError: If the stage's layers are not one contiguous range.
        InferenceConfigError: If the config differs between the ranks of a replica.
    """
    parameter = next(model.parameters())
    model_config = model.config
    first_layer, num_layers = _local_layers(model)
    layers = getattr(model, "layers", None)
    # A hybrid model's first layer may have no attention: take the first that has one.
    attention = next(
        (a for a in (getattr(x, "self_attention", None) for x in layers or []) if a),
        None,
    )
    num_kv_heads, head_dim, copies = kv_cache_shape(
        model_config, attention, config.mla_latent_kv_cache
    )
    # Hybrid models: KV storage only for the layers that attend.
    attention_layers: list[int] | None = None
    if has_mamba_layers(model) and layers is not None:
        attention_layers = [
            layer.layer_idx for layer in layers if getattr(layer, "self_attention", None)
        ]
        num_layers = len(attention_layers)
    kv_dtype = config.kv_dtype or parameter.dtype
    bytes_per_block = (
        copies
        * max(num_layers, 1)
        * config.block_size
        * num_kv_heads
        * head_dim
        * torch.empty((), dtype=kv_dtype).element_size()
    )
    if config.num_blocks is not None:
        usable = config.num_blocks
    elif config.kv_memory_bytes is not None:
        usable = max(1, config.kv_memory_bytes // bytes_per_block)
    else:
        usable = config.max_batch_size * config.max_blocks_per_sequence
    # Stages with more layers fit fewer blocks in the same budget: the replica admits alike.
    usable = groups.agree_on_config(repr(config), usable)
    allocator = BlockAllocator(usable + 1)
    kv_cache = build_paged_kv_cache(
        latent=copies == 1,
        num_layers=num_layers,
        num_blocks=usable + 1,
        block_size=config.block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
        device=device,
        split_size=config.attention_split_size,
        first_layer=first_layer,
        layer_indices=attention_layers,
    )
    return allocator, kv_cache
