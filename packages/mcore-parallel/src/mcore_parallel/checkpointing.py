"""A module's state dict as :class:`~mcore_parallel.sharding.ShardedTensor` blocks.

mcore-ckpt saves these blocks and loads them back under another parallel layout. A tensor
partitioned with :func:`~mcore_parallel.sharding.set_partition_dim` (what the tensor-parallel
layers do) becomes its block of the global tensor; any other tensor is a full block. Among the
ranks that hold an identical block exactly one gets ``replica_id == 0`` and is the one written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcore_parallel.errors import ParallelTypeError
from mcore_parallel.sharding import ShardedTensor, get_partition_dims
from mcore_parallel.state import ParallelState

__all__ = ["sharded_state_dict"]


def _axis(state: ParallelState, axis: str) -> tuple[int, int]:
    if axis == "tp":
        return state.size("tp"), state.rank_in("tp")
    if axis == "etp":
        return state.size("etp"), state.rank_in("etp")
    return state.size("ep"), state.rank_in("ep")


def _replica_id(state: ParallelState, axes: set[str]) -> int:
    """Index of this rank among the ranks of its pipeline stage holding the same block."""
    # Expert weights are replicated over expert_dp (x etp when not split over it); dense ones
    # over dp x cp (x tp when not split over it).
    if "ep" in axes or "etp" in axes:
        replica = state.rank_in("expert_dp")
        if "etp" not in axes:
            replica = replica * state.size("etp") + state.rank_in("etp")
        return replica
    replica = state.rank_in("dp_cp")
    if "tp" not in axes:
        replica = replica * state.size("tp") + state.rank_in("tp")
    return replica


def sharded_state_dict(
    module: nn.Module, state: ParallelState | None, prefix: str = ""
) -> dict[str, Any]:
    """Returns ``module.state_dict()`` with every tensor wrapped as a ShardedTensor.

    Args:
        module: The module (e.g. this pipeline stage's model chunk).
        state: Parallel state; None means a single rank holding every tensor in full.
        prefix: Prepended to every key.

    Returns:
        The state dict: tensors partitioned over tp (or ep) become their block of the global
        tensor with its global shape and offset; replicated tensors become full blocks with
        ``replica_id > 0`` on all but one of the ranks holding them. Non-tensor entries (extra
        state) are returned unchanged. Local tensors are detached, not copied.

    Raises:
        ParallelTypeError: If ``module`` is not an ``nn.Module`` or ``state`` is not a
            ParallelState or None.
    """
    if not isinstance(module, nn.Module):
        raise ParallelTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if state is not None and not isinstance(state, ParallelState):
        raise ParallelTypeError(
            f"state must be a ParallelState or None, got {type(state).__name__}"
        )
    result: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            result[prefix + name] = value
            continue
        local = value.detach()
        dims = get_partition_dims(value) if state is not None else {}
        global_shape = list(local.shape)
        global_offset = [0] * local.dim()
        for axis, dim in dims.items():
            size, rank = _axis(state, axis)  # type: ignore[arg-type]
            global_shape[dim] = local.shape[dim] * size
            global_offset[dim] = local.shape[dim] * rank
        replica_id = 0 if state is None else _replica_id(state, set(dims))
        result[prefix + name] = ShardedTensor(
            local, tuple(global_shape), tuple(global_offset), replica_id=replica_id
        )
    return result
