"""Grouped-query self-attention and the pre-norm decoder layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcore_kernels import RMSNorm
from mcore_kernels.batch_invariant import is_batch_invariant
from mcore_kernels.comm import fused_rs_add_rmsnorm_ag
from mcore_models.gpt.attention_backends import AttentionMask, attend, max_attention_logits
from mcore_models.gpt.batch_invariant import invariant_attention
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.fused_ops import rotate_queries_keys
from mcore_models.gpt.kv_cache import KVCache
from mcore_models.gpt.mlp import SwiGLUMLP
from mcore_models.gpt.rope import apply_rotary
from mcore_models.moe.layer import MoELayer

__all__ = ["Attention", "DecoderLayer", "add_rms_norm", "build_attention", "build_mlp"]


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional QKV bias and optional QK-norm.

    ``num_heads`` and ``num_kv_heads`` are the heads this module computes: all of them, or this
    rank's share after tensor-parallel sharding.

    Args:
        config: Model config.
        layer_idx: Index of the decoder layer (0-based), passed to the KV cache.
    """

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, dim, dtype = config.hidden_size, config.kv_channels, config.dtype
        self.layer_idx = layer_idx
        self.head_dim = dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.scale = dim**-0.5
        self.config = config
        self.max_logits: torch.Tensor | None = None
        """Running maximum pre-softmax logit per local query head since the last reset."""
        bias = config.add_qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * dim, hidden, bias=False, dtype=dtype)
        self.core_attention: nn.Module | None = None
        """Replacement of the local attention kernel (``parallelize`` installs context-parallel
        attention here); called as ``core_attention(q, k, v, mask, scale)``."""
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_layernorm:
            self.q_norm = RMSNorm(dim, config.norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(dim, config.norm_eps, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | None,
        kv_cache: KVCache | None = None,
        *,
        reduce_output: bool = True,
    ) -> torch.Tensor:
        """Attend causally.

        Args:
            x: ``[B, T, hidden]`` normalised hidden states.
            cos: ``[B, T, head_dim // 2]`` RoPE cosines.
            sin: ``[B, T, head_dim // 2]`` RoPE sines.
            mask: Mask of the forward pass (None when ``kv_cache`` attends).
            kv_cache: Caller-owned cache that stores keys/values and attends, or None.
            reduce_output: With a row-parallel ``o_proj``, False returns this rank's partial
                sum instead of the reduced output.

        Returns:
            ``[B, T, hidden]`` output of the output projection (or its partial sum).
        """
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_cache is None:
            q, k = rotate_queries_keys(q, k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q[0], k[0], v[0], scale=self.scale)[None]
        else:
            assert mask is not None
            if self.config.qk_clip_tracking:
                self._record_max_logits(max_attention_logits(q, k, mask, self.scale))
            if is_batch_invariant():
                out = invariant_attention(q, k, v, mask, self.scale)
            elif self.core_attention is not None:
                out = self.core_attention(q, k, v, mask, self.scale)
            else:
                out = attend(self.config.attention_backend, q, k, v, mask, self.scale)
        if reduce_output:
            return self.o_proj(out.flatten(-2))
        return F.linear(out.flatten(-2), self.o_proj.weight)

    def _record_max_logits(self, step_max: torch.Tensor) -> None:
        if self.max_logits is None:
            self.max_logits = step_max
        else:
            self.max_logits = torch.maximum(self.max_logits, step_max)


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``.

    The residual stream is carried separately from each block's output so that the residual
    add fuses into the following RMSNorm (``mcore_kernels.rms_norm(x, w, residual=r)``).

    Args:
        config: Model config.
        layer_idx: Index of the layer (0-based).
    """

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=config.dtype)
        self.self_attention = build_attention(config, layer_idx)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.norm_eps, dtype=config.dtype)
        self.mlp = build_mlp(config, layer_idx)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask | None,
        kv_cache: KVCache | None = None,
        *,
        fused_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layer.

        Args:
            hidden: Output of the previous block (the embeddings for the first layer).
            residual: Residual stream before ``hidden`` is added, None for the first layer.
            cos: RoPE cosines.
            sin: RoPE sines.
            mask: Mask of the forward pass.
            kv_cache: Caller-owned KV cache, or None.
            fused_group: Tensor-parallel group when the fused reduce-scatter + add + RMSNorm +
                all-gather replaces the row-parallel reductions; ``hidden`` (unless it is the
                embedding) and the returned output are then unreduced partial sums.

        Returns:
            ``(block_output, residual)``; the layer's output is their sum.
        """
        partial_group = fused_group if residual is not None else None
        x, residual = add_rms_norm(self.input_norm, hidden, residual, partial_group=partial_group)
        attention_out = self.self_attention(
            x, cos, sin, mask, kv_cache, reduce_output=fused_group is None
        )
        x, residual = add_rms_norm(
            self.post_attention_norm, attention_out, residual, partial_group=fused_group
        )
        if fused_group is None:
            return self.mlp(x), residual
        return self.mlp(x, reduce_output=False), residual

    def supports_fused_reduction(self) -> bool:
        """Whether the MLP can return a tensor-parallel partial sum (see ``build_mlp``).

        Returns:
            True when the fused TP communication path may be used for this layer.
        """
        return bool(getattr(self.mlp, "supports_partial_output", False))


def add_rms_norm(
    norm: RMSNorm,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    partial_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a block's output to the residual stream and normalise the sum.

    Args:
        norm: The RMSNorm to apply.
        hidden: Block output ``[..., H]`` (a TP partial sum when ``partial_group`` is given).
        residual: Residual stream, or None when ``hidden`` starts the stream.
        partial_group: Tensor-parallel group over which ``hidden`` still has to be summed;
            the sum, add and norm then run as one fused collective.

    Returns:
        ``(normed, new_residual)``.
    """
    if residual is None:
        return norm(hidden), hidden
    if partial_group is not None:
        shape = hidden.shape
        normed, new_residual = fused_rs_add_rmsnorm_ag(
            hidden.reshape(-1, shape[-1]),
            residual.reshape(-1, shape[-1]),
            norm.weight,
            norm.eps,
            partial_group,
        )
        return normed.view(shape), new_residual.view(shape)
    normed, new_residual = norm(hidden, residual)
    return normed, new_residual


def build_attention(config: GPTConfig, layer_idx: int) -> nn.Module:
    """Build the attention of one decoder layer (chosen by ``config.attention_type``).

    Args:
        config: Model config.
        layer_idx: Index of the decoder layer (0-based).

    Returns:
        An :class:`Attention` (multi-head / grouped-query) or, for ``attention_type="mla"``,
        a :class:`~mcore_models.gpt.mla.MLAttention`.
    """
    if config.attention_type == "mla":
        # Imported here: mcore_models.gpt.mla builds on this module's neighbours only.
        from mcore_models.gpt.mla import MLAttention

        return MLAttention(config, layer_idx)
    return Attention(config, layer_idx)


def build_mlp(config: GPTConfig, layer_idx: int) -> nn.Module:
    """Build the MLP of one decoder layer.

    This is the single place where a layer's MLP type is chosen, so that other block types
    (such as mixture-of-experts) plug in here without touching the decoder layer. A block may
    accept ``forward(x, *, reduce_output=False)`` returning a tensor-parallel partial sum; the
    decoder layer only asks that of blocks whose ``supports_partial_output`` is True.

    Args:
        config: Model config.
        layer_idx: Index of the decoder layer (0-based).

    Returns:
        A module mapping ``[..., hidden]`` to ``[..., hidden]``: a
        :class:`~mcore_models.moe.layer.MoELayer` where ``config.moe`` makes the layer a MoE
        layer, else a :class:`SwiGLUMLP`.
    """
    if config.moe is not None and config.moe.is_moe_layer(layer_idx):
        return MoELayer(config, layer_idx)
    return SwiGLUMLP(config)
