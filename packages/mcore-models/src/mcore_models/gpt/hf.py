"""Hugging Face interop: Llama / Qwen2 / Qwen3 ``config.json`` + safetensors to and from GPTModel.

The translation of configs and names is :mod:`mcore_models.gpt.hf_config` (its names are
importable from here too); this module loads and saves the weights.
"""

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
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.hf_config import (
    SUPPORTED_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    hf_name,
    mcore_name,
)
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
