"""State dicts of the distributed optimizer: torch's format and the sharded checkpoint forms.

Three forms exist:

- torch's format (:func:`torch_state_dict`): ``{"state": {index: {"step", "exp_avg",
  "exp_avg_sq", "main_param"}}, "param_groups": [...]}`` exactly as ``torch.optim.AdamW``
  writes it for this rank's local (tp/ep-sharded) parameters, plus the fp32 ``main_param``.
  Indices number the parameters of the groups in order, as torch does.
- the flat sharded form and the reshardable form (:func:`sharded_state_dict`): blocks of global
  tensors described by :class:`~mcore_parallel.sharding.ShardedTensor`, which mcore-ckpt saves
  and loads under another layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mcore_parallel.distributed.reshardable_state import (
    gather_shard_ranges,
    global_block_layout,
    shard_ranges,
)
from mcore_parallel.distributed.shards import STATE_KEYS, ParamShard, tensor_comm
from mcore_parallel.errors import OptimizerStateError
from mcore_parallel.sharding import ShardedTensor, get_partition_dims

if TYPE_CHECKING:
    from mcore_parallel.distributed.optimizer import DistributedOptimizer

__all__ = [
    "torch_state_dict",
    "load_torch_state_dict",
    "sharded_state_dict",
    "load_sharded_state_dict",
]

_TORCH_KEYS = ("exp_avg", "exp_avg_sq")


def local_state(optimizer: DistributedOptimizer, shard: ParamShard) -> tuple[torch.Tensor, ...]:
    """This rank's ``main_param``, ``exp_avg`` and ``exp_avg_sq`` ranges (empty if none).

    Args:
        optimizer: The optimizer holding the state.
        shard: One parameter's part on this rank.

    Returns:
        The three flat fp32 ranges, empty tensors where this rank owns none of the parameter.
    """
    if shard.main_param is None:
        empty = torch.empty(0, dtype=torch.float32, device=optimizer.model.device)
        return empty, empty, empty
    return shard.main_param, shard.exp_avg, shard.exp_avg_sq  # type: ignore[return-value]


def full_local_state(optimizer: DistributedOptimizer, shard: ParamShard) -> list[torch.Tensor]:
    """The state of the whole local parameter, flat; a collective over its dp group if sharded.

    Args:
        optimizer: The optimizer holding the state.
        shard: One parameter's part on this rank.

    Returns:
        ``main_param``, ``exp_avg`` and ``exp_avg_sq`` of the whole local (tensor-parallel)
        parameter, each flat.
    """
    buffer = shard.buffer
    if buffer.num_shards == 1:
        return [t.view(-1) for t in local_state(optimizer, shard)]
    ranges = shard_ranges(buffer, shard.param)
    return gather_shard_ranges(
        list(local_state(optimizer, shard)), ranges, buffer.comm, shard.param.numel()
    )


def _ordered_params(optimizer: DistributedOptimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def torch_state_dict(optimizer: DistributedOptimizer) -> dict[str, Any]:
    """The optimizer state in ``torch.optim.AdamW``'s format (collective when sharded).

    Args:
        optimizer: The optimizer.

    Returns:
        ``{"state": ..., "param_groups": ...}``; ``state`` is empty before the first step.
    """
    optimizer.model.finish_param_sync()
    shard_of = {shard.param: shard for shard in optimizer.shards}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, param in enumerate(_ordered_params(optimizer)):
        full = full_local_state(optimizer, shard_of[param])
        if optimizer.step_count == 0:
            continue
        entry = {"step": torch.tensor(float(optimizer.step_count))}
        for key, tensor in zip(STATE_KEYS, full):
            entry[key] = tensor.view(param.shape).clone()
        state[index] = entry
    groups = []
    start = 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(start, start + count))
        groups.append(saved)
        start += count
    return {"state": state, "param_groups": groups}


def load_torch_state_dict(optimizer: DistributedOptimizer, state_dict: Any) -> None:
    """Loads a state dict in torch's format (also one written by ``torch.optim.AdamW``).

    Each rank keeps its range of every tensor, without communication. A missing
    ``main_param`` (torch's own optimizers have none) is taken from the model's current
    parameter. Group options (lr, betas, ... and keys a scheduler added) are restored.

    Args:
        optimizer: The optimizer.
        state_dict: The state dict.

    Raises:
        OptimizerStateError: If the groups or a tensor do not match the optimizer's.
    """
    if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
        raise OptimizerStateError(
            "state_dict must be a dict with keys 'state' and 'param_groups' (torch's format), "
            f"got {type(state_dict).__name__} with keys {sorted(getattr(state_dict, 'keys', list)())}"
        )
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    saved_sizes = [len(g.get("params", ())) for g in saved_groups]
    if sizes != saved_sizes:
        raise OptimizerStateError(
            f"state_dict has param_groups of sizes {saved_sizes}; this optimizer has {sizes}"
        )
    params = _ordered_params(optimizer)
    saved_ids = [i for g in saved_groups for i in g["params"]]
    shard_of = {shard.param: shard for shard in optimizer.shards}
    steps = set()
    plan: list[tuple[ParamShard, str, torch.Tensor]] = []
    for param, saved_id in zip(params, saved_ids):
        shard = shard_of[param]
        entry = state_dict["state"].get(saved_id, {})
        for key in (*_TORCH_KEYS, "main_param"):
            if key not in entry:
                if key == "main_param" or not entry:
                    continue
                raise OptimizerStateError(f"state_dict['state'][{saved_id}] lacks {key!r}")
            tensor = entry[key]
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != param.numel():
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
                raise OptimizerStateError(
                    f"state_dict['state'][{saved_id}][{key!r}] has shape {got}; expected "
                    f"{tuple(param.shape)} ({shard.name})"
                )
            plan.append((shard, key, tensor.reshape(-1)[shard.start : shard.end]))
        if entry:
            steps.add(int(float(entry.get("step", 0))))
    if len(steps) > 1:
        raise OptimizerStateError(f"state_dict holds different steps {sorted(steps)}")
    optimizer.model.finish_param_sync()
    with torch.no_grad():
        # Parameters without saved state start afresh, as in torch; a missing main parameter
        # (torch's optimizers keep none) is the model's current value.
        for shard in optimizer.shards:
            if shard.main_param is not None:
                shard.main_param.copy_(shard.model_slice())
                shard.exp_avg.zero_()  # type: ignore[union-attr]
                shard.exp_avg_sq.zero_()  # type: ignore[union-attr]
        for shard, key, source in plan:
            target = getattr(shard, key)
            if target is not None:
                target.copy_(source)
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.step_count = steps.pop() if steps else 0
    optimizer.write_main_params_to_model()


def sharded_state_dict(optimizer: DistributedOptimizer, reshardable: bool) -> dict[str, Any]:
    """The flat or reshardable sharded form; see ``DistributedOptimizer.sharded_state_dict``.

    Args:
        optimizer: The optimizer.
        reshardable: Return the reshardable form.

    Returns:
        ``{"step": int, "param_state": {name: {key: ShardedTensor}}}``.
    """
    optimizer.model.finish_param_sync()
    param_state: dict[str, dict[str, ShardedTensor]] = {}
    for shard in optimizer.shards:
        if reshardable:
            param_state[shard.name] = _global_blocks(optimizer, shard)
            continue
        param_state[shard.name] = {
            key: ShardedTensor(
                local, (shard.global_numel,), (shard.global_base + shard.start,), shard.replica_id
            )
            for key, local in zip(STATE_KEYS, local_state(optimizer, shard))
        }
    return {"step": optimizer.step_count, "param_state": param_state}


def _global_blocks(optimizer: DistributedOptimizer, shard: ParamShard) -> dict[str, ShardedTensor]:
    """The parameter's full local-shard state as blocks of the global parameter."""
    param, buffer = shard.param, shard.buffer
    full = full_local_state(optimizer, shard)
    dims = get_partition_dims(param)
    tp = tensor_comm(optimizer.model, buffer)
    axes = {"tp": tp, "etp": tp, "ep": optimizer.model.ep_comm}
    global_shape, global_offset = global_block_layout(tuple(param.shape), dims, axes)
    replica_id = buffer.comm.rank
    if "tp" not in dims and "etp" not in dims and tp is not None:
        replica_id = replica_id * tp.size + tp.rank
    return {
        key: ShardedTensor(tensor.view(param.shape), global_shape, global_offset, replica_id)
        for key, tensor in zip(STATE_KEYS, full)
    }


def load_sharded_state_dict(optimizer: DistributedOptimizer, state_dict: Any) -> None:
    """Loads either sharded form; see ``DistributedOptimizer.load_sharded_state_dict``.

    Args:
        optimizer: The optimizer.
        state_dict: The state dict.

    Raises:
        OptimizerStateError: If a key is missing or a block has the wrong size.
    """
    if not isinstance(state_dict, dict) or "param_state" not in state_dict:
        raise OptimizerStateError(
            "state_dict must be a dict with keys 'step' and 'param_state', got "
            f"{type(state_dict).__name__} with keys {sorted(getattr(state_dict, 'keys', list)())}"
        )
    step = state_dict.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise OptimizerStateError(f"state_dict['step']={step!r}; expected an int >= 0")
    optimizer.model.finish_param_sync()
    plan = []
    for shard in optimizer.shards:
        entry = state_dict["param_state"].get(shard.name)
        if not isinstance(entry, dict):
            raise OptimizerStateError(f"state_dict['param_state'] lacks parameter {shard.name!r}")
        for key, target in zip(STATE_KEYS, local_state(optimizer, shard)):
            if key not in entry:
                raise OptimizerStateError(
                    f"state_dict['param_state'][{shard.name!r}] lacks {key!r}"
                )
            plan.append((target, _owned_range(shard, key, entry[key])))
    with torch.no_grad():
        for target, source in plan:
            if target.data_ptr() != source.data_ptr():
                target.copy_(source)
    optimizer.step_count = step
    optimizer.write_main_params_to_model()


def _owned_range(shard: ParamShard, key: str, value: Any) -> torch.Tensor:
    """This rank's range of a loaded leaf in either form, flattened; validates its size."""
    local = value.local if isinstance(value, ShardedTensor) else value
    owned = shard.end - shard.start
    full = shard.param.numel()
    if isinstance(local, torch.Tensor) and local.numel() == full:
        return local.reshape(-1)[shard.start : shard.end]
    if isinstance(local, torch.Tensor) and local.numel() == owned:
        return local.reshape(-1)
    got = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
    raise OptimizerStateError(
        f"state_dict['param_state'][{shard.name!r}][{key!r}] has shape {got}; expected "
        f"the local shard ({full} elements) or this rank's range [{shard.start}, "
        f"{shard.end}) of it ({owned} elements)"
    )
