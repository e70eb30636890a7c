"""Multi-head Latent Attention (MLA), the attention of DeepSeek-V2/V3 and Kimi K2.

Every token's keys and values come from one latent ``c_kv = norm(W_DKV x)`` of
``kv_lora_rank`` channels: per-head keys without position ``k_nope = W_UK c_kv`` and values
``v = W_UV c_kv``. Position enters through ``qk_rope_head_dim`` decoupled rotary channels: a
rotary key shared by all heads (computed from ``x`` next to ``c_kv``) and per-head rotary
queries. Queries are ``W_UQ norm(W_DQ x)`` with a low-rank ``q_lora_rank`` or a full-rank
projection (DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, section 2.1).

Training and prefill without a cache up-project every head and run the configured attention
backend. With a KV cache the weights are absorbed (section 2.1.3 of the same report): the
query's no-position part is mapped into latent space, ``q_latent = W_UK^T q_nope``, so scores
are ``q_latent . c_kv + q_rope . k_rope`` and the attention output ``o_latent = sum p c_kv`` is
mapped back by ``W_UV``; the cache then holds only ``c_kv`` and ``k_rope`` per token
(:class:`mcore_models.gpt.mla_kv_cache.LatentKVCache`). A cache without latent support gets
the up-projected keys and values (values zero-padded to the key width), like any multi-head
model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcore_kernels import RMSNorm
from mcore_models.gpt.attention_backends import AttentionMask, attend, max_attention_logits
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.kv_cache import KVCache
from mcore_models.gpt.mla_config import MLAConfig
from mcore_models.gpt.rope import apply_rotary
from mcore_models.gpt.yarn import deinterleave

__all__ = ["MLAttention"]


class MLAttention(nn.Module):
    """Multi-head Latent Attention with optional low-rank queries and decoupled RoPE.

    Parameter names follow Hugging Face's DeepSeek-V3 (``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``). ``num_heads`` is the number of heads this module computes: all of them, or
    this rank's share after tensor-parallel sharding (query up-projection, ``kv_b_proj`` and
    ``o_proj`` are split by heads; the latent projections are replicated).

    Args:
        config: Model config with ``attention_type="mla"``.
        layer_idx: Index of the decoder layer (0-based), passed to the KV cache.
    """

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None, "GPTConfig.__post_init__ sets mla for attention_type='mla'"
        hidden, dtype, heads = config.hidden_size, config.dtype, config.num_attention_heads
        self.config = config
        self.mla: MLAConfig = mla
        self.layer_idx = layer_idx
        self.num_heads = heads
        self.scale = mla.softmax_scale
        self.max_logits: torch.Tensor | None = None
        """Running maximum pre-softmax logit per local head since the last reset."""
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Module | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=False, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.norm_eps, dtype=dtype)
            self.q_b_proj = nn.Linear(
                mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, dtype=dtype
            )
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=False, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.norm_eps, dtype=dtype)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank,
            heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            bias=False,
            dtype=dtype,
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=False, dtype=dtype)
        self.rope_key_input: nn.Module = nn.Identity()
        """Applied to the shared rotary key before the heads use it (under tensor parallelism
        ``parallelize`` installs a copy to the TP region, whose backward sums the partial
        gradients of the ranks' heads)."""

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads after up-projection (one per query head)."""
        return self.num_heads

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head queries before RoPE.

        Args:
            x: ``[B, T, hidden]`` normalised hidden states.

        Returns:
            ``[B, T, heads, qk_head_dim]`` (no-position channels first, then rotary ones).
        """
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.unflatten(-1, (-1, self.mla.qk_head_dim))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.mla.rope_interleave:
            x = deinterleave(x)
        return apply_rotary(x, cos, sin)

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and the per-token latent of a step.

        Args:
            x: ``[B, T, hidden]`` normalised hidden states.
            cos: ``[B, T, qk_rope_head_dim // 2]`` RoPE cosines.
            sin: ``[B, T, qk_rope_head_dim // 2]`` RoPE sines.

        Returns:
            ``(q_nope [B, T, H, dn], q_rope [B, T, H, dr], c_kv [B, T, kv_lora_rank],
            k_rope [B, T, dr])``, the rotary parts rotated.
        """
        mla = self.mla
        q = self.project_query(x)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        c_kv = self.kv_a_layernorm(c_kv)
        q_rope = self._rotate(q_rope, cos, sin)
        k_rope = self._rotate(k_rope[..., None, :], cos, sin)[..., 0, :]
        return q_nope, q_rope, c_kv, self.rope_key_input(k_rope)

    def up_project(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full per-head queries, keys and values (the non-absorbed form).

        Args:
            q_nope: ``[B, T, H, dn]``.
            q_rope: ``[B, T, H, dr]`` (rotated).
            c_kv: ``[B, T, kv_lora_rank]``.
            k_rope: ``[B, T, dr]`` (rotated).

        Returns:
            ``(q, k, v)``: ``[B, T, H, dn + dr]`` twice and ``[B, T, H, dv]``.
        """
        mla = self.mla
        kv = self.kv_b_proj(c_kv).unflatten(-1, (-1, mla.qk_nope_head_dim + mla.v_head_dim))
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[..., None, :].expand(*k_nope.shape[:-1], -1)), dim=-1)
        return torch.cat((q_nope, q_rope), dim=-1), k, v

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's key and value up-projections, per head.

        Returns:
            ``(w_uk [H, dn, kv_lora_rank], w_uv [H, dv, kv_lora_rank])`` (views of
            ``kv_b_proj.weight``).
        """
        mla = self.mla
        weight = self.kv_b_proj.weight.view(
            -1, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        return weight[:, : mla.qk_nope_head_dim], weight[:, mla.qk_nope_head_dim :]

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
            cos: ``[B, T, qk_rope_head_dim // 2]`` RoPE cosines (with YaRN's magnitude).
            sin: ``[B, T, qk_rope_head_dim // 2]`` RoPE sines.
            mask: Mask of the forward pass (None when ``kv_cache`` attends).
            kv_cache: Caller-owned cache: a latent cache (``attend_latent``) runs the absorbed
                form, any other :class:`~mcore_models.KVCache` gets up-projected heads.
            reduce_output: With a row-parallel ``o_proj``, False returns this rank's partial
                sum instead of the reduced output.

        Returns:
            ``[B, T, hidden]`` output of the output projection (or its partial sum).
        """
        q_nope, q_rope, c_kv, k_rope = self.latent(x, cos, sin)
        if kv_cache is not None and hasattr(kv_cache, "attend_latent"):
            out = self._attend_absorbed(kv_cache, q_nope, q_rope, c_kv, k_rope)
        else:
            q, k, v = self.up_project(q_nope, q_rope, c_kv, k_rope)
            out = self._attend_heads(kv_cache, mask, q, k, v)
        if reduce_output:
            return self.o_proj(out.flatten(-2))
        return F.linear(out.flatten(-2), self.o_proj.weight)

    def _attend_heads(
        self,
        kv_cache: KVCache | None,
        mask: AttentionMask | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        value_dim = v.shape[-1]
        if value_dim != k.shape[-1] and (kv_cache is not None or q.is_cuda):
            # NOTE: KV caches and the fused SDPA kernels take one head width; zero value
            # channels add nothing to the output and are cut off again.
            v = F.pad(v, (0, k.shape[-1] - value_dim))
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q[0], k[0], v[0], scale=self.scale)[None]
        else:
            assert mask is not None
            if self.config.qk_clip_tracking:
                self._record_max_logits(max_attention_logits(q, k, mask, self.scale))
            out = attend(self.config.attention_backend, q, k, v, mask, self.scale)
        return out[..., :value_dim]

    def _attend_absorbed(
        self,
        kv_cache: KVCache,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        c_kv: torch.Tensor,
        k_rope: torch.Tensor,
    ) -> torch.Tensor:
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("thd,hdr->thr", q_nope[0], w_uk)
        out_latent = kv_cache.attend_latent(  # type: ignore[attr-defined]
            self.layer_idx, q_latent, q_rope[0], c_kv[0], k_rope[0], scale=self.scale
        )
        return torch.einsum("thr,hvr->thv", out_latent.to(w_uv.dtype), w_uv)[None]

    def _record_max_logits(self, step_max: torch.Tensor) -> None:
        if self.max_logits is None:
            self.max_logits = step_max
        else:
            self.max_logits = torch.maximum(self.max_logits, step_max)
