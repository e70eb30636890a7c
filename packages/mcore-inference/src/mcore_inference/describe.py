"""What an engine runs on: its layout, cache, graphs and tensor-parallel communication path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_inference.fused_decode import fused_decoder_unsupported_reason
from mcore_kernels.pdl import pdl_supported

if TYPE_CHECKING:
    from mcore_inference.engine import InferenceEngine

__all__ = [
    "describe_engine",
    "fused_tp_communication",
    "release_symmetric_memory",
    "tp_communication_path",
]


def _supports_fusion(model: Any) -> str | None:
    """None when the model's forward can take the fused path, else why not."""
    if getattr(model, "tp_group", None) is None:
        return "the model is not tensor-parallel"
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        return "a pipeline stage reduces with all-reduce (the fused path needs the whole model)"
    layers = list(getattr(model, "layers", []))
    if not all(getattr(layer, "supports_fused_reduction", lambda: False)() for layer in layers):
        return "a layer's MLP cannot return a partial sum (e.g. MoE)"
    return None


@contextmanager
def fused_tp_communication(model: Any, enabled: bool) -> Iterator[None]:
    """Switch the model's fused TP reduction on for the duration of an engine step.

    Sets ``model.config.inference_fuse_tp_communication`` and restores the previous value on
    exit (also on exceptions); the model's modules are never changed.

    Args:
        model: The served model.
        enabled: The value to hold inside the block.

    Yields:
        Nothing.
    """
    config = model.config
    previous = getattr(config, "inference_fuse_tp_communication", False)
    if previous == enabled:
        yield
        return
    config.inference_fuse_tp_communication = enabled
    try:
        yield
    finally:
        config.inference_fuse_tp_communication = previous


def tp_communication_path(model: Any, enabled: bool, tokens: int, device: torch.device) -> str:
    """Describe how the decode forward reduces over the tensor-parallel group.

    Args:
        model: The served model.
        enabled: Whether the engine asks for the fused collective.
        tokens: Token count of the largest decode step (for the kernels' size limits).
        device: The model's device.

    Returns:
        ``"none"``, ``"all-reduce (<why>)"``, ``"fused_rs_add_rmsnorm_ag (symmetric memory)"``
        or ``"fused_rs_add_rmsnorm_ag (NCCL collectives: <why>)"``.
    """
    group = getattr(model, "tp_group", None)
    if group is None:
        return "none"
    if not enabled:
        return "all-reduce (InferenceConfig.fuse_tp_communication=False)"
    reason = _supports_fusion(model)
    if reason is not None:
        return f"all-reduce ({reason})"
    from mcore_kernels.comm.availability import symmetric_memory_unavailable_reason

    probe = torch.empty((tokens, model.config.hidden_size), dtype=model.config.dtype, device=device)
    unavailable = symmetric_memory_unavailable_reason(probe, group)
    if unavailable is None:
        return "fused_rs_add_rmsnorm_ag (symmetric memory)"
    backend = dist.get_backend(group)
    return f"fused_rs_add_rmsnorm_ag ({backend} collectives: {unavailable})"


def release_symmetric_memory(group: dist.ProcessGroup) -> int:
    """Release the fused collective's symmetric buffers of a group (no-op without them).

    Args:
        group: The tensor-parallel group.

    Returns:
        The number of workspaces released.
    """
    try:
        from mcore_kernels.comm.symmetric import release_workspaces
    except ImportError:  # no Triton: no symmetric memory was ever allocated
        return 0
    return release_workspaces(group)


def describe_engine(engine: InferenceEngine) -> dict[str, Any]:
    """The summary :meth:`InferenceEngine.describe` returns.

    Args:
        engine: A freshly built engine.

    Returns:
        The description dict.
    """
    groups = engine.groups
    config = engine.config
    lockstep = engine._ep
    ep = etp = 1
    if lockstep is not None:
        ep = dist.get_world_size(lockstep.groups[0])
        if len(lockstep.groups) > 1:
            etp = dist.get_world_size(lockstep.groups[1])
    cache = engine.kv_cache
    assert cache is not None
    graphs = engine._graphs
    if graphs is not None:
        cuda_graphs = f"decode graphs for batch sizes {list(graphs.batch_sizes)}"
    elif not config.use_cuda_graphs:
        cuda_graphs = "off (InferenceConfig.use_cuda_graphs=False)"
    elif engine.device.type != "cuda":
        cuda_graphs = f"off (model on {engine.device.type})"
    else:
        cuda_graphs = "off (capture failed; decoding eagerly)"
    schedule = (
        "one forward per step"
        if groups.pp_size == 1
        else (
            f"{groups.pp_size} microbatches in flight: each step every stage runs the "
            "microbatch at its position, decoding requests are split into one group per stage"
        )
    )
    return {
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "dp": groups.dp_size,
        "ep": ep,
        "etp": etp,
        "kv_cache": {
            "layers": int(cache.keys.shape[0]),
            "first_layer": cache.first_layer,
            "kv_heads": int(cache.keys.shape[3]),
            "blocks": int(cache.keys.shape[1]),
            "block_size": cache.block_size,
            "bytes": cache.nbytes,
        },
        "cuda_graphs": cuda_graphs,
        "fused_decode": _fused_decode_summary(engine),
        "tp_communication": tp_communication_path(
            engine.model,
            config.fuse_tp_communication,
            max(config.graph_batch_sizes()),
            engine.device,
        ),
        "pipeline_schedule": schedule,
    }


def _fused_decode_summary(engine: InferenceEngine) -> str:
    decoder = engine._decoder
    if decoder is not None:
        pdl = "on" if decoder.pdl and pdl_supported(engine.device) else "off"
        return (
            f"on (fused q/k/v and gate/up weight copies: {decoder.nbytes} bytes; "
            f"programmatic dependent launch {pdl})"
        )
    if not engine.config.fused_decode:
        return "off (InferenceConfig.fused_decode=False)"
    if engine.config.batch_invariant or getattr(engine.model.config, "batch_invariant", False):
        return "off (batch-invariant mode runs the model's own forward)"
    return f"off ({fused_decoder_unsupported_reason(engine.model)})"
