"""Hugging Face interop of DeepSeek-V3-layout checkpoints (``model_type: deepseek_v3``).

The attention is MLA (:mod:`mcore_models.gpt.mla`, tensor names as in the checkpoint), the
MLP of the first ``first_k_dense_replace`` layers is dense and every later one is a MoE layer
with a sigmoid router, an expert score-correction bias used for the choice only,
group-limited top-k (``n_group``/``topk_group``), a routed scaling factor and
``n_shared_experts`` always-on experts (stored as one SwiGLU of their summed width). The
same layout serves Kimi K2 (which ships as ``deepseek_v3``). Expert tensors are translated
by :mod:`mcore_models.moe.hf`.
"""

from __future__ import annotations

from typing import Any

from mcore_models.errors import CheckpointFormatError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.mla_config import MLAConfig, YarnScaling
from mcore_models.moe.config import MoEConfig

__all__ = ["MLA_MODEL_TYPE", "mla_config_from_hf", "mla_config_to_hf"]

MLA_MODEL_TYPE = "deepseek_v3"
"""The Hugging Face ``model_type`` of MLA checkpoints."""


def _rope(hf: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """RoPE base and YaRN scaling from the transformers 5 or legacy fields."""
    rope = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    source = rope if rope.get("rope_type") not in (None, "default") else legacy
    kind = source.get("rope_type", source.get("type"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise CheckpointFormatError(
            f"rope_type={kind!r} is not supported for deepseek_v3; expected 'default' or 'yarn'"
        )
    original = int(source["original_max_position_embeddings"])
    factor = source.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    if source.get("attention_factor") is not None:
        raise CheckpointFormatError(
            f"attention_factor={source['attention_factor']!r} is not supported; expected it "
            "derived from mscale and mscale_all_dim"
        )
    yarn = YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(source.get("beta_fast") or 32.0),
        beta_slow=float(source.get("beta_slow") or 1.0),
        mscale=float(source.get("mscale") or 0.0),
        mscale_all_dim=float(source.get("mscale_all_dim") or 0.0),
        truncate=bool(source.get("truncate", True)),
    )
    return theta, yarn


def _moe(hf: dict[str, Any]) -> MoEConfig | None:
    layers = int(hf["num_hidden_layers"])
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    if first_dense >= layers:
        return None
    if int(hf.get("moe_layer_freq") or 1) != 1:
        raise CheckpointFormatError(
            f"moe_layer_freq={hf['moe_layer_freq']!r} is not supported; expected 1"
        )
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise CheckpointFormatError(
            f"scoring_func={scoring!r} is not supported for deepseek_v3; expected 'sigmoid'"
        )
    ffn = int(hf["moe_intermediate_size"])
    return MoEConfig(
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_ffn_hidden_size=ffn,
        shared_expert_ffn_hidden_size=ffn * int(hf.get("n_shared_experts") or 0),
        router_score="sigmoid",
        router_expert_bias=True,
        normalize_top_k=bool(hf.get("norm_topk_prob", True)),
        router_num_groups=int(hf.get("n_group") or 1),
        router_group_top_k=int(hf.get("topk_group") or 1),
        router_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        dense_layers=tuple(range(first_dense)),
    )


def mla_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """Build a GPTConfig from a ``deepseek_v3`` ``config.json`` dictionary.

    Args:
        hf: Parsed ``config.json``.
        **overrides: GPTConfig fields to set on top.

    Returns:
        The config (``attention_type="mla"``).

    Raises:
        CheckpointFormatError: If the config uses an unsupported option.
    """
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(
            f"hidden_act={hf['hidden_act']!r} is not supported; expected 'silu'"
        )
    if hf.get("attention_bias", False):
        raise CheckpointFormatError(
            "attention_bias=True is not supported for deepseek_v3; expected False"
        )
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method")
        raise CheckpointFormatError(
            f"quantization_config (quant_method={method!r}) is not supported; expected an "
            "unquantized checkpoint (dequantize the fp8 weights to bfloat16 first)"
        )
    theta, yarn = _rope(hf)
    q_lora_rank = hf.get("q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        yarn=yarn,
    )
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        head_dim=mla.qk_head_dim,
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        dtype=dtype,
        attention_type="mla",
        mla=mla,
        moe=_moe(hf),
    )
    fields.update(overrides)
    return GPTConfig(**fields)


def _moe_to_hf(config: GPTConfig, hf: dict[str, Any]) -> None:
    moe = config.moe
    if moe is None:
        hf["first_k_dense_replace"] = config.num_layers
        return
    ffn = moe.expert_ffn_hidden_size or config.ffn_hidden_size
    first_dense = len(moe.dense_layers)
    shared = moe.shared_expert_ffn_hidden_size
    if (
        moe.router_score != "sigmoid"
        or not moe.router_expert_bias
        or moe.shared_expert_gate
        or shared % ffn
        or moe.layer_step != 1
        or moe.dense_layers != tuple(range(first_dense))
    ):
        raise CheckpointFormatError(
            "a deepseek_v3 checkpoint needs router_score='sigmoid', router_expert_bias=True, "
            "an ungated shared expert whose width is a multiple of the expert width and dense "
            f"layers only as a prefix; got router_score={moe.router_score!r}, "
            f"router_expert_bias={moe.router_expert_bias}, shared_expert_gate="
            f"{moe.shared_expert_gate}, shared_expert_ffn_hidden_size={shared}, expert width "
            f"{ffn}, layer_step={moe.layer_step}, dense_layers={moe.dense_layers}"
        )
    hf.update(
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=ffn,
        n_shared_experts=shared // ffn,
        norm_topk_prob=moe.normalize_top_k,
        n_group=moe.router_num_groups,
        topk_group=moe.router_group_top_k,
        routed_scaling_factor=moe.router_scaling_factor,
        first_k_dense_replace=first_dense,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )


def mla_config_to_hf(config: GPTConfig, dtype_name: str) -> dict[str, Any]:
    """Build the ``deepseek_v3`` ``config.json`` dictionary of an MLA GPTConfig.

    Args:
        config: The config (``attention_type="mla"``).
        dtype_name: Name of the parameter dtype ("float32", "bfloat16", "float16").

    Returns:
        The dictionary (transformers 5 ``rope_parameters`` and the legacy ``rope_scaling``).

    Raises:
        CheckpointFormatError: If the MoE options have no DeepSeek-V3 counterpart.
    """
    mla = config.mla
    assert mla is not None
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling = None
    if mla.yarn is not None:
        yarn = mla.yarn
        rope_scaling = {
            "rope_type": "yarn",
            "type": "yarn",
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
            "truncate": yarn.truncate,
        }
        rope_parameters.update(rope_scaling)
        del rope_parameters["type"]
    hf: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MLA_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "intermediate_size": config.ffn_hidden_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    _moe_to_hf(config, hf)
    return hf
