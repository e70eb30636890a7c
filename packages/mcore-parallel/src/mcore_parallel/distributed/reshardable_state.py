"""Optimizer state described as blocks of the global parameters, independent of the layout.

The distributed optimizer keeps, for each parameter, the fp32 state of this data-parallel
rank's contiguous range of the flattened local (tensor- or expert-parallel) parameter. Those
ranges depend on the dp size and the bucket layout, and the flattened local parameter depends on
the tp/ep size, so a checkpoint of them only reshards across dp. The helpers here gather a
parameter's ranges over its data-parallel group into the full local shard and describe it with
the parameter's partition dims, exactly like the model weights in
:func:`mcore_parallel.checkpointing.sharded_state_dict`, so that the state loads under any tp,
ep and dp size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.distributed.buffers import CommGroup, ParamAndGradBuffer

__all__ = ["shard_ranges", "gather_shard_ranges", "global_block_layout"]


def shard_ranges(buffer: ParamAndGradBuffer, param: nn.Parameter) -> list[tuple[int, int]]:
    """Returns the range of the flattened parameter that each optimizer shard updates.

    Args:
        buffer: The buffer holding ``param``.
        param: A parameter of ``buffer``.

    Returns:
        For each shard index (the data-parallel rank under a distributed optimizer), the range
        ``[start, end)`` of ``param.view(-1)`` it owns; ``(0, 0)`` when it owns nothing.
    """
    bucket = buffer.param_bucket[param]
    p_start, p_end = buffer.param_range[param]
    ranges = []
    for shard in range(buffer.num_shards):
        low, high = bucket.shard_range(shard)
        start, end = max(low, p_start) - p_start, min(high, p_end) - p_start
        ranges.append((start, end) if start < end else (0, 0))
    return ranges


def gather_shard_ranges(
    pieces: list[torch.Tensor],
    ranges: list[tuple[int, int]],
    comm: CommGroup,
    numel: int,
) -> list[torch.Tensor]:
    """All-gathers every rank's range of several flat tensors into the full flat tensors.

    One collective moves all ``pieces`` at once; each rank sends a buffer as long as the
    longest range (ranges differ by at most the padding of a bucket), so the transient memory
    is ``comm.size x len(pieces) x max range`` elements on top of the returned tensors.

    Args:
        pieces: This rank's range of each tensor (1-D, ``ranges[comm.rank]`` long, float32).
        ranges: The range ``[start, end)`` of every rank of ``comm``, in rank order; together
            they tile ``[0, numel)``.
        comm: The data-parallel group the ranges are spread over.
        numel: Length of the full tensors.

    Returns:
        One full 1-D float32 tensor of ``numel`` elements per piece, identical on every rank.
    """
    device = pieces[0].device
    width = max(end - start for start, end in ranges)
    send = torch.zeros(len(pieces), width, dtype=torch.float32, device=device)
    own = ranges[comm.rank][1] - ranges[comm.rank][0]
    for row, piece in zip(send, pieces):
        row[:own].copy_(piece)
    received = torch.empty(comm.size * len(pieces), width, dtype=torch.float32, device=device)
    dist.all_gather_into_tensor(received, send, group=comm.group)
    received = received.view(comm.size, len(pieces), width)
    full = torch.empty(len(pieces), numel, dtype=torch.float32, device=device)
    for rank, (start, end) in enumerate(ranges):
        full[:, start:end] = received[rank, :, : end - start]
    return list(full.unbind(0))


def global_block_layout(
    shape: tuple[int, ...],
    dims: dict[str, int],
    axes: dict[str, CommGroup | None],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Returns the global shape and offset of a local shard partitioned along ``dims``.

    Args:
        shape: Shape of the local shard.
        dims: Partitioned dimension per parallel axis (see
            :func:`~mcore_parallel.sharding.get_partition_dims`).
        axes: The group of each axis (``"tp"``, ``"ep"``); None counts as one rank.

    Returns:
        The global shape and this rank's offset in it: chunk ``i`` of a partitioned dimension
        lies on the rank of index ``i``, as the tensor-parallel layers split it.
    """
    global_shape, offset = list(shape), [0] * len(shape)
    for axis, dim in dims.items():
        comm = axes.get(axis)
        size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
        global_shape[dim] = shape[dim] * size
        offset[dim] = shape[dim] * rank
    return tuple(global_shape), tuple(offset)
