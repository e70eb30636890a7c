"""AdamW with fp32 main parameters and optimizer state sharded over data-parallel ranks (ZeRO-1).

Each bucket of the DDP buffers is split into ``dp`` equal contiguous shards; rank ``r`` owns
shard ``r`` of every bucket. Gradients arrive by reduce-scatter (only the owned shard is
reduced), the step updates the owned fp32 main parameters with AdamW, and the result is written
into the parameter buffer and all-gathered, synchronously or overlapped with the next forward
pass.

The optimizer is a ``torch.optim.Optimizer``: ``param_groups`` (per-group ``lr``, ``betas``,
``eps``, ``weight_decay``), ``state_dict``/``load_state_dict`` in torch's format and
``zero_grad`` behave as torch's, so ``torch.optim.lr_scheduler`` classes drive it unchanged.

Memory per parameter of a bf16 model (the default mixed precision: bf16 parameters, fp32
gradient accumulation, fp32 main parameters and moments), with ``d`` data-parallel ranks:
2 bytes (bf16 parameter) + 4 (fp32 gradient) + 12 / d (fp32 main parameter, exp_avg,
exp_avg_sq), i.e. 18 bytes unsharded and 6 + 12 / d with ``use_distributed_optimizer``, as
listed for Megatron-Core's distributed optimizer (Megatron Core developer guide, "Distributed
Optimizer"). An fp32 model holds 4 + 4 + 12 / d bytes: the optimizer keeps its own fp32 copy
of the parameters so that model tensors and optimizer state never alias.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn

from mcore_parallel.distributed.adamw import adamw_update
from mcore_parallel.distributed.config import OptimizerConfig
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.grad_norm import clip_coefficient, global_grad_norm
from mcore_parallel.distributed.offload import move_tensor
from mcore_parallel.distributed.optimizer_state import (
    load_sharded_state_dict,
    load_torch_state_dict,
    sharded_state_dict,
    torch_state_dict,
)
from mcore_parallel.distributed.param_groups import check_param_groups, weight_decay_param_groups
from mcore_parallel.distributed.shards import STATE_KEYS, ParamShard, build_shards
from mcore_parallel.errors import ParallelStateError, ParallelTypeError

__all__ = ["DistributedOptimizer", "adamw_update"]


class DistributedOptimizer(torch.optim.Optimizer):
    """AdamW over a :class:`DistributedDataParallel` model, sharded when the model asks for it.

    With ``use_distributed_optimizer=True`` in the model's DDPConfig, each rank holds fp32 main
    parameters and Adam moments only for its shard of every bucket; otherwise every rank holds
    them for all parameters (plain data parallelism with fp32 master weights). The update is
    elementwise AdamW (:func:`adamw_update`, the formula of ``torch.optim.AdamW``), so the
    sharded step equals the unsharded one.

    Parameter groups: ``param_groups`` as for a torch optimizer (dicts with ``"params"`` and
    any of ``lr``, ``betas``, ``eps``, ``weight_decay``; the rest from ``config``). Without
    them there is one group of every trainable parameter, or, with
    ``config.exclude_from_weight_decay``, the two groups of
    :func:`~mcore_parallel.distributed.param_groups.weight_decay_param_groups` (no decay on
    norms, biases and embeddings). Learning-rate schedulers write ``group["lr"]``; :attr:`lr`
    sets every group's at once.

    Args:
        model: The DDP-wrapped model.
        config: AdamW hyper-parameters; defaults to ``OptimizerConfig()``.
        param_groups: Parameter groups over the trainable parameters of ``model.module``; each
            parameter in exactly one.

    Raises:
        ParallelTypeError: If ``model`` is not a DistributedDataParallel, ``config`` not an
            OptimizerConfig or ``param_groups`` not a list of dicts.
        ParallelConfigError: If ``param_groups`` miss or repeat a trainable parameter, hold
            another tensor or set an unknown option.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        config: OptimizerConfig | None = None,
        *,
        param_groups: list[dict[str, Any]] | None = None,
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
        names = {p: n for n, p in model.module.named_parameters() if p in model.param_bucket}
        trainable = list(names)
        if param_groups is None:
            if config.exclude_from_weight_decay:
                param_groups = weight_decay_param_groups(model.module, config.weight_decay)
            else:
                param_groups = [{"params": trainable}]
        groups = check_param_groups(param_groups, trainable, names)
        defaults = {
            "lr": config.lr,
            "betas": config.betas,
            "eps": config.eps,
            "weight_decay": config.weight_decay,
        }
        super().__init__(groups, defaults)
        group_of = {p: i for i, group in enumerate(self.param_groups) for p in group["params"]}
        self.sharded = model.num_shards > 1
        """Whether the state is split over the data-parallel ranks."""
        self._shards: list[ParamShard] = build_shards(model, group_of)
        self.step_count = 0
        """Number of optimizer steps taken (restored by the load methods)."""
        self._state_offloaded = False
        # The model's load_state_dict changes weights behind the fp32 main parameters; a
        # post-hook on the wrapped module refreshes them, or the next step would restore the
        # old weights. The hook holds the optimizer weakly.
        self._load_hook = model.module.register_load_state_dict_post_hook(
            functools.partial(_refresh_after_load, weakref.ref(self), dict(names))
        )

    @property
    def shards(self) -> list[ParamShard]:
        """This rank's part of every parameter and its fp32 state, in bucket order."""
        return self._shards

    @property
    def lr(self) -> float:
        """Learning rate of the first group; assigning sets every group's."""
        return float(self.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = value

    # ---------------------------------------------------------------- stepping

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> float:  # type: ignore[override]
        """Synchronises gradients, takes one AdamW step on the owned shard and syncs parameters.

        Args:
            closure: Must be None (re-evaluating the loss would need another backward pass
                through the gradient buffers); accepted for torch's signature.

        Returns:
            The global gradient norm, before clipping: reduced over exactly the groups that
            shard the gradients (see :mod:`~mcore_parallel.distributed.grad_norm`).

        Raises:
            ParallelStateError: If optimizer state or buffers are offloaded.
            ParallelTypeError: If ``closure`` is given.
        """
        if closure is not None:
            raise ParallelTypeError("closure must be None: DistributedOptimizer.step takes none")
        if self._state_offloaded or self.model.offloaded:
            raise ParallelStateError(
                "step() while state is offloaded; call reload_from_cpu() first"
            )
        self.model.finish_grad_sync()
        # The shards are about to be overwritten: no all-gather may still read them.
        self.model.finish_param_sync()
        owned = [s for s in self._shards if s.main_param is not None]
        grads = [s.grad().float() for s in owned]
        counted = [(s.buffer.is_expert, g) for s, g in zip(owned, grads) if s.replica_id == 0]
        grad_norm = global_grad_norm(
            [g for is_expert, g in counted if not is_expert],
            [g for is_expert, g in counted if is_expert],
            self.model.groups,
            self.model.device,
        )
        scale = clip_coefficient(grad_norm, self.config.clip_grad)
        if scale < 1.0:
            grads = [grad * scale for grad in grads]
        self.step_count += 1
        for index, group in enumerate(self.param_groups):
            members = [(s, g) for s, g in zip(owned, grads) if s.group_index == index]
            adamw_update(
                [s.main_param for s, _ in members],  # type: ignore[misc]
                [g for _, g in members],
                [s.exp_avg for s, _ in members],  # type: ignore[misc]
                [s.exp_avg_sq for s, _ in members],  # type: ignore[misc]
                step=self.step_count,
                lr=float(group["lr"]),
                betas=tuple(group["betas"]),  # type: ignore[arg-type]
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
            )
        self.write_main_params_to_model(force_sync=False)
        return grad_norm

    def write_main_params_to_model(self, *, force_sync: bool = True) -> None:
        """Copies the fp32 main parameters into the model (cast) and all-gathers them.

        Args:
            force_sync: Finish the all-gather before returning (else it may overlap the next
                forward pass, with ``overlap_param_gather``).
        """
        with torch.no_grad():
            for shard in self._shards:
                if shard.main_param is not None:
                    shard.model_slice().copy_(shard.main_param)
        self.model.mark_params_updated()
        self.model.start_param_sync(force_sync=force_sync)

    def reload_model_params(self, names: Collection[str] | None = None) -> None:
        """Copies the model's current parameters into the fp32 main parameters.

        Needed after the model's weights were changed in place outside the optimizer (loaded
        from a checkpoint, synchronised from a trainer); otherwise the next :meth:`step`
        writes the old main parameters back over them. A ``load_state_dict`` of the model runs
        it (through a load post-hook) for the parameters it loaded. The Adam moments and the
        step count are kept.

        Args:
            names: Names (as in ``model.module.named_parameters()``) of the parameters to
                refresh; None refreshes all. Refreshing only the changed ones keeps the fp32
                precision of the others when the model holds low-precision parameters.
        """
        self.model.finish_param_sync()
        self._copy_model_to_main(names)

    def _copy_model_to_main(self, names: Collection[str] | None) -> None:
        with torch.no_grad():
            for shard in self._shards:
                if shard.main_param is not None and (names is None or shard.name in names):
                    shard.main_param.copy_(shard.model_slice())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the model's gradient buffers (``param.grad`` stays None).

        Args:
            set_to_none: Accepted for torch's signature; the buffers are always zeroed in
                place because parameters' ``main_grad`` are views of them.
        """
        self.model.zero_grad_buffer()

    # ---------------------------------------------------------------- state dicts

    def state_dict(self) -> dict[str, Any]:
        """Returns the state in ``torch.optim.AdamW``'s format for this rank's local parameters.

        ``state[i]`` holds ``step`` (a float tensor, as torch's), ``exp_avg``, ``exp_avg_sq``
        and ``main_param`` (fp32, shaped like the parameter) of the ``i``-th parameter of the
        groups; ``param_groups`` their options. Under a sharded optimizer the full tensors are
        all-gathered over each parameter's data-parallel group, so every rank of it must call
        this. Loading the result (or a ``torch.optim.AdamW`` state dict of the same
        parameters) with :meth:`load_state_dict` resumes exactly.

        Returns:
            The state dict.
        """
        self._check_not_offloaded("state_dict()")
        return torch_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict in torch's format and writes the main parameters to the model.

        Args:
            state_dict: From :meth:`state_dict` or a ``torch.optim.AdamW`` over the same
                parameters in the same groups (main parameters then come from the model).

        Raises:
            OptimizerStateError: If the groups or a tensor do not match.
            ParallelStateError: If the optimizer state is offloaded.
        """
        self._check_not_offloaded("load_state_dict()")
        load_torch_state_dict(self, state_dict)

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
        Group options (learning rates) are not part of it: a scheduler's own state dict
        restores them.

        Args:
            reshardable: Return the reshardable form; None takes
                ``config.reshardable_state_dict`` (what a checkpoint library gets when it calls
                this method without arguments).

        Returns:
            The nested state dict.

        Raises:
            ParallelStateError: If the optimizer state is offloaded.
        """
        self._check_not_offloaded("sharded_state_dict()")
        if reshardable is None:
            reshardable = self.config.reshardable_state_dict
        return sharded_state_dict(self, reshardable)

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
        self._check_not_offloaded("load_sharded_state_dict()")
        load_sharded_state_dict(self, state_dict)

    def _check_not_offloaded(self, what: str) -> None:
        if self._state_offloaded:
            raise ParallelStateError(f"{what} while offloaded; reload first")

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
            for key in STATE_KEYS:
                tensor = getattr(shard, key)
                if tensor is not None:
                    setattr(shard, key, move_tensor(tensor, device))


def _refresh_after_load(
    optimizer_ref: weakref.ref[DistributedOptimizer],
    names: dict[nn.Parameter, str],
    module: nn.Module,
    incompatible_keys: Any,
) -> None:
    optimizer = optimizer_ref()
    if optimizer is None:
        return
    missing = set(incompatible_keys.missing_keys)
    optimizer._copy_model_to_main([n for n in names.values() if n not in missing])
