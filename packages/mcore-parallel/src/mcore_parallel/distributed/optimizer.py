"""AdamW with fp32 main parameters and optimizer state sharded over data-parallel ranks (ZeRO-1).

Each bucket of the DDP buffers is split into ``dp`` equal contiguous shards; rank ``r`` owns
shard ``r`` of every bucket. Gradients arrive by reduce-scatter (only the owned shard is
reduced), the step updates the owned fp32 main parameters with AdamW, and the
result is written into the parameter buffer and all-gathered, synchronously or overlapped with
the next forward pass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.distributed.buffers import ParamAndGradBuffer
from mcore_parallel.distributed.config import OptimizerConfig
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.offload import move_tensor
from mcore_parallel.distributed.reshardable_state import (
    gather_shard_ranges,
    global_block_layout,
    shard_ranges,
)
from mcore_parallel.errors import (
    OptimizerStateError,
    ParallelStateError,
    ParallelTypeError,
)
from mcore_parallel.sharding import ShardedTensor, get_partition_dims

__all__ = ["DistributedOptimizer", "adamw_update"]

_STATE_KEYS = ("main_param", "exp_avg", "exp_avg_sq")


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Applies one AdamW update in place to lists of tensors (one fused kernel per operation).

    Decoupled weight decay and bias-corrected moments, with the formula and operation order of
    ``torch.optim.AdamW`` (Loshchilov and Hutter, "Decoupled Weight Decay Regularization",
    ICLR 2019). Owning the update keeps the optimizer state in plain tensors that can be
    sharded, offloaded and checkpointed without the torch optimizer's bookkeeping.

    Args:
        params: fp32 parameters, updated in place.
        grads: Their gradients.
        exp_avgs: First moments, updated in place.
        exp_avg_sqs: Second moments, updated in place.
        step: Number of this step, starting at 1.
        lr: Learning rate.
        betas: Decay rates of the two moments.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay coefficient.
    """
    if not params:
        return
    beta1, beta2 = betas
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias_correction1)


@dataclass(eq=False)
class _ParamShard:
    """The part ``[start, end)`` of a flattened parameter that this rank updates."""

    name: str
    param: nn.Parameter
    start: int
    end: int
    main_param: torch.Tensor | None
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    global_numel: int
    """Length of the parameter's global 1-D state tensor (all tp/ep partitions)."""
    global_base: int
    """Offset of this rank's flattened local parameter in that tensor."""
    replica_id: int
    """0 on the one rank that saves (and counts in the norm) this block."""
    buffer: ParamAndGradBuffer
    """The buffer holding the parameter (its group and shard layout)."""

    def grad(self) -> torch.Tensor:
        return self.param.main_grad.view(-1)[self.start : self.end]  # type: ignore[attr-defined]

    def model_slice(self) -> torch.Tensor:
        return self.param.data.view(-1)[self.start : self.end]


def _global_layout(
    model: DistributedDataParallel, buffer: ParamAndGradBuffer, param: nn.Parameter
) -> tuple[int, int, int]:
    """Global 1-D length, this rank's base offset and replica id of a parameter's state."""
    dims = get_partition_dims(param)
    tp, ep = model.tp_comm, model.ep_comm
    tp_split = tp is not None and tp.size > 1 and "tp" in dims
    ep_split = ep is not None and ep.size > 1 and buffer.is_expert
    tp_count, tp_index = (tp.size, tp.rank) if tp_split else (1, 0)  # type: ignore[union-attr]
    ep_count, ep_index = (ep.size, ep.rank) if ep_split else (1, 0)  # type: ignore[union-attr]
    numel = param.numel()
    base = (ep_index * tp_count + tp_index) * numel
    tp_replica = tp.rank if tp is not None and not tp_split else 0
    dp_replica = buffer.comm.rank if buffer.num_shards == 1 else 0
    return numel * tp_count * ep_count, base, tp_replica * buffer.comm.size + dp_replica


