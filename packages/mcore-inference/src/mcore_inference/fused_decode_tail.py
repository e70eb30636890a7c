"""The fused decoder's layers at a few tokens as one or two persistent launches each.

:func:`tail_layers` runs what :meth:`mcore_inference.fused_decode.FusedDecoder._gemv_layers`
runs, with the work after each attention (o projection + residual, RMSNorm + gate/up +
SwiGLU, down + residual) and the next layer's q/k/v projection (RMSNorm, bias, RoPE, cache
write) in one persistent launch whose programs meet at grid barriers where kernels used to
end (:mod:`mcore_kernels.decode_layer`). Mode ``"tail"``: the attention stays its own kernel
and :func:`~mcore_kernels.decode_layer.decode_layer_tail` follows it (two launches per
layer); mode ``"layer"``: :func:`~mcore_kernels.decode_layer.decode_layer` runs the attention
as its first phase too (one launch per layer). Only for models without QK-norm (the q/k/v
projection folds RoPE and the cache write in).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_inference.kv_cache import PagedKVCache
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_layer import (
    MAX_ROWS,
    LayerAttention,
    NextProjection,
    decode_layer,
    decode_layer_tail,
)
from mcore_kernels.decode_model import DecoderLayerWeights, decode_model
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = ["LAYER_MODES", "tail_layers", "tail_layers_apply"]

LAYER_MODES = ("off", "tail", "layer", "model")
"""The modes of :func:`tail_layers` (``"off"``: the ``decode_gemv`` chain instead)."""


def tail_layers_apply(model: Any, rows: int, mode: str = "tail") -> bool:
    """Whether :func:`tail_layers` serves a step of ``rows`` tokens of ``model``.

    Args:
        model: The fused decoder's model.
        rows: Tokens of the step.
        mode: One of :data:`LAYER_MODES`.

    Returns:
        True for a mode other than ``"off"``, at most
        :data:`mcore_kernels.decode_layer.MAX_ROWS` tokens and a model whose layers have no
        QK-norm (for ``"layer"`` also a head dim that is a power of two >= 16).
    """
    if mode == "off" or rows > MAX_ROWS:
        return False
    if any(layer.self_attention.q_norm is not None for layer in model.layers):
        return False
    head_dim = model.layers[0].self_attention.head_dim
    if mode == "model" and getattr(model, "layers", None) is not None:
        # One stacked cache and alike layers (no hybrid storage map).
        biases = {layer.self_attention.o_proj.bias is None for layer in model.layers}
        if len(biases) != 1:
            return False
    return mode == "tail" or (head_dim >= 16 and head_dim & (head_dim - 1) == 0)


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
    mode: str = "tail",
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
        mode: ``"tail"`` or ``"layer"`` (see the module docstring).

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
    tables, lens = kv_cache.step_tables()
    if mode == "model":
        stacked = [
            DecoderLayerWeights(
                qkv_weight=fused.qkv_weight,
                qkv_bias=fused.qkv_bias,
                input_norm_weight=layer.input_norm.weight,
                o_weight=layer.self_attention.o_proj.weight,
                o_bias=layer.self_attention.o_proj.bias,
                post_norm_weight=layer.post_attention_norm.weight,
                gate_up_weight=fused.gate_up_weight,
                down_weight=layer.mlp.down_proj.weight,
            )
            for layer, fused in zip(layers, fused_layers, strict=True)
        ]
        _, _, slots = kv_cache.layer_write_target(first.layer_idx)
        residual = decode_model(
            q,
            residual,
            layers=stacked,
            k_cache=kv_cache.keys,
            v_cache=kv_cache.values,
            block_tables=tables,
            context_lens=lens,
            slot_mapping=slots,
            cos=cos,
            sin=sin,
            scale=first.self_attention.scale,
            norm_eps=first.input_norm.eps,
        )
        return model.final_norm(residual)
    for index, layer in enumerate(layers):
        attention, mlp = layer.self_attention, layer.mlp
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
        weights: dict[str, Any] = {
            "o_weight": attention.o_proj.weight,
            "o_bias": attention.o_proj.bias,
            "post_norm_weight": layer.post_attention_norm.weight,
            "post_norm_eps": layer.post_attention_norm.eps,
            "gate_up_weight": fused_layers[index].gate_up_weight,
            "down_weight": mlp.down_proj.weight,
            "next_qkv": following,
        }
        if mode == "layer":
            keys, values, _ = kv_cache.layer_write_target(layer.layer_idx)
            cached = LayerAttention(
                k_cache=keys,
                v_cache=values,
                block_tables=tables,
                context_lens=lens,
                scale=attention.scale,
            )
            residual, next_q = decode_layer(q, residual, attention=cached, **weights)
        else:
            out = kv_cache.attend_stored_keys(
                layer.layer_idx,
                q.unflatten(-1, (-1, attention.head_dim)),
                scale=attention.scale,
                split_size=split_size,
                merge=merge,
            )
            residual, next_q = decode_layer_tail(out.flatten(-2), residual, **weights)
        if next_q is not None:
            q = next_q
    return model.final_norm(residual)
