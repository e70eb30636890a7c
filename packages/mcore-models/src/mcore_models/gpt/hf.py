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
from mcore_models.hf_io import HFPiece, SafetensorsReader, read_into
from mcore_models.init import GlobalSlice, iter_placed

if TYPE_CHECKING:
    from mcore_models.gpt.model import GPTModel
    from mcore_models.parallelize import PipelineLayout
    from mcore_parallel.state import ParallelState

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "hf_name",
    "hf_pieces",
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


def hf_pieces(
    name: str, global_shape: tuple[int, ...], config: GPTConfig, model_type: str
) -> list[HFPiece]:
    """The checkpoint tensors that compose one global mcore tensor.

    Args:
        name: Canonical mcore name (its name in the whole, unsharded model).
        global_shape: Shape of the global tensor.
        config: Model config.
        model_type: Hugging Face ``model_type`` of the checkpoint.

    Returns:
        The pieces (one for a dense tensor; one per expert for expert weights).
    """
    if config.moe is not None:
        from mcore_models.moe.hf import moe_hf_pieces

        pieces = moe_hf_pieces(name, global_shape, config, model_type)
        if pieces is not None:
            return pieces
    return [HFPiece(hf_name(name), tuple(slice(0, n) for n in global_shape))]


def _expected_hf_names(cls: type[GPTModel], config: GPTConfig, model_type: str) -> set[str]:
    """Every checkpoint tensor name a whole model of ``config`` reads (metadata only)."""
    whole = cls(config, device="meta")
    names: set[str] = set()
    for _tensor, where in _loadable(whole, config, model_type):
        for piece in hf_pieces(where.name, where.global_shape, config, model_type):
            names.add(piece.hf_name)
    return names


def _loadable(
    chunk: GPTModel, config: GPTConfig, model_type: str
) -> list[tuple[torch.Tensor, GlobalSlice]]:
    """Parameters and checkpointed buffers (e.g. routers' expert biases) with their places."""
    found = [(param, where) for _, param, where in iter_placed(chunk)]
    if config.moe is None:
        return found
    from mcore_models.moe.hf import moe_hf_pieces

    params = dict(chunk.named_parameters())
    for name, buffer in chunk.state_dict(keep_vars=True).items():
        if name in params:
            continue
        canonical = chunk.canonical_name(name)
        shape = tuple(buffer.shape)
        if moe_hf_pieces(canonical, shape, config, model_type) is not None:
            found.append((buffer, GlobalSlice(canonical, shape, (0,) * len(shape))))
    return found


