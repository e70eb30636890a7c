"""Tiny random DeepSeek-V3 checkpoints built with transformers, shared by the MLA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 96


def deepseek_v3_config(*, q_lora: bool, yarn: bool, moe: bool, interleave: bool = True) -> Any:
    """A tiny ``DeepseekV3Config`` (transformers): 2 layers, 4 heads, MLA ranks 16/24.

    Args:
        q_lora: Low-rank queries (``q_lora_rank=24``) or a full-rank query projection.
        yarn: YaRN rope scaling with both mscale corrections (factor 8 over 16 positions, so
            that it changes the frequencies at the test lengths).
        moe: The second layer is a DeepSeek-V3 MoE layer (8 experts in 4 groups, 2 groups and
            3 experts per token, 2 shared experts, routed scaling 2.5).
        interleave: DeepSeek's interleaved rotary layout.

    Returns:
        The config.
    """
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1 if moe else 2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=24 if q_lora else None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_interleave=interleave,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if yarn:
        fields["rope_parameters"] = dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=8.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.9,
            mscale_all_dim=0.7,
        )
    return transformers.DeepseekV3Config(**fields)


def deepseek_v3_model(**options: bool) -> Any:
    """A random-weight ``DeepseekV3ForCausalLM`` in float32 (every weight and norm random).

    Args:
        **options: Passed to :func:`deepseek_v3_config`.

    Returns:
        The model in eval mode.
    """
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(deepseek_v3_config(**options)).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    return model


def save_deepseek_v3(directory: Path, **options: bool) -> Any:
    """Build a tiny model with :func:`deepseek_v3_model` and ``save_pretrained`` it.

    Args:
        directory: Output directory.
        **options: Passed to :func:`deepseek_v3_config`.

    Returns:
        The transformers model.
    """
    model = deepseek_v3_model(**options)
    model.save_pretrained(directory)
    return model
