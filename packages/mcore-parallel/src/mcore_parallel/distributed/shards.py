"""The part of each parameter a (distributed) optimizer rank updates, and its global layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mcore_parallel.distributed.buffers import CommGroup, ParamAndGradBuffer
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.sharding import get_partition_dims

__all__ = ["ParamShard", "build_shards", "tensor_comm", "STATE_KEYS"]

STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")
"""Names of the fp32 tensors kept per parameter shard."""


@dataclass(eq=False)
class ParamShard:
    """The part ``[start, end)`` of a flattened parameter that this rank updates.

    Attributes:
        name: The parameter's name in ``model.module.named_parameters()``.
        param: The parameter.
        group_index: Index of its optimizer parameter group.
        start: First owned element of the flattened parameter.
        end: End of the owned range (``start == end``: nothing owned).
        main_param: fp32 copy of the owned range (None when nothing is owned).
        exp_avg: First Adam moment of the owned range.
        exp_avg_sq: Second Adam moment of the owned range.
        global_numel: Length of the parameter's global 1-D state tensor (all tp/ep partitions).
        global_base: Offset of this rank's flattened local parameter in that tensor.
        replica_id: 0 on the one rank that saves (and counts in the norm) this block.
        buffer: The buffer holding the parameter (its group and shard layout).
    """

    name: str
    param: nn.Parameter
    group_index: int
    start: int
    end: int
    main_param: torch.Tensor | None
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    global_numel: int
    global_base: int
    replica_id: int
    buffer: ParamAndGradBuffer

    def grad(self) -> torch.Tensor:
        """Returns the owned range of the parameter's (reduced) gradient.

        Returns:
            A 1-D view of ``param.main_grad``.
        """
        return self.param.main_grad.view(-1)[self.start : self.end]  # type: ignore[attr-defined]

    def model_slice(self) -> torch.Tensor:
        """Returns the owned range of the model parameter.

        Returns:
            A 1-D view of ``param.data``.
        """
        return self.param.data.view(-1)[self.start : self.end]


def tensor_comm(model: DistributedDataParallel, buffer: ParamAndGradBuffer) -> CommGroup | None:
    """The group that splits a buffer's parameters along a tensor dimension.

    Args:
        model: The data-parallel model.
        buffer: One of its buffers.

    Returns:
        The expert tensor-parallel group for expert buffers, else the tensor-parallel group.
    """
    groups = model.groups
    return (groups.etp or groups.tp) if buffer.is_expert else groups.tp


def _global_layout(
    model: DistributedDataParallel, buffer: ParamAndGradBuffer, param: nn.Parameter
) -> tuple[int, int, int]:
    """Global 1-D length, this rank's base offset and replica id of a parameter's state."""
    dims = get_partition_dims(param)
    tp, ep = tensor_comm(model, buffer), model.ep_comm
    tp_split = tp is not None and tp.size > 1 and ("tp" in dims or "etp" in dims)
    ep_split = ep is not None and ep.size > 1 and buffer.is_expert
    tp_count, tp_index = (tp.size, tp.rank) if tp_split else (1, 0)  # type: ignore[union-attr]
    ep_count, ep_index = (ep.size, ep.rank) if ep_split else (1, 0)  # type: ignore[union-attr]
    numel = param.numel()
    base = (ep_index * tp_count + tp_index) * numel
    tp_replica = tp.rank if tp is not None and not tp_split else 0
    dp_replica = buffer.comm.rank if buffer.num_shards == 1 else 0
    replica = tp_replica * buffer.comm.size + dp_replica
    if getattr(param, "pipeline_shared_copy", False):
        # A second pipeline stage's copy of a tied weight (the output layer tied to the
        # embedding): the first stage's copy is the one saved and counted in the norm.
        replica += (tp.size if tp is not None else 1) * buffer.comm.size
    return numel * tp_count * ep_count, base, replica


def build_shards(
    model: DistributedDataParallel, group_of: dict[nn.Parameter, int]
) -> list[ParamShard]:
    """Creates the fp32 state of this rank's part of every parameter of ``model``.

    Args:
        model: The data-parallel model.
        group_of: Optimizer parameter group index of every trainable parameter.

    Returns:
        One shard per parameter, in bucket order; main parameters start as fp32 copies of the
        model's values and the moments at zero.
    """
    names = {p: n for n, p in model.module.named_parameters() if p in model.param_bucket}
    shards: list[ParamShard] = []
    for buffer in model.param_grad_buffers:
        for bucket in buffer.buckets:
            low, high = bucket.shard_range(buffer.shard_index)
            for param in bucket.params:
                numel, base, replica_id = _global_layout(model, buffer, param)
                p_start, p_end = buffer.param_range[param]
                start, end = max(low, p_start) - p_start, min(high, p_end) - p_start
                main = exp_avg = exp_avg_sq = None
                if start >= end:
                    start = end = 0
                else:
                    source = param.detach().view(-1)[start:end]
                    main = source.to(torch.float32, copy=True)
                    exp_avg, exp_avg_sq = torch.zeros_like(main), torch.zeros_like(main)
                shards.append(
                    ParamShard(
                        names[param],
                        param,
                        group_of[param],
                        start,
                        end,
                        main,
                        exp_avg,
                        exp_avg_sq,
                        numel,
                        base,
                        replica_id,
                        buffer,
                    )
                )
    return shards
