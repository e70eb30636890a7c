"""The fused decoder's layers for steps of a few to a few hundred tokens (batched decode).

Where :mod:`mcore_inference.fused_decode` runs a layer as cuBLAS GEMMs plus a norm, RoPE +
cache write and SwiGLU kernel each, these steps fold the work around the GEMMs into them
(:func:`mcore_kernels.norm_linear.norm_linear`):

- q/k/v: the input RMSNorm in the prologue, RoPE and the key/value cache write in the epilogue
  (it returns the rotated queries);
- o and down projections: ``torch.addmm`` adds the residual stream in cuBLAS's epilogue;
- gate/up: the post-attention RMSNorm in the prologue, SwiGLU in the epilogue.

A layer is then four GEMM launches plus the attention, against nine. The residual stream
carries the sum after each block (``residual + block output``, rounded once), which the next
RMSNorm reads; the values are those of the unfused ops up to that rounding and the order of the
float32 sums. Models with QK-norm keep the separate norm of the queries and keys (their RoPE
follows it): the q/k/v projection then only takes the input norm in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mcore_inference.kv_cache import PagedKVCache
from mcore_kernels.norm_linear import norm_linear
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

if TYPE_CHECKING:
    from mcore_inference.fused_decode import FusedDecoder

__all__ = ["NORM_LINEAR_MAX_ROWS", "norm_linear_layers"]

NORM_LINEAR_MAX_ROWS = 512
"""Steps of more than ``FusedDecoder.gemv_max_rows`` and at most this many tokens run
:func:`norm_linear_layers`; larger steps (prefill) keep cuBLAS GEMMs and separate kernels."""


def _project_out(x: torch.Tensor, linear: torch.nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x)``, the add in the GEMM's epilogue (one rounding)."""
    if linear.bias is None:
        return torch.addmm(residual, x, linear.weight.t())
    return residual + F.linear(x, linear.weight, linear.bias)


def norm_linear_layers(
    decoder: FusedDecoder,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: PagedKVCache,
) -> torch.Tensor:
    """Every layer and the final norm over a step's tokens, with the norms and epilogues folded in.

    Args:
        decoder: The engine's fused decoder (its model and fused weight copies).
        hidden: ``[T, hidden]`` embeddings of the step's tokens.
        cos: float32 ``[T, D // 2]`` RoPE cosines of their positions.
        sin: float32 ``[T, D // 2]`` RoPE sines.
        kv_cache: The engine's paged cache with the step's metadata installed.

    Returns:
        ``[T, hidden]`` final-normed hidden states.
    """
    model = decoder.model
    residual = hidden
    for layer, fused in zip(model.layers, decoder._layers, strict=True):
        attention, mlp = layer.self_attention, layer.mlp
        head_dim = attention.head_dim
        norm = layer.input_norm
        if attention.q_norm is None and head_dim >= 32 and head_dim & (head_dim - 1) == 0:
            keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
            rope = RotaryCacheWrite(
                cos=cos,
                sin=sin,
                k_cache=keys,
                v_cache=values,
                slot_mapping=slots,
                num_q_heads=fused.split[0] // head_dim,
            )
            q = norm_linear(
                residual,
                fused.qkv_weight,
                fused.qkv_bias,
                norm_weight=norm.weight,
                norm_eps=norm.eps,
                rope=rope,
            )
            out = kv_cache.attend_stored_keys(
                layer.layer_idx, q.unflatten(-1, (-1, head_dim)), scale=attention.scale
            )
        else:
            qkv = norm_linear(
                residual,
                fused.qkv_weight,
                fused.qkv_bias,
                norm_weight=norm.weight,
                norm_eps=norm.eps,
            )
            q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in qkv.split(fused.split, -1))
            if attention.q_norm is not None and attention.k_norm is not None:
                q, k = attention.q_norm(q), attention.k_norm(k)
            out = kv_cache.attend_rotary(layer.layer_idx, q, k, v, cos, sin, scale=attention.scale)
        residual = _project_out(out.flatten(-2), attention.o_proj, residual)
        post = layer.post_attention_norm
        activation = norm_linear(
            residual, fused.gate_up_weight, norm_weight=post.weight, norm_eps=post.eps, swiglu=True
        )
        residual = _project_out(activation, mlp.down_proj, residual)
    return model.final_norm(residual)
