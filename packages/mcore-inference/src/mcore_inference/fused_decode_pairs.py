"""Decoder layers of one or two tokens with two dependent projections per launch.

:class:`~mcore_inference.fused_decode.FusedDecoder` runs a layer of a ``decode_gemv`` step as
five dependent launches (q/k/v with RoPE and the cache write, attention splits, the o
projection with the merge, gate/up with SwiGLU, down). Here two of them share one launch
(:func:`mcore_kernels.decode_gemv_pair.decode_gemv_pair`: the second projection's programs
wait on a counter of the first's instead of on the end of a grid):

- ``"mlp"``: gate/up + SwiGLU and the down projection of each layer;
- ``"down_qkv"``: the down projection of a layer and the next layer's q/k/v projection;
- ``"mlp_qkv"``: gate/up, down and the next layer's q/k/v in one launch (three projections).

The values are those of the five-launch layers: the same fused ops, the same float32 sums
(up to the reduction layout within a tile, from the pair's warps per program).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_gemv_pair import (
    PAIR_MAX_ROWS,
    PAIR_SLOT_STRIDE,
    GemvStage,
    decode_gemv_pair,
    pair_counters,
)
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

if TYPE_CHECKING:
    from mcore_inference.fused_decode import FusedDecoder
    from mcore_inference.kv_cache import PagedKVCache

__all__ = ["PAIR_MODES", "gemv_layers_paired", "paired_layers_supported"]

PAIR_MODES = ("none", "mlp", "down_qkv", "mlp_qkv")
"""Values of :data:`mcore_inference.fused_decode.PAIRED_LAUNCHES`."""


def paired_layers_supported(decoder: FusedDecoder, mode: str, rows: int) -> bool:
    """Whether a step of ``rows`` tokens runs its layers in paired launches under ``mode``.

    Args:
        decoder: The fused decoder.
        mode: One of :data:`PAIR_MODES`.
        rows: Tokens of the step.

    Returns:
        True for ``"mlp"`` or ``"mlp_qkv"`` with at least 2 layers or ``"down_qkv"`` with at
        least 3, at most
        ``PAIR_MAX_ROWS`` tokens, RoPE in the q/k/v projection, no QK-norm and the attention
        merged in the o projection.
    """
    if mode not in PAIR_MODES:
        raise ValueError(f"PAIRED_LAUNCHES={mode!r}; expected one of {PAIR_MODES}")
    layers = decoder.model.layers
    needed = {"none": None, "mlp": 2, "down_qkv": 3, "mlp_qkv": 2}[mode]
    if needed is None or rows > PAIR_MAX_ROWS or len(layers) < needed:
        return False
    if not decoder._attention_in_o_proj():
        return False
    return all(layer.self_attention.q_norm is None for layer in layers)


def _counters(decoder: FusedDecoder, slots: int, device: torch.device) -> torch.Tensor:
    counters = decoder._pair_counters
    if (
        counters is None
        or counters.device != device
        or counters.numel() != slots * PAIR_SLOT_STRIDE
    ):
        counters = decoder._pair_counters = pair_counters(slots, device)
    return counters


def gemv_layers_paired(
    decoder: FusedDecoder,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: PagedKVCache,
    mode: str,
) -> torch.Tensor:
    """:meth:`FusedDecoder._gemv_layers` with two projections per launch (``mode``).

    Args:
        decoder: The fused decoder (:func:`paired_layers_supported` is True).
        hidden: ``[T, hidden]`` embeddings.
        cos: ``[T, D / 2]`` RoPE cosines of the step's positions.
        sin: ``[T, D / 2]`` sines.
        kv_cache: The engine's paged cache with the step's metadata installed.
        mode: ``"mlp"``, ``"down_qkv"`` or ``"mlp_qkv"``.

    Returns:
        The residual stream before the final norm.
    """
    layers = list(zip(decoder.model.layers, decoder._layers, strict=True))
    slots = len(layers) - 1 if mode == "down_qkv" else len(layers)
    counters = _counters(decoder, slots, hidden.device)
    try:
        if mode == "mlp":
            return _mlp_pairs(decoder, layers, hidden, cos, sin, kv_cache, counters)
        if mode == "mlp_qkv":
            return _mlp_qkv_triples(decoder, layers, hidden, cos, sin, kv_cache, counters)
        return _down_qkv_pairs(decoder, layers, hidden, cos, sin, kv_cache, counters)
    except BaseException:
        # A cycle cut short leaves counts behind (see mcore_kernels.decode_gemv_pair).
        if not torch.cuda.is_current_stream_capturing():
            counters.zero_()
        raise


def _rope(layer: Any, fused: Any, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache):
    keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
    rope = RotaryCacheWrite(
        cos=cos,
        sin=sin,
        k_cache=keys,
        v_cache=values,
        slot_mapping=slots,
        num_q_heads=fused.split[0] // layer.self_attention.head_dim,
    )
    return rope, keys, values


def _qkv(layer: Any, fused: Any, residual: torch.Tensor, rope: RotaryCacheWrite) -> torch.Tensor:
    return decode_gemv(
        residual,
        fused.qkv_weight,
        fused.qkv_bias,
        norm_weight=layer.input_norm.weight,
        norm_eps=layer.input_norm.eps,
        rope=rope,
    )


def _mlp_pairs(decoder, layers, residual, cos, sin, kv_cache, counters) -> torch.Tensor:  # type: ignore[no-untyped-def]
    for index, (layer, fused) in enumerate(layers):
        rope, keys, values = _rope(layer, fused, cos, sin, kv_cache)
        q = _qkv(layer, fused, residual, rope)
        residual = decoder._attention_o_proj(
            layer.self_attention, q, keys, values, kv_cache, residual
        )
        norm = layer.post_attention_norm
        _, residual = decode_gemv_pair(
            residual,
            fused.gate_up_weight,
            layer.mlp.down_proj.weight,
            counters=counters,
            slot=index,
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            swiglu=True,
            second_residual=residual,
        )
    return residual


def _down_qkv_pairs(decoder, layers, residual, cos, sin, kv_cache, counters) -> torch.Tensor:  # type: ignore[no-untyped-def]
    activation: torch.Tensor | None = None
    for index, (layer, fused) in enumerate(layers):
        rope, keys, values = _rope(layer, fused, cos, sin, kv_cache)
        if activation is None:
            q = _qkv(layer, fused, residual, rope)
        else:
            previous = layers[index - 1][0]
            norm = layer.input_norm
            residual, q = decode_gemv_pair(
                activation,
                previous.mlp.down_proj.weight,
                fused.qkv_weight,
                counters=counters,
                slot=index - 1,
                residual=residual,
                second_bias=fused.qkv_bias,
                second_norm_weight=norm.weight,
                second_norm_eps=norm.eps,
                second_rope=rope,
            )
        residual = decoder._attention_o_proj(
            layer.self_attention, q, keys, values, kv_cache, residual
        )
        norm = layer.post_attention_norm
        activation = decode_gemv(
            residual,
            fused.gate_up_weight,
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            swiglu=True,
        )
    assert activation is not None
    return decode_gemv(activation, layers[-1][0].mlp.down_proj.weight, residual=residual)


def _mlp_qkv_triples(decoder, layers, residual, cos, sin, kv_cache, counters) -> torch.Tensor:  # type: ignore[no-untyped-def]
    layer, fused = layers[0]
    rope, keys, values = _rope(layer, fused, cos, sin, kv_cache)
    q = _qkv(layer, fused, residual, rope)
    for index, (layer, fused) in enumerate(layers):
        residual = decoder._attention_o_proj(
            layer.self_attention, q, keys, values, kv_cache, residual
        )
        norm = layer.post_attention_norm
        third = None
        if index + 1 < len(layers):
            following, following_fused = layers[index + 1]
            next_rope, next_keys, next_values = _rope(
                following, following_fused, cos, sin, kv_cache
            )
            third = GemvStage(
                following_fused.qkv_weight,
                following_fused.qkv_bias,
                following.input_norm.weight,
                following.input_norm.eps,
                rope=next_rope,
            )
        outputs = decode_gemv_pair(
            residual,
            fused.gate_up_weight,
            layer.mlp.down_proj.weight,
            counters=counters,
            slot=index,
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            swiglu=True,
            second_residual=residual,
            third=third,
        )
        residual = outputs[1]
        if third is not None:
            q, keys, values = outputs[2], next_keys, next_values
    return residual
