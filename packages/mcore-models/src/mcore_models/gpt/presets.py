"""Named GPT presets: the shapes of public Llama and Qwen checkpoints.

Values are those of each model's ``config.json`` on the Hugging Face Hub
(meta-llama/Llama-3.2-1B, meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B,
Qwen/Qwen2.5-7B, Qwen/Qwen3-0.6B, Qwen/Qwen3-8B, deepseek-ai/DeepSeek-V3,
moonshotai/Kimi-K2-Instruct-0905; the last two are shapes only: no weights ship with mcore, and
their multi-token-prediction layer is not part of the preset). Presets are functions so that
every call returns fresh field values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PRESETS", "preset_names"]


def _tiny() -> dict[str, Any]:
    return dict(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        max_position_embeddings=512,
        dtype="float32",
    )


def _llama_3_2_1b() -> dict[str, Any]:
    return dict(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        dtype="bfloat16",
    )


def _llama_3_8b() -> dict[str, Any]:
    return dict(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_position_embeddings=8192,
        dtype="bfloat16",
    )


def _qwen2_5(
    hidden: int, layers: int, heads: int, groups: int, ffn: int, vocab: int, tied: bool
) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        add_qkv_bias=True,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
        dtype="bfloat16",
    )


def _qwen3(
    hidden: int, layers: int, heads: int, groups: int, ffn: int, tied: bool
) -> dict[str, Any]:
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=128,
        ffn_hidden_size=ffn,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_layernorm=True,
        tie_word_embeddings=tied,
        max_position_embeddings=40960,
        dtype="bfloat16",
    )


def _tiny_mla(*, moe: bool) -> dict[str, Any]:
    fields = dict(
        _tiny(),
        num_query_groups=None,
        attention_type="mla",
        mla=dict(
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            yarn=dict(factor=4.0, original_max_position_embeddings=128, mscale_all_dim=1.0),
        ),
    )
    if moe:
        fields["moe"] = dict(
            num_experts=8,
            top_k=2,
            expert_ffn_hidden_size=32,
            shared_expert_ffn_hidden_size=32,
            router_score="sigmoid",
            router_expert_bias=True,
            router_num_groups=4,
            router_group_top_k=2,
            router_scaling_factor=2.5,
            dense_layers=(0,),
        )
    return fields


def _deepseek_v3_family(
    *,
    vocab: int,
    heads: int,
    experts: int,
    groups: int,
    group_top_k: int,
    scaling: float,
    first_dense: int,
    theta: float,
    yarn: dict[str, Any],
    max_positions: int,
) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=heads,
        head_dim=192,
        ffn_hidden_size=18432,
        rope_theta=theta,
        norm_eps=1e-6,
        max_position_embeddings=max_positions,
        dtype="bfloat16",
        attention_type="mla",
        mla=dict(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            yarn=dict(yarn, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
        ),
        moe=dict(
            num_experts=experts,
            top_k=8,
            expert_ffn_hidden_size=2048,
            shared_expert_ffn_hidden_size=2048,
            router_score="sigmoid",
            router_expert_bias=True,
            router_num_groups=groups,
            router_group_top_k=group_top_k,
            router_scaling_factor=scaling,
            dense_layers=tuple(range(first_dense)),
        ),
    )


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny": _tiny,
    "llama-3.2-1b": _llama_3_2_1b,
    "llama-3-8b": _llama_3_8b,
    "qwen2.5-0.5b": lambda: _qwen2_5(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": lambda: _qwen2_5(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": lambda: _qwen2_5(3584, 28, 28, 4, 18944, 152064, False),
    "qwen3-0.6b": lambda: _qwen3(1024, 28, 16, 8, 3072, True),
    "qwen3-8b": lambda: _qwen3(4096, 36, 32, 8, 12288, False),
    "tiny-mla": lambda: _tiny_mla(moe=False),
    "tiny-mla-moe": lambda: _tiny_mla(moe=True),
    "deepseek-v3": lambda: _deepseek_v3_family(
        vocab=129280,
        heads=128,
        experts=256,
        groups=8,
        group_top_k=4,
        scaling=2.5,
        first_dense=3,
        theta=10000.0,
        yarn=dict(factor=40.0, beta_fast=32.0, beta_slow=1.0),
        max_positions=163840,
    ),
    "kimi-k2": lambda: _deepseek_v3_family(
        vocab=163840,
        heads=64,
        experts=384,
        groups=1,
        group_top_k=1,
        scaling=2.827,
        first_dense=1,
        theta=50000.0,
        yarn=dict(factor=64.0, beta_fast=1.0, beta_slow=1.0),
        max_positions=262144,
    ),
}
"""Preset name -> function returning the GPTConfig fields of that preset."""


def preset_names() -> list[str]:
    """List the names accepted by :meth:`GPTConfig.from_name`.

    Returns:
        The preset names, sorted.
    """
    return sorted(PRESETS)