def _is_extra_prediction_layer(name: str, config: GPTConfig, model_type: str) -> bool:
    """DeepSeek-V3 checkpoints append multi-token-prediction layers after the last layer."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return model_type == "deepseek_v3" and match is not None and int(match[1]) >= config.num_layers


def load_hf(
    cls: type[GPTModel],
    path: str | os.PathLike[str],
    *,
    state: ParallelState | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    sequence_parallel: bool | None = None,
    pipeline: PipelineLayout | None = None,
    reader: SafetensorsReader | None = None,
    context_parallel_method: str = "ring",
    **config_overrides: Any,
) -> GPTModel | list[GPTModel]:
    """Load a Hugging Face checkpoint into a new model (see :meth:`GPTModel.from_hf`).

    The model is built on the meta device, parallelized for ``state``, and each rank reads
    only its slices of the checkpoint tensors (safetensors' slice API), so the peak host
    memory of a rank is about its shard of the weights.

    Args:
        cls: The model class to build.
        path: Checkpoint directory.
        state: Parallel state, or None for the whole model on one rank.
        dtype: Parameter dtype, default the checkpoint's.
        device: Device of the parameters (default ``state.device`` or the default device).
        sequence_parallel: See :func:`mcore_models.parallelize`.
        pipeline: Pipeline layout (virtual stages, layer split) under pipeline parallelism.
        reader: An open checkpoint to read from (default: opened from ``path``).
        context_parallel_method: See :func:`mcore_models.parallelize` (``cp > 1``).
        **config_overrides: GPTConfig fields to set.

    Returns:
        The model, this rank's pipeline stage, or its list of chunks (virtual stages).

    Raises:
        CheckpointFormatError: If the checkpoint is unsupported or does not match.
    """
    from mcore_models.materialize import materialize_module
    from mcore_models.parallelize import parallelize

    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointFormatError(f"path={str(directory)!r} has no config.json")
    hf_config = json.loads(config_file.read_text())
    overrides = dict(config_overrides, perform_initialization=False)
    if dtype is not None:
        overrides["dtype"] = dtype
    config = config_from_hf(hf_config, **overrides)
    model_type = hf_config["model_type"]
    reader = reader or SafetensorsReader(directory)
    unexpected = sorted(
        name
        for name in set(reader.files) - _expected_hf_names(cls, config, model_type)
        if not name.endswith("rotary_emb.inv_freq")
        and not (name == "lm_head.weight" and config.tie_word_embeddings)
        and not _is_extra_prediction_layer(name, config, model_type)
    )
    if unexpected:
        raise CheckpointFormatError(
            f"tensor {unexpected[0]!r} of the checkpoint has no place in a {model_type} "
            f"GPTModel ({len(unexpected)} unexpected in all)"
        )
    model = cls(config, device="meta")
    result: GPTModel | list[GPTModel] = model
    if state is not None:
        result = parallelize(
            model,
            state,
            sequence_parallel=sequence_parallel,
            pipeline=pipeline,
            context_parallel_method=context_parallel_method,
        )
    target = device if device is not None else (state.device if state is not None else None)
    target = torch.device(target) if target is not None else torch.empty(0).device
    try:
        for chunk in result if isinstance(result, list) else [result]:
            materialize_module(
                chunk, target, seed=config.seed, init_std=config.init_std, initialize=False
            )
            for tensor, where in _loadable(chunk, config, model_type):
                pieces = hf_pieces(where.name, where.global_shape, config, model_type)
                read_into(tensor.data, where, pieces, reader)
    finally:
        reader.close()
    return result


def save_hf(
    model: GPTModel | list[GPTModel],
    directory: str | os.PathLike[str],
    *,
    state: ParallelState | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write a model as a Hugging Face checkpoint (see :meth:`GPTModel.to_hf`).

    Works from any layout: every parameter is gathered to full on the rank that writes its
    pipeline stage (tensor, expert and expert-tensor shards over their groups, one tensor at a
    time), each stage's writer writes its own safetensors shard files, and global rank 0 writes
    ``config.json`` and ``model.safetensors.index.json`` (or a single ``model.safetensors``
    when one file holds everything). Files are written under temporary names and renamed into
    place, so an interrupted export never leaves a truncated file behind. Every rank of the
    layout must call it.

    Args:
        model: The model, stage, or list of chunks (all chunks of this rank).
        directory: Output directory.
        state: Parallel state of a parallelized model (None: a whole model on one rank).
        max_shard_bytes: Upper bound of one safetensors file.
    """
    from mcore_models.gather import gather_full_tensors

    chunks = model if isinstance(model, list) else [model]
    config = chunks[0].config
    out = Path(directory)
    hf_config = config_to_hf(config)
    writer, tensors = gather_full_tensors(chunks, state)
    file_names: list[str] = []
    if writer:
        named: dict[str, torch.Tensor] = {}
        if config.moe is not None:
            from mcore_models.moe.hf import moe_tensors_to_hf

            named, tensors = moe_tensors_to_hf(tensors, config, hf_config["model_type"])
        named.update((hf_name(name), tensor) for name, tensor in tensors.items())
        file_names = _write_shards(named, out, max_shard_bytes, _writer_tag(state))
    _finish_export(out, hf_config, file_names, state)


def _writer_tag(state: ParallelState | None) -> str:
    return "0" if state is None else str(state.pp_rank)


def _write_shards(
    named: dict[str, torch.Tensor], out: Path, max_shard_bytes: int, tag: str
) -> list[str]:
    """Write tensors into temporary shard files; return their names."""
    out.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(named):
        tensor = named[name].detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    names = []
    for index, group in enumerate(groups):
        file = f"part-{tag}-{index}.safetensors.tmp"
        save_file(group, str(out / file), metadata={"format": "pt"})
        names.append(file)
    return names


def _finish_export(
    out: Path, hf_config: dict[str, Any], file_names: list[str], state: ParallelState | None
) -> None:
    """Rank 0 names the shards, writes the index and config, and removes stale files."""
    import torch.distributed as dist

    distributed = state is not None and dist.is_initialized() and dist.get_world_size() > 1
    all_files = [file_names]
    if distributed:
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, file_names)
        all_files = gathered
    if not distributed or dist.get_rank() == 0:
        temporaries = [name for names in all_files for name in names]
        _publish(out, hf_config, temporaries)
    if distributed:
        dist.barrier()


def _publish(out: Path, hf_config: dict[str, Any], temporaries: list[str]) -> None:
    # A previous export's index and shards would still be read instead of the new weights.
    index = out / "model.safetensors.index.json"
    if index.is_file():
        for shard in set(json.loads(index.read_text())["weight_map"].values()):
            if re.fullmatch(r"model-\d+-of-\d+\.safetensors", shard):
                (out / shard).unlink(missing_ok=True)
        index.unlink()
    if len(temporaries) == 1:
        os.replace(out / temporaries[0], out / "model.safetensors")
    else:
        (out / "model.safetensors").unlink(missing_ok=True)
        weight_map: dict[str, str] = {}
        total = 0
        for number, temporary in enumerate(sorted(temporaries), start=1):
            final = f"model-{number:05d}-of-{len(temporaries):05d}.safetensors"
            with safe_open(str(out / temporary), framework="pt") as handle:
                keys = list(handle.keys())
                for key in keys:
                    weight_map[key] = final
                    tensor_slice = handle.get_slice(key)
                    shape = tensor_slice.get_shape()
                    numel = 1
                    for size in shape:
                        numel *= size
                    total += numel * _dtype_bytes(tensor_slice.get_dtype())
            os.replace(out / temporary, out / final)
        index_tmp = out / "model.safetensors.index.json.tmp"
        index_tmp.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            + "\n"
        )
        os.replace(index_tmp, index)
    config_tmp = out / "config.json.tmp"
    config_tmp.write_text(json.dumps(hf_config, indent=2) + "\n")
    os.replace(config_tmp, out / "config.json")


def _dtype_bytes(name: str) -> int:
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}.get(
        name, 4
    )
