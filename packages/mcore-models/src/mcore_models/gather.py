"""Gather the shards of a parallelized model into whole tensors under their canonical names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from mcore_models.init import global_slice
from mcore_parallel.sharding import get_partition_dims

if TYPE_CHECKING:
    from mcore_models.gpt.model import GPTModel
    from mcore_parallel.state import ParallelState

__all__ = ["gather_full_tensors", "is_stage_writer"]

# Gathered innermost first: an expert weight split over etp inside each ep shard.
_AXIS_ORDER = ("etp", "tp", "ep")


def is_stage_writer(state: ParallelState | None) -> bool:
    """Whether this rank writes its pipeline stage (tp rank 0 of dp x cp rank 0).

    Args:
        state: Parallel state, or None for one rank.

    Returns:
        True on exactly one rank per pipeline stage.
    """
    return state is None or (state.tp_rank == 0 and state.dp_cp_rank == 0)


def _gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _full(param: torch.Tensor, state: ParallelState | None) -> torch.Tensor:
    tensor = param.detach()
    dims = get_partition_dims(param)
    for axis in _AXIS_ORDER:
        if axis in dims and state is not None and getattr(state, f"{axis}_size") > 1:
            tensor = _gather(tensor, dims[axis], getattr(state, f"{axis}_group"))
    return tensor


def gather_full_tensors(
    chunks: list[GPTModel] | list[nn.Module],
    state: ParallelState | None,
    *,
    every_rank: bool = False,
) -> tuple[bool, dict[str, torch.Tensor]]:
    """Whole tensors of this rank's pipeline chunks, keyed by canonical name.

    Every rank of the layout must call it (the shards are all-gathered over their tensor,
    expert and expert-tensor groups, one tensor at a time); only the stage writer (see
    :func:`is_stage_writer`) keeps the results.

    Args:
        chunks: This rank's model chunks.
        state: Parallel state, or None for a whole model.
        every_rank: Keep the whole tensors on every rank, not only on the stage writer.

    Returns:
        ``(is_writer, tensors)``; ``tensors`` is empty on other ranks unless ``every_rank``. Persistent buffers
        (e.g. router expert biases) are included under their canonical names.
    """
    writer = is_stage_writer(state)
    keep = writer or every_rank
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        canonical = getattr(chunk, "canonical_name", lambda name: name)
        for name, tensor in chunk.state_dict().items():
            param = params.get(name)
            where = global_slice(param) if param is not None else None
            if name.startswith("output_layer.") and canonical(name).startswith("embedding."):
                continue  # the tied copy of a last stage: the first stage exports the weight
            full = _full(param, state) if param is not None else tensor
            if keep:
                key = where.name if where is not None else canonical(name)
                tensors.setdefault(key, full.to("cpu"))
    return writer, tensors
