"""Hugging Face import and export of ``mamba2`` and ``nemotron_h`` checkpoints.

Parameter names follow the Hugging Face ones under the prefix of each architecture
(``backbone.``, also ``model.`` for Nemotron-H): ``embeddings``, ``layers.{i}.norm``,
``layers.{i}.mixer.*`` and ``norm_f``, plus ``lm_head``. The one layout difference is the
convolution: Hugging Face stores ``conv1d.weight`` as ``[channels, 1, K]`` (an ``nn.Conv1d``),
mcore as ``conv_weight`` ``[channels, K]``.

Nemotron-H MoE layers (``E``) use a sigmoid router with score-correction bias and ungated
experts that the mcore MoE layer does not implement; such checkpoints are refused with a
:class:`CheckpointFormatError` rather than loaded wrongly.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from mcore_models.errors import CheckpointFormatError, ModelConfigError
from mcore_models.hf_io import SafetensorsReader
from mcore_models.mamba.config import HybridConfig
from mcore_models.mamba.model import HybridModel

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["hf_config_to_hybrid", "hybrid_to_hf_config", "load_hybrid_hf", "save_hybrid_hf"]

_PREFIX = {"mamba2": "backbone", "nemotron_h": "backbone"}
"""Prefix of the backbone tensors in the files (transformers keeps Nemotron-H's on-disk
``backbone.`` names and maps them to ``model.`` in memory; loading accepts both)."""
_ARCHITECTURES = {"mamba2": "Mamba2ForCausalLM", "nemotron_h": "NemotronHForCausalLM"}
_BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NAMED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _float(value: Any) -> float:
    # transformers writes infinity as {"__float__": "Infinity"} to keep config.json valid JSON.
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _require(hf: dict[str, Any], key: str, expected: Any) -> None:
    value = hf.get(key, expected)
    if value != expected:
        raise CheckpointFormatError(
            f"config.json {key}={value!r} is not supported; expected {expected!r}"
        )


def _pattern(hf: dict[str, Any]) -> str:
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types:
        reverse = {v: k for k, v in _BLOCK_TYPES.items()}
        legacy = {"mamba": "M", "attention": "*"}
        unknown = [t for t in types if t not in reverse and t not in legacy]
        if unknown:
            raise CheckpointFormatError(f"config.json layers_block_type has unknown {unknown}")
        return "".join(reverse.get(t) or legacy[t] for t in types)
    pattern = hf.get("hybrid_override_pattern")
    if not pattern:
        raise CheckpointFormatError("config.json has neither layers_block_type nor a pattern")
    return str(pattern)


def hf_config_to_hybrid(hf: dict[str, Any], **overrides: Any) -> HybridConfig:
    """Translate a Hugging Face ``mamba2`` / ``nemotron_h`` config dict.

    Args:
        hf: Parsed ``config.json``.
        **overrides: :class:`HybridConfig` fields to set.

    Returns:
        The config.

    Raises:
        CheckpointFormatError: If the model type or an option is not supported.
    """
    model_type = hf.get("model_type")
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    common: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "ssm_state_size": hf["state_size"] if model_type == "mamba2" else hf["ssm_state_size"],
        "conv_kernel": hf.get("conv_kernel", 4),
        "use_conv_bias": hf.get("use_conv_bias", True),
        "mamba_num_groups": hf.get("n_groups", 1),
        "time_step_min": hf.get("time_step_min", 0.001),
        "time_step_max": hf.get("time_step_max", 0.1),
        "time_step_floor": hf.get("time_step_floor", 1e-4),
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "dtype": dtype if dtype in _NAMED_DTYPES else "float32",
        "chunk_size": 1 << max(4, (int(hf.get("chunk_size", 256)) - 1).bit_length()),
    }
    if model_type == "mamba2":
        _require(hf, "hidden_act", "silu")
        limit = hf.get("time_step_limit", (0.0, math.inf))
        config = {
            **common,
            "layer_pattern": "M" * hf["num_hidden_layers"],
            "mamba_num_heads": hf["num_heads"],
            "mamba_head_dim": hf["head_dim"],
            "mamba_proj_bias": hf.get("use_bias", False),
            "time_step_limit": (_float(limit[0]), _float(limit[1])),
            "residual_in_fp32": hf.get("residual_in_fp32", True),
        }
    elif model_type == "nemotron_h":
        _require(hf, "mamba_hidden_act", "silu")
        _require(hf, "mlp_hidden_act", "relu2")
        _require(hf, "mlp_bias", False)
        _require(hf, "attention_bias", False)
        pattern = _pattern(hf)
        if "E" in pattern:
            raise CheckpointFormatError(
                f"nemotron_h pattern {pattern!r} has MoE layers (E): their sigmoid router and "
                "ungated experts are not implemented by mcore's MoE layer"
            )
        config = {
            **common,
            "layer_pattern": pattern,
            "mamba_num_heads": hf["mamba_num_heads"],
            "mamba_head_dim": hf["mamba_head_dim"],
            "mamba_proj_bias": hf.get("use_bias", False),
            # Nemotron-H clamps the time step from below at time_step_min.
            "time_step_limit": (float(hf.get("time_step_min", 0.001)), math.inf),
            "num_attention_heads": hf["num_attention_heads"],
            "num_query_groups": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "head_dim": hf.get("head_dim"),
            "ffn_hidden_size": hf["intermediate_size"],
            "mlp_activation": "relu2",
            "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        }
    else:
        raise CheckpointFormatError(
            f"config.json model_type={model_type!r} is not a hybrid model; expected one of "
            f"{sorted(_PREFIX)}"
        )
    config["extra"] = {"model_type": model_type}
    config.update(overrides)
    return HybridConfig(**config)


def hybrid_to_hf_config(config: HybridConfig) -> dict[str, Any]:
    """Translate a config to a Hugging Face ``config.json`` dict.

    A pure Mamba model whose time-step clamp has no lower bound is written as ``mamba2``;
    anything else as ``nemotron_h`` (unless ``config.extra["model_type"]`` says otherwise).

    Args:
        config: The config.

    Returns:
        The ``config.json`` content.

    Raises:
        CheckpointFormatError: If the config cannot be expressed in the target format.
    """
    model_type = config.extra.get("model_type")
    if model_type is None:
        pure = set(config.layer_pattern) == {"M"}
        model_type = "mamba2" if pure and config.time_step_limit[0] == 0.0 else "nemotron_h"
    dtype = {v: k for k, v in _NAMED_DTYPES.items()}[config.dtype]
    common = {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "conv_kernel": config.conv_kernel,
        "use_conv_bias": config.use_conv_bias,
        "n_groups": config.mamba_num_groups,
        "time_step_min": config.time_step_min,
        "time_step_max": config.time_step_max,
        "time_step_floor": config.time_step_floor,
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "chunk_size": config.chunk_size,
        "use_bias": config.mamba_proj_bias,
        "dtype": dtype,
    }
    if model_type == "mamba2":
        if set(config.layer_pattern) != {"M"}:
            raise CheckpointFormatError(
                f"layer_pattern={config.layer_pattern!r}: mamba2 holds Mamba layers only"
            )
        inner = config.mamba_inner_size
        if inner % config.hidden_size:
            raise CheckpointFormatError(
                f"mamba heads * head_dim = {inner} is not a multiple of hidden_size="
                f"{config.hidden_size} (mamba2's expand factor)"
            )
        return {
            **common,
            "num_hidden_layers": config.num_layers,
            "num_heads": config.mamba_num_heads,
            "head_dim": config.mamba_head_dim,
            "expand": inner // config.hidden_size,
            "state_size": config.ssm_state_size,
            "time_step_limit": list(config.time_step_limit),
            "residual_in_fp32": config.residual_in_fp32,
            "hidden_act": "silu",
        }
    if "E" in config.layer_pattern or config.mlp_activation != "relu2":
        raise CheckpointFormatError(
            f"layer_pattern={config.layer_pattern!r}, mlp_activation={config.mlp_activation!r}"
            ": nemotron_h export supports M, * and - layers with squared-ReLU MLPs"
        )
    if config.residual_in_fp32:
        raise CheckpointFormatError("residual_in_fp32=True has no nemotron_h equivalent")
    return {
        **common,
        "layers_block_type": [_BLOCK_TYPES[c] for c in config.layer_pattern],
        "num_hidden_layers": config.num_layers,
        "mamba_num_heads": config.mamba_num_heads,
        "mamba_head_dim": config.mamba_head_dim,
        "ssm_state_size": config.ssm_state_size,
        "mamba_hidden_act": "silu",
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.kv_channels,
        "intermediate_size": config.ffn_hidden_size,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "attention_bias": False,
        "max_position_embeddings": config.max_position_embeddings,
        "residual_in_fp32": False,
    }


def _hf_name(name: str, prefix: str) -> str:
    if name == "output_layer.weight":
        return "lm_head.weight"
    if name == "embedding.weight":
        return f"{prefix}.embeddings.weight"
    if name.startswith("final_norm."):
        return f"{prefix}.norm_f." + name.split(".", 1)[1]
    name = name.replace(".mixer.conv_weight", ".mixer.conv1d.weight")
    name = name.replace(".mixer.conv_bias", ".mixer.conv1d.bias")
    return f"{prefix}.{name}"


def load_hybrid_hf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    state: ParallelState | None = None,
    **config_overrides: Any,
) -> HybridModel:
    """Load a Hugging Face ``mamba2`` / ``nemotron_h`` checkpoint into a :class:`HybridModel`.

    Args:
        path: Checkpoint directory (``config.json`` and safetensors).
        dtype: Parameter dtype (default: the checkpoint's).
        device: Device of the parameters (default CPU, or ``state.device``).
        state: Parallel state to shard for (tensor parallelism over heads), or None.
        **config_overrides: :class:`HybridConfig` fields to set.

    Returns:
        The model.

    Raises:
        CheckpointFormatError: If the config or a tensor does not match.
    """
    directory = Path(path)
    hf = json.loads((directory / "config.json").read_text())
    if dtype is not None:
        config_overrides["dtype"] = dtype
    config = hf_config_to_hybrid(hf, **config_overrides)
    target = device if device is not None else (state.device if state is not None else "cpu")
    model = HybridModel(config, device="meta")
    reader = SafetensorsReader(directory)
    prefix = _PREFIX[config.extra["model_type"]]
    if f"{prefix}.embeddings.weight" not in reader.files:
        prefix = "model"
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, param in model.named_parameters():
            hf_name = _hf_name(name, prefix)
            if name == "output_layer.weight" and hf_name not in reader.files:
                hf_name = f"{prefix}.embeddings.weight"  # tied in the checkpoint
            value = reader.read(hf_name)
            if value.dim() == 3 and name.endswith("conv_weight"):
                value = value[:, 0]
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointFormatError(
                    f"tensor {hf_name!r} has shape {tuple(value.shape)}; the config expects "
                    f"{tuple(param.shape)}"
                )
            tensors[name] = value.to(device=target, dtype=param.dtype)
    finally:
        reader.close()
    model.load_state_dict(tensors, strict=True, assign=True)
    if state is not None and state.tp_size > 1:
        from mcore_models.mamba.parallelize import parallelize_hybrid

        parallelize_hybrid(model, state)
    return model


def save_hybrid_hf(model: HybridModel, directory: str | os.PathLike[str]) -> None:
    """Write a whole (unsharded, single-stage) model as a Hugging Face checkpoint.

    Args:
        model: The model.
        directory: Output directory (created if missing).

    Raises:
        ModelConfigError: If the model is tensor-parallel or a pipeline stage.
        CheckpointFormatError: If the config has no Hugging Face equivalent.
    """
    if model.tp_group is not None or not (model.pre_process and model.post_process):
        raise ModelConfigError(
            "save_hybrid_hf writes whole models; gather the shards or stages first"
        )
    hf_config = hybrid_to_hf_config(model.config)
    prefix = _PREFIX[hf_config["model_type"]]
    tensors = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if name.endswith("conv_weight"):
            value = value[:, None, :]
        tensors[_hf_name(name, prefix)] = value.contiguous().cpu()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