class DistributedOptimizer:
    """AdamW over a :class:`DistributedDataParallel` model, sharded when the model asks for it.

    With ``use_distributed_optimizer=True`` in the model's DDPConfig, each rank holds fp32 main
    parameters and Adam moments only for its shard of every bucket; otherwise every rank holds
    them for all parameters (plain data parallelism with fp32 master weights). The update is
    elementwise AdamW (:func:`adamw_update`, the formula of ``torch.optim.AdamW``), so the
    sharded step equals the unsharded one.

    Args:
        model: The DDP-wrapped model.
        config: AdamW hyper-parameters; defaults to ``OptimizerConfig()``.

    Raises:
        ParallelTypeError: If ``model`` is not a DistributedDataParallel or ``config`` not an
            OptimizerConfig.
    """

    def __init__(
        self, model: DistributedDataParallel, config: OptimizerConfig | None = None
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise ParallelTypeError(
                f"model must be a DistributedDataParallel, got {type(model).__name__}"
            )
        config = OptimizerConfig() if config is None else config
        if not isinstance(config, OptimizerConfig):
            raise ParallelTypeError(
                f"config must be an OptimizerConfig, got {type(config).__name__}"
            )
        self.model = model
        self.config = config
        self.sharded = model.num_shards > 1
        """Whether the state is split over the data-parallel ranks."""
        names = {p: n for n, p in model.module.named_parameters() if p in model.param_bucket}
        self._shards: list[_ParamShard] = []
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
                    self._shards.append(
                        _ParamShard(
                            names[param],
                            param,
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
        self.lr = config.lr
        """Learning rate of the next step (assign to schedule it)."""
        self.step_count = 0
        """Number of optimizer steps taken (restored by :meth:`load_sharded_state_dict`)."""
        self._state_offloaded = False
        model._optimizers.add(self)

    # ---------------------------------------------------------------- stepping

    def step(self) -> float:
        """Synchronises gradients, takes one AdamW step on the owned shard and syncs parameters.

        Returns:
            The global gradient norm (over all data-parallel shards), before clipping.

        Raises:
            ParallelStateError: If optimizer state or buffers are offloaded.
        """
        if self._state_offloaded or self.model.offloaded:
            raise ParallelStateError(
                "step() while state is offloaded; call reload_from_cpu() first"
            )
        self.model.finish_grad_sync()
        # The shards are about to be overwritten: no all-gather may still read them.
        self.model.finish_param_sync()
        owned = [s for s in self._shards if s.main_param is not None]
        grads = [s.grad().float() for s in owned]
        grad_norm = self._global_norm([g for s, g in zip(owned, grads) if s.replica_id == 0])
        if self.config.clip_grad > 0.0 and grad_norm > self.config.clip_grad:
            scale = self.config.clip_grad / (grad_norm + 1e-6)
            grads = [grad * scale for grad in grads]
        self.step_count += 1
        mains = [s.main_param for s in owned]
        with torch.no_grad():
            adamw_update(
                mains,  # type: ignore[arg-type]
                grads,
                [s.exp_avg for s in owned],  # type: ignore[misc]
                [s.exp_avg_sq for s in owned],  # type: ignore[misc]
                step=self.step_count,
                lr=self.lr,
                betas=self.config.betas,
                eps=self.config.eps,
                weight_decay=self.config.weight_decay,
            )
            for shard in owned:
                shard.model_slice().copy_(shard.main_param)  # type: ignore[arg-type]
        self.model.mark_params_updated()
        self.model.start_param_sync()
        return grad_norm

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        # Every gradient element is counted on exactly one rank of the world (replica 0 of its
        # block), so one sum over the world covers dp shards, tp/ep partitions and pp stages.
        total = torch.zeros((), dtype=torch.float64, device=self.model.device)
        if grads:
            # One fused kernel per dtype group instead of a reduction per tensor.
            norms = torch._foreach_norm(grads)
            total += torch.stack(norms).double().pow(2).sum()
        if dist.get_world_size() > 1:
            dist.all_reduce(total)
        return math.sqrt(float(total))

    def reload_model_params(self, names: Collection[str] | None = None) -> None:
        """Copies the model's current parameters into the fp32 main parameters.

        Needed after the model's weights were changed in place outside the optimizer (loaded
        from a checkpoint, synchronised from a trainer); otherwise the next :meth:`step`
        writes the old main parameters back over them. The model's ``load_state_dict`` calls
        it for the parameters it loaded. The Adam moments and the step count are kept.

        Args:
            names: Names (as in ``model.module.named_parameters()``) of the parameters to
                refresh; None refreshes all. Refreshing only the changed ones keeps the fp32
                precision of the others when the model holds low-precision parameters.
        """
        self.model.finish_param_sync()
        with torch.no_grad():
            for shard in self._shards:
                if shard.main_param is not None and (names is None or shard.name in names):
                    shard.main_param.copy_(shard.model_slice())

    def zero_grad(self) -> None:
        """Zeroes the model's gradient buffers."""
        self.model.zero_grad_buffer()

    # ---------------------------------------------------------------- parameter sync

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Starts (or with ``force_sync`` completes) the parameter all-gather; see the model's.

        Args:
            force_sync: Finish every pending all-gather before returning.
        """
        self.model.start_param_sync(force_sync=force_sync)

    def enable_forward_pre_hook(self) -> None:
        """Enables the model's parameter-sync forward pre-hooks (idempotent)."""
        self.model.enable_forward_pre_hook()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Disables the model's parameter-sync forward pre-hooks; never raises.

        Args:
            param_sync: Then finish every pending all-gather.
        """
        self.model.disable_forward_pre_hook(param_sync=param_sync)

    def param_sync_hooks_disabled(self) -> contextlib.AbstractContextManager[None]:
        """Returns the model's context with hooks off and parameters synchronised.

        Returns:
            A context manager that restores the previous hook state on exit.
        """
        return self.model.param_sync_hooks_disabled()

    # ---------------------------------------------------------------- offload

    @torch.inference_mode(False)
    def offload_to_cpu(
        self, *, optimizer_state: bool = True, grads: bool = True, params: bool = True
    ) -> None:
        """Moves optimizer state and the model's buffers to host memory.

        Parameters are synchronised first. Offloaded parts are bit-identical after
        :meth:`reload_from_cpu`.

        Args:
            optimizer_state: Offload fp32 main parameters and Adam moments.
            grads: Offload the model's gradient buffers.
            params: Offload the model's parameter buffers (keep False to run the model, e.g.
                for generation, while the optimizer state is away).
        """
        self.model.offload_to_cpu(params=params, grads=grads)
        if optimizer_state and not self._state_offloaded:
            self._move_state(torch.device("cpu"))
            self._state_offloaded = True

    @torch.inference_mode(False)
    def reload_from_cpu(self) -> None:
        """Moves everything offloaded back to the device; a no-op when nothing is."""
        self.model.reload_from_cpu()
        if self._state_offloaded:
            self._move_state(self.model.device)
            self._state_offloaded = False

    @contextlib.contextmanager
    def offloaded(
        self, *, optimizer_state: bool = True, grads: bool = True, params: bool = False
    ) -> Iterator[None]:
        """Context in which the given parts live in host memory; reloaded on exit.

        Args:
            optimizer_state: Offload fp32 main parameters and Adam moments.
            grads: Offload the gradient buffers.
            params: Offload the parameter buffers (off by default so the model still runs).

        Yields:
            None.
        """
        self.offload_to_cpu(optimizer_state=optimizer_state, grads=grads, params=params)
        try:
            yield
        finally:
            self.reload_from_cpu()

    def _move_state(self, device: torch.device) -> None:
        for shard in self._shards:
            for key in _STATE_KEYS:
                tensor = getattr(shard, key)
                if tensor is not None:
                    setattr(shard, key, move_tensor(tensor, device))

    def sharded_state_dict(self, reshardable: bool | None = None) -> dict[str, Any]:
        """Returns this rank's optimizer state as ShardedTensor blocks of global tensors.

        Layout (every parameter by its name in ``model.module.named_parameters()``)::

            {"step": int,
             "param_state": {name: {"main_param": ShardedTensor,
                                    "exp_avg": ShardedTensor,
                                    "exp_avg_sq": ShardedTensor}}}

        Two forms of the blocks exist.

        Flat form (``reshardable=False``): each ShardedTensor is this rank's contiguous range of
        the flattened fp32 tensor, ``global_shape=(numel,)``, ``global_offset=(start,)``; a
        rank owning nothing of a parameter holds an empty block. Without sharding every rank
        holds the full tensor and ``replica_id`` is the dp rank. A parameter partitioned over
        tp or ep (see :func:`~mcore_parallel.sharding.set_partition_dim`) has as global tensor
        the concatenation of the flattened local tensors in (ep, tp) rank order, so this form
        reshards across dp sizes but not across tp/ep sizes; tp replicas of an unpartitioned
        parameter get a positive ``replica_id``. The ``local`` tensors alias the live state
        (no copy, no communication).

        Reshardable form (``reshardable=True``): each parameter's state is first all-gathered
        over its data-parallel group (expert-DP for expert parameters) into the full local
        shard, shaped like the parameter, and described as a block of the GLOBAL parameter
        with the parameter's partition dims, exactly like the model weights of
        :func:`mcore_parallel.checkpointing.sharded_state_dict`. ``replica_id`` is 0 on one
        data-parallel rank (and one tp rank for a parameter not split over tp). This form
        loads under any tp, ep and dp size. Memory: the gather runs one parameter at a time
        (one collective per parameter, transient buffers of about ``dp x 3 x`` the rank's
        range), but the returned dict holds a full fp32 copy of the local shard's
        main parameter and both moments, i.e. ``12`` bytes per element of the rank's local
        (tp/ep-sharded) model, ``dp`` times the sharded state, until it is released. Without
        data-parallel sharding the blocks alias the live state instead.

        Names must be unique across pipeline stages. Parameters are synchronised first.

        Args:
            reshardable: Return the reshardable form; None takes
                ``config.reshardable_state_dict`` (what a checkpoint library gets when it calls
                this method without arguments).

        Returns:
            The nested state dict.

        Raises:
            ParallelStateError: If the optimizer state is offloaded.
        """
        if self._state_offloaded:
            raise ParallelStateError("sharded_state_dict() while offloaded; reload first")
        if reshardable is None:
            reshardable = self.config.reshardable_state_dict
        self.model.finish_param_sync()
        param_state: dict[str, dict[str, ShardedTensor]] = {}
        for shard in self._shards:
            if reshardable:
                param_state[shard.name] = self._global_blocks(shard)
                continue
            leaves = {}
            for key, local in zip(_STATE_KEYS, self._local_state(shard)):
                leaves[key] = ShardedTensor(
                    local,
                    (shard.global_numel,),
                    (shard.global_base + shard.start,),
                    shard.replica_id,
                )
            param_state[shard.name] = leaves
        return {"step": self.step_count, "param_state": param_state}

    def _global_blocks(self, shard: _ParamShard) -> dict[str, ShardedTensor]:
        """The parameter's full local-shard state as blocks of the global parameter."""
        param, buffer = shard.param, shard.buffer
        if buffer.num_shards == 1:
            full = [t.view(-1) for t in self._local_state(shard)]
        else:
            ranges = shard_ranges(buffer, param)
            full = gather_shard_ranges(
                list(self._local_state(shard)), ranges, buffer.comm, param.numel()
            )
        dims = get_partition_dims(param)
        tp = self.model.tp_comm
        global_shape, global_offset = global_block_layout(
            tuple(param.shape), dims, {"tp": tp, "ep": self.model.ep_comm}
        )
        replica_id = buffer.comm.rank
        if "tp" not in dims and tp is not None:
            replica_id = replica_id * tp.size + tp.rank
        return {
            key: ShardedTensor(tensor.view(param.shape), global_shape, global_offset, replica_id)
            for key, tensor in zip(_STATE_KEYS, full)
        }

    def _local_state(self, shard: _ParamShard) -> tuple[torch.Tensor, ...]:
        if shard.main_param is None:
            empty = torch.empty(0, dtype=torch.float32, device=self.model.device)
            return empty, empty, empty
        return shard.main_param, shard.exp_avg, shard.exp_avg_sq  # type: ignore[return-value]

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads state shaped like :meth:`sharded_state_dict` and refreshes the model weights.

        Either form is accepted, per leaf: a block with as many elements as the local parameter
        is its full local shard (reshardable form), of which this rank keeps its data-parallel
        range without any communication; a block with as many elements as that range is the
        range itself (flat form). Leaves may be ShardedTensor blocks or plain tensors. All
        entries are validated before anything is written, so a bad state dict changes nothing.
        The model parameters are then set from the loaded fp32 main parameters and
        all-gathered.

        Args:
            state_dict: The state dict, e.g. filled in by a checkpoint load.

        Raises:
            OptimizerStateError: If a key is missing or a block has the wrong size.
            ParallelStateError: If the optimizer state is offloaded.
        """
        if self._state_offloaded:
            raise ParallelStateError("load_sharded_state_dict() while offloaded; reload first")
        if not isinstance(state_dict, dict) or "param_state" not in state_dict:
            raise OptimizerStateError(
                "state_dict must be a dict with keys 'step' and 'param_state', got "
                f"{type(state_dict).__name__} with keys {sorted(getattr(state_dict, 'keys', list)())}"
            )
        step = state_dict.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise OptimizerStateError(f"state_dict['step']={step!r}; expected an int >= 0")
        self.model.finish_param_sync()
        plan = []
        for shard in self._shards:
            entry = state_dict["param_state"].get(shard.name)
            if not isinstance(entry, dict):
                raise OptimizerStateError(
                    f"state_dict['param_state'] lacks parameter {shard.name!r}"
                )
            for key, target in zip(_STATE_KEYS, self._local_state(shard)):
                if key not in entry:
                    raise OptimizerStateError(
                        f"state_dict['param_state'][{shard.name!r}] lacks {key!r}"
                    )
                plan.append((target, self._owned_range(shard, key, entry[key])))
        with torch.no_grad():
            for target, source in plan:
                if target.data_ptr() != source.data_ptr():
                    target.copy_(source)
        self.step_count = step
        for shard in self._shards:
            if shard.main_param is not None:
                shard.model_slice().copy_(shard.main_param)
        self.model.mark_params_updated()
        self.model.start_param_sync(force_sync=True)

    def _owned_range(self, shard: _ParamShard, key: str, value: Any) -> torch.Tensor:
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
