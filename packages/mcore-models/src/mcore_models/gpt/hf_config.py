"""Hugging Face translation of Llama / Qwen2 / Qwen3 (and the MoE and MLA families'
dense part): ``config.json`` to and from :class:`~mcore_models.GPTConfig`, parameter names to
and from GPTModel's. Loading and saving weights is :mod:`mcore_models.gpt.hf`."""

from __future__ import annotations

import re
from typing import Any

import torch

from mcore_models.errors import CheckpointFormatError
from mcore_models.gpt.config import GPTConfig, RopeScaling

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "hf_name",
    "mcore_name",
]

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
"""Hugging Face ``model_type`` -> architecture class name (mixtral to dots1 are MoE families,
translated by :mod:`mcore_models.moe.hf`; deepseek_v3 is MLA + MoE, translated by
:mod:`mcore_models.gpt.mla_hf`)."""

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# (mcore pattern, Hugging Face pattern); ``{i}`` is the layer index.
_NAME_PAIRS = [
    (r"embedding\.weight", r"model\.embed_tokens\.weight"),
    (r"final_norm\.weight", r"model\.norm\.weight"),
    (r"output_layer\.weight", r"lm_head\.weight"),
    (r"layers\.(\d+)\.input_norm\.weight", r"model\.layers\.(\d+)\.input_layernorm\.weight"),
    (
        r"layers\.(\d+)\.post_attention_norm\.weight",
        r"model\.layers\.(\d+)\.post_attention_layernorm\.weight",
    ),
    (
        r"layers\.(\d+)\.self_attention\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.(weight|bias)",
        r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.(weight|bias)",
    ),
    (
        r"layers\.(\d+)\.self_attention\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
        r"q_a_layernorm|kv_a_layernorm)\.(weight)",
        r"model\.layers\.(\d+)\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
        r"q_a_layernorm|kv_a_layernorm)\.(weight)",
    ),
    (
        r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight",
        r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight",
    ),
]


def _template(pattern: str) -> str:
    template = pattern.replace("\\.", ".")
    for index in range(1, 4):
        template = re.sub(r"\([^)]*\)", f"{{{index}}}", template, count=1)
    return template


def _translate(name: str, source: int) -> str | None:
    for pair in _NAME_PAIRS:
        match = re.fullmatch(pair[source], name)
        if match:
            return _template(pair[1 - source]).format(None, *match.groups())
    return None


def hf_name(name: str) -> str:
    """Translate a GPTModel parameter name to its Hugging Face name.

    Args:
        name: Parameter name in ``GPTModel.state_dict()``.

    Returns:
        The Hugging Face name.

    Raises:
        CheckpointFormatError: If the name has no Hugging Face counterpart.
    """
    translated = _translate(name, 0)
    if translated is None:
        raise CheckpointFormatError(f"parameter {name!r} has no Hugging Face counterpart")
    return translated


def mcore_name(name: str) -> str | None:
    """Translate a Hugging Face tensor name to the GPTModel parameter name.

    Args:
        name: Tensor name in a Hugging Face checkpoint.

    Returns:
        The GPTModel name, or None if the tensor is not a model weight.
    """
    return _translate(name, 1)


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """Build a GPTConfig from a Hugging Face ``config.json`` dictionary.

    Reads both the transformers 4 layout (``rope_theta``, ``rope_scaling``) and the
    transformers 5 layout (``rope_parameters``).

    Args:
        hf: Parsed ``config.json``.
        **overrides: GPTConfig fields to set on top.

    Returns:
        The config.

    Raises:
        CheckpointFormatError: If the architecture or one of its options is unsupported.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointFormatError(
            f"model_type={model_type!r} is not supported; expected one of "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "deepseek_v3":
        from mcore_models.gpt.mla_hf import mla_config_from_hf

        return mla_config_from_hf(hf, **overrides)
    missing = [key for key in _REQUIRED_KEYS if key not in hf]
    if missing:
        raise CheckpointFormatError(
            f"config.json (model_type={model_type!r}) lacks {missing}; expected every one of "
            f"{list(_REQUIRED_KEYS)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(
            f"hidden_act={hf['hidden_act']!r} is not supported; expected 'silu'"
        )
    if hf.get("mlp_bias", False):
        raise CheckpointFormatError("mlp_bias=True is not supported; expected bias-free MLPs")
    if hf.get("use_sliding_window", False):
        raise CheckpointFormatError("use_sliding_window=True is not supported")
    rope = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type")))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = None
    if rope_type == "llama3":
        source = rope if "factor" in rope else legacy_scaling
        scaling = RopeScaling(
            factor=float(source["factor"]),
            low_freq_factor=float(source["low_freq_factor"]),
            high_freq_factor=float(source["high_freq_factor"]),
            original_max_position_embeddings=int(source["original_max_position_embeddings"]),
        )
    elif rope_type not in (None, "default"):
        raise CheckpointFormatError(
            f"rope_type={rope_type!r} is not supported; expected 'default' or 'llama3'"
        )
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=float(theta),
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_layernorm=model_type == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        dtype=dtype,
    )
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "dots1"):
        from mcore_models.moe.hf import moe_fields_from_hf

        fields.update(moe_fields_from_hf(hf))
    fields.update(overrides)
    return GPTConfig(**fields)


def config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """Build the Hugging Face ``config.json`` dictionary of a GPTConfig.

    The model type is Qwen3 with QK-norm, Qwen2 with QKV bias, Llama otherwise. Both the
    transformers 4 and 5 RoPE fields are written.

    Args:
        config: The config.

    Returns:
        The dictionary.
    """
    if config.mla is not None:
        from mcore_models.gpt.mla_hf import mla_config_to_hf

        return mla_config_to_hf(config, _DTYPE_NAMES[config.dtype])
    if config.qk_layernorm:
        model_type = "qwen3"
    elif config.add_qkv_bias:
        model_type = "qwen2"
    else:
        model_type = "llama"
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling = None
    if config.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": config.rope_scaling.factor,
            "low_freq_factor": config.rope_scaling.low_freq_factor,
            "high_freq_factor": config.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings,
        }
        rope_parameters.update(rope_scaling)
    hf: dict[str, Any] = {
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.kv_channels,
        "intermediate_size": config.ffn_hidden_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.add_qkv_bias,
        "torch_dtype": _DTYPE_NAMES[config.dtype],
        "dtype": _DTYPE_NAMES[config.dtype],
    }
    if model_type == "llama":
        hf["mlp_bias"] = False
    else:
        hf["use_sliding_window"] = False
    if config.moe is not None:
        from mcore_models.moe.hf import moe_config_to_hf

        hf = moe_config_to_hf(config, hf)
    return hf
