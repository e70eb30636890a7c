"""Hugging Face interop: Llama / Qwen2 / Qwen3 ``config.json`` + safetensors to and from GPTModel."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore_models.errors import CheckpointFormatError
from mcore_models.gpt.config import GPTConfig, RopeScaling

if TYPE_CHECKING:
    from mcore_models.gpt.model import GPTModel
    from mcore_parallel.state import ParallelState

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "hf_name",
    "load_hf",
    "mcore_name",
    "save_hf",
]

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
}
"""Hugging Face ``model_type`` -> architecture class name (the last four are MoE families,
translated by :mod:`mcore_models.moe.hf`)."""

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


def _checkpoint_files(directory: Path) -> dict[str, Path]:
    """Map every tensor name of a checkpoint to the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise CheckpointFormatError(
            f"path={str(directory)!r} holds neither model.safetensors nor "
            "model.safetensors.index.json"
        )
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118


def load_hf(
    cls: type[GPTModel],
    path: str | os.PathLike[str],
    *,
    state: ParallelState | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """Load a Hugging Face checkpoint into a new model (see :meth:`GPTModel.from_hf`).

    Args:
        cls: The model class to build.
        path: Checkpoint directory.
        state: Parallel state, or None.
        dtype: Parameter dtype, default the checkpoint's.
        device: Device of the parameters.
        **config_overrides: GPTConfig fields to set.

    Returns:
        The model, sharded under tensor parallelism.

    Raises:
        CheckpointFormatError: If the checkpoint is unsupported or does not match.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointFormatError(f"path={str(directory)!r} has no config.json")
    overrides = dict(config_overrides, perform_initialization=False)
    if dtype is not None:
        overrides["dtype"] = dtype
    config = config_from_hf(json.loads(config_file.read_text()), **overrides)
    model = cls(config, device=device)
    files = _checkpoint_files(directory)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    handles: dict[Path, Any] = {}
    experts = None
    if config.moe is not None:
        from mcore_models.moe.hf import ExpertLoader

        experts = ExpertLoader(params, dict(model.named_buffers()))

    def read(name: str) -> torch.Tensor:
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(name)

    try:
        for name in sorted(files):
            if experts is not None and experts.load(name, read):
                continue
            target = mcore_name(name)
            if target is None or (target == "output_layer.weight" and config.tie_word_embeddings):
                if target is None and not name.endswith("rotary_emb.inv_freq"):
                    raise CheckpointFormatError(
                        f"tensor {name!r} of the checkpoint has no place in a "
                        f"{config_to_hf(config)['model_type']} GPTModel"
                    )
                continue
            if target not in params:
                raise CheckpointFormatError(
                    f"tensor {name!r} of the checkpoint has no place in the model (expected "
                    f"{target!r} to exist)"
                )
            tensor = read(name)
            param = params[target]
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointFormatError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                    f"{tuple(param.shape)} for {target!r}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)
    finally:
        handles.clear()
    if experts is not None:
        experts.check_experts_complete()
        loaded |= experts.loaded
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointFormatError(
            f"tensor {hf_name(missing[0])!r} is missing from the checkpoint at {str(directory)!r} "
            f"({len(missing)} missing in all)"
        )
    if state is not None:
        from mcore_models.gpt.parallelize import parallelize

        parallelize(model, state)
    return model


def save_hf(model: GPTModel, directory: str | os.PathLike[str]) -> None:
    """Write a model as a Hugging Face checkpoint (see :meth:`GPTModel.to_hf`).

    Each file is written under a temporary name and renamed into place, so an interrupted
    export never leaves a truncated ``model.safetensors`` behind. Under tensor parallelism the
    shards are gathered, rank 0 of the TP group writes, and every rank returns once the files
    exist.

    Args:
        model: The model (sharded models are gathered first).
        directory: Output directory.
    """
    group = model.tp_group
    if group is not None:
        from mcore_models.gpt.parallelize import full_state_dict

        state_dict = full_state_dict(model)
        if torch.distributed.get_rank(group) == 0:
            _write_hf(state_dict, model.config, Path(directory))
        torch.distributed.barrier(group=group)
    else:
        _write_hf(dict(model.state_dict()), model.config, Path(directory))


def _write_hf(state_dict: dict[str, torch.Tensor], config: GPTConfig, out: Path) -> None:
    hf_config = config_to_hf(config)
    out.mkdir(parents=True, exist_ok=True)
    named: dict[str, torch.Tensor] = {}
    if config.moe is not None:
        from mcore_models.moe.hf import moe_tensors_to_hf

        named, state_dict = moe_tensors_to_hf(state_dict, config, hf_config["model_type"])
    named.update((hf_name(name), tensor) for name, tensor in state_dict.items())
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named.items()}
    weights_tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(weights_tmp), metadata={"format": "pt"})
    config_tmp = out / "config.json.tmp"
    config_tmp.write_text(json.dumps(hf_config, indent=2) + "\n")
    os.replace(weights_tmp, out / "model.safetensors")
    os.replace(config_tmp, out / "config.json")
    # A sharded checkpoint exported here before would still be read through its index (by
    # from_hf and by transformers) instead of the new weights; drop it and its shards, as
    # transformers' save_pretrained does.
    index = out / "model.safetensors.index.json"
    if index.is_file():
        for shard in set(json.loads(index.read_text())["weight_map"].values()):
            if re.fullmatch(r"model-\d+-of-\d+\.safetensors", shard):
                (out / shard).unlink(missing_ok=True)
        index.unlink()
