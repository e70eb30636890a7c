"""The fused decoder's layers at one or two tokens as attention + one persistent launch each.

:func:`tail_layers` runs what :meth:`mcore_inference.fused_decode.FusedDecoder._gemv_layers`
runs, with the work after each attention (o projection + residual, RMSNorm + gate/up +
SwiGLU, down + residual) and the next layer's q/k/v projection (RMSNorm, bias, RoPE, cache
write) in one :func:`mcore_kernels.decode_layer.decode_layer_tail` launch: a layer is two
launches (the attention and that kernel) instead of five, the other three kernel boundaries
becoming grid barriers inside the kernel. Only for models without QK-norm (the q/k/v
projection folds RoPE and the cache write in).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_inference.kv_cache import PagedKVCache
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_layer import MAX_ROWS, NextProjection, decode_layer_tail
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = ["tail_layers", "tail_layers_apply"]


def tail_layers_apply(model: Any, rows: int) -> bool:
    """Whether :func:`tail_layers` serves a step of ``rows`` tokens of ``model``.

    Args:
        model: The fused decoder's model.
        rows: Tokens of the step.

    Returns:
        True for at most :data:`mcore_kernels.decode_layer.MAX_ROWS` tokens of a model whose
        layers have no QK-norm.
    """
    return rows <= MAX_ROWS and all(layer.self_attention.q_norm is None for layer in model.layers)


def _rope(
    kv_cache: PagedKVCache, layer: Any, cos: torch.Tensor, sin: torch.Tensor, q_rows: int
) -> RotaryCacheWrite:
    keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
    return RotaryCacheWrite(
        cos=cos,
        sin=sin,
        k_cache=keys,
        v_cache=values,
        slot_mapping=slots,
        num_q_heads=q_rows // layer.self_attention.head_dim,
    )


def tail_layers(
    model: Any,
    fused_layers: list[Any],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: PagedKVCache,
    *,
    split_size: int | None,
    merge: str | None,
) -> torch.Tensor:
    """Every decoder layer over a step of a few tokens, and the final norm.

    Args:
        model: The fused decoder's model (see :func:`tail_layers_apply`).
        fused_layers: The decoder's concatenated q/k/v and gate/up weights, one per layer
            (``qkv_weight``, ``qkv_bias``, ``gate_up_weight``, ``split``).
        hidden: ``[T, hidden]`` embeddings of the step's tokens.
        cos: ``[T, D // 2]`` RoPE cosines of their positions.
        sin: ``[T, D // 2]`` RoPE sines.
        kv_cache: The engine's cache with the step's metadata installed.
        split_size: Context positions per split of the attention (None: the cache's).
        merge: How the attention merges its splits (None: the kernel's default).

    Returns:
        ``[T, hidden]`` final-normed hidden states.
    """
    layers = list(model.layers)
    first, first_fused = layers[0], fused_layers[0]
    residual = hidden
    q = decode_gemv(
        residual,
        first_fused.qkv_weight,
        first_fused.qkv_bias,
        norm_weight=first.input_norm.weight,
        norm_eps=first.input_norm.eps,
        rope=_rope(kv_cache, first, cos, sin, first_fused.split[0]),
    )
    for index, layer in enumerate(layers):
        attention, mlp = layer.self_attention, layer.mlp
        out = kv_cache.attend_stored_keys(
            layer.layer_idx,
            q.unflatten(-1, (-1, attention.head_dim)),
            scale=attention.scale,
            split_size=split_size,
            merge=merge,
        )
        following = None
        if index + 1 < len(layers):
            nxt, nxt_fused = layers[index + 1], fused_layers[index + 1]
            following = NextProjection(
                weight=nxt_fused.qkv_weight,
                bias=nxt_fused.qkv_bias,
                norm_weight=nxt.input_norm.weight,
                norm_eps=nxt.input_norm.eps,
                rope=_rope(kv_cache, nxt, cos, sin, nxt_fused.split[0]),
            )
        residual, next_q = decode_layer_tail(
            out.flatten(-2),
            residual,
            o_weight=attention.o_proj.weight,
            o_bias=attention.o_proj.bias,
            post_norm_weight=layer.post_attention_norm.weight,
            post_norm_eps=layer.post_attention_norm.eps,
            gate_up_weight=fused_layers[index].gate_up_weight,
            down_weight=mlp.down_proj.weight,
            next_qkv=following,
        )
        if next_q is not None:
            q = next_q
    return model.final_norm(residual)
