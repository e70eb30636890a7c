"""Data-parallel wrapper with contiguous buffers, bucketed overlapped gradient reduction and
parameter all-gather for a distributed optimizer, finished lazily by forward pre-hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.distributed.buffers import Bucket, CommGroup, ParamAndGradBuffer
from mcore_parallel.distributed.config import DDPConfig
from mcore_parallel.distributed.hooks import ParamSyncHooks
from mcore_parallel.distributed.offload import move_tensor
from mcore_parallel.errors import (
    GradientNotFiniteError,
    ParallelConfigError,
    ParallelStateError,
    ParallelTypeError,
)
from mcore_parallel.sharding import get_partition_dims

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wraps a module for data-parallel training over the data-parallel group of ``state``.

    Trainable parameters become views into contiguous buffers grouped by dtype; each gradient is
    accumulated into ``param.main_grad`` (float32 with ``grad_reduce_in_fp32``) by a
    post-accumulate-grad hook, which leaves ``param.grad`` as None. Buckets of the gradient
    buffer are all-reduced (or reduce-scattered under a distributed optimizer) in a fixed order
    on every rank: with ``overlap_grad_reduce`` as soon as a bucket and all buckets before it are
    complete during backward, otherwise in :meth:`finish_grad_sync`. Gradients end up averaged
    over the group. Dense gradients are reduced over the data x context group when ``state`` has
    one (context-parallel ranks see different tokens of the same sequences). Parameters
    partitioned over ``"ep"`` (:func:`~mcore_parallel.sharding.set_partition_dim`) go to
    separate buffers reduced over the expert-data-parallel group and divided by the dense dp
    size. Parameters marked ``sequence_parallel = True`` have their gradients summed over the
    tensor-parallel group in :meth:`finish_grad_sync` (``param.grad`` stays None, so
    ``allreduce_sequence_parallel_grads`` is not needed with this wrapper). The groups used
    are in ``tp_comm`` and ``ep_comm`` (None without a state).

    Args:
        module: The model. Its parameters must all live on one device.
        config: Buffering and communication options; defaults to ``DDPConfig()``.
        state: A :class:`~mcore_parallel.state.ParallelState`; None uses the whole world as the
            data-parallel group.

    Raises:
        ParallelTypeError: If ``module`` is not an ``nn.Module`` or ``config`` not a DDPConfig.
        ParallelConfigError: If the module has no trainable parameter or spans several devices.
        ParallelStateError: If ``state`` is None and torch.distributed is not initialised.
    """

    def __init__(
        self, module: nn.Module, config: DDPConfig | None = None, state: Any = None
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ParallelTypeError(f"module must be an nn.Module, got {type(module).__name__}")
        config = DDPConfig() if config is None else config
        if not isinstance(config, DDPConfig):
            raise ParallelTypeError(f"config must be a DDPConfig, got {type(config).__name__}")
        self.module = module
        self.config = config
        dense, expert, self.tp_comm, self.ep_comm = _comm_groups(state)
        self.dp_group, self.dp_size, self.dp_rank = dense.group, dense.size, dense.rank
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ParallelConfigError("module has no parameter with requires_grad=True to train")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ParallelConfigError(
                f"module parameters span devices {sorted(map(str, devices))}; expected one device"
            )
        self.device: torch.device = devices.pop()
        """Device of the parameter and gradient buffers."""
        self.num_shards = self.dp_size if config.use_distributed_optimizer else 1
        """Number of optimizer shards of dense buckets (the dp size under ZeRO-1)."""

        bucket_size = config.resolved_bucket_size(self.dp_size)
        groups: dict[tuple[torch.dtype, torch.dtype, bool], list[nn.Parameter]] = {}
        # Reverse registration order approximates the order in which gradients arrive.
        for param in reversed(params):
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            is_expert = "ep" in get_partition_dims(param)
            if is_expert and expert is None:
                raise ParallelConfigError(
                    "a parameter is partitioned over 'ep' (expert parallel) but state has no "
                    "expert_dp_group; pass the ParallelState from initialize(ep=...)"
                )
            groups.setdefault((param.dtype, grad_dtype, is_expert), []).append(param)
        self.param_grad_buffers: list[ParamAndGradBuffer] = []
        """One contiguous buffer per (parameter dtype, gradient dtype, expert or dense)."""
        self.buckets: list[Bucket] = []
        """All buckets of all buffers; collectives are issued in this order (gradients) and in
        reverse order (parameters)."""
        for (param_dtype, grad_dtype, is_expert), group_params in groups.items():
            comm = expert if is_expert else dense
            assert comm is not None
            # Gradients end up divided by the dense dp size: expert parameters already summed
            # the contributions of their expert-parallel peers' tokens.
            reduced_by = comm.size if config.average_in_collective else 1
            buffer = ParamAndGradBuffer(
                group_params,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                device=self.device,
                bucket_size=bucket_size,
                comm=comm,
                shard=config.use_distributed_optimizer,
                grad_scale=reduced_by / self.dp_size,
                is_expert=is_expert,
                first_bucket_index=len(self.buckets),
            )
            self.param_grad_buffers.append(buffer)
            self.buckets.extend(buffer.buckets)
        self.param_bucket: dict[nn.Parameter, Bucket] = {
            p: b for buffer in self.param_grad_buffers for p, b in buffer.param_bucket.items()
        }
        """Bucket of every trainable parameter."""
        self._sync_enabled = True
        self._next_grad_bucket = 0
        self._grad_sync_done = False
        self._offloaded: set[str] = set()
        self._grad_hook_handles = [
            p.register_post_accumulate_grad_hook(self._accumulate_grad) for p in params
        ]
        self.param_sync_hooks = ParamSyncHooks(self)
        """Record of the forward pre-hooks that finish parameter all-gathers."""
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        # Optimizers built over this model keep their own fp32 copies of the parameters;
        # load_state_dict refreshes them, or the next step would restore the old weights.
        if config.use_distributed_optimizer and config.overlap_param_gather:
            self.param_sync_hooks.enable()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module.

        Args:
            *args: Positional arguments of the wrapped module.
            **kwargs: Keyword arguments of the wrapped module.

        Returns:
            The wrapped module's output.

        Raises:
            ParallelStateError: If the parameter buffer is offloaded.
        """
        if "params" in self._offloaded:
            raise ParallelStateError("forward() while parameters are offloaded; reload first")
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Returns the wrapped module's state dict (keys without a ``module.`` prefix).

        Args:
            *args: Passed to ``nn.Module.state_dict``.
            **kwargs: Passed to ``nn.Module.state_dict``.

        Returns:
            The wrapped module's state dict.
        """
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads into the wrapped module in place (the buffers keep their storage).

        The fp32 main parameters of every ``DistributedOptimizer`` built over this model are
        refreshed from the loaded parameters, so the next step starts from them.

        Args:
            state_dict: A state dict of the wrapped module.
            strict: Whether keys must match exactly.
            assign: Must be False: assigning would detach parameters from the buffers.

        Returns:
            The missing and unexpected keys.

        Raises:
            ParallelConfigError: If ``assign`` is True.
        """
        if assign:
            raise ParallelConfigError("assign=True would detach parameters from the DDP buffers")
        self.finish_param_sync()
        result = self.module.load_state_dict(state_dict, strict=strict)
        loaded = {name for name, _ in self.module.named_parameters() if name in state_dict}
        for optimizer in list(self._optimizers):
            optimizer.reload_model_params(loaded)
        return result

    # ---------------------------------------------------------------- gradients

    def _accumulate_grad(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
        param.grad = None
        self._grad_sync_done = False
        if self.config.overlap_grad_reduce and self._sync_enabled:
            bucket = self.param_bucket[param]  # type: ignore[index]
            bucket.pending_grads.discard(param)  # type: ignore[arg-type]
            self._launch_ready_grad_buckets()

    def _launch_ready_grad_buckets(self) -> None:
        # Strict bucket order keeps the sequence of collectives identical on every rank even
        # when gradients arrive in a different order or a parameter gets none.
        while self._next_grad_bucket < len(self.buckets):
            bucket = self.buckets[self._next_grad_bucket]
            if bucket.pending_grads:
                return
            self._launch_grad_collective(bucket)

    def _launch_grad_collective(self, bucket: Bucket) -> None:
        self._next_grad_bucket = bucket.index + 1
        comm = bucket.buffer.comm
        if comm.size == 1:
            return
        op = dist.ReduceOp.AVG if self.config.average_in_collective else dist.ReduceOp.SUM
        grads = bucket.grad_view()
        if bucket.buffer.num_shards > 1:
            start, end = bucket.shard_range(comm.rank)
            shard = bucket.buffer.grad_data[start:end]
            bucket.grad_work = dist.reduce_scatter_tensor(
                shard, grads, op=op, group=comm.group, async_op=True
            )
        else:
            bucket.grad_work = dist.all_reduce(grads, op=op, group=comm.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Completes the reduction of every bucket (launching those not launched yet).

        Afterwards ``param.main_grad`` holds the gradient averaged over the data-parallel group
        (under a distributed optimizer only this rank's shard of each bucket is reduced). A
        second call without a new backward pass does nothing.

        Raises:
            GradientNotFiniteError: With ``check_for_nan_in_grad``, if a reduced gradient is
                not finite (names the buffer).
        """
        if self._grad_sync_done:
            return
        while self._next_grad_bucket < len(self.buckets):
            self._launch_grad_collective(self.buckets[self._next_grad_bucket])
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
            if bucket.buffer.grad_scale != 1.0:
                self._local_grad_range(bucket).mul_(bucket.buffer.grad_scale)
        self._allreduce_sequence_parallel_grads()
        if self.config.check_for_nan_in_grad:
            for position, buffer in enumerate(self.param_grad_buffers):
                if not torch.isfinite(buffer.grad_data).all():
                    raise GradientNotFiniteError(
                        f"gradient buffer {position} ({buffer.grad_dtype}) holds NaN or Inf "
                        f"after reduction on dp rank {self.dp_rank}"
                    )
        for bucket in self.buckets:
            bucket.reset_grad_state()
        self._next_grad_bucket = 0
        self._grad_sync_done = True

    def _allreduce_sequence_parallel_grads(self) -> None:
        # Replicated parameters applied to a sequence chunk (norm weights, the bias of a
        # sequence-parallel row layer) hold partial gradients on each tp rank. Summing whole
        # main_grads is correct for the reduced (owned) ranges; other ranges are never read.
        if self.tp_comm is None or self.tp_comm.size == 1:
            return
        grads = [
            p.main_grad  # type: ignore[attr-defined]
            for p in self.param_bucket
            if getattr(p, "sequence_parallel", False)
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_comm.group)
        for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(chunk.view_as(grad))

    def _local_grad_range(self, bucket: Bucket) -> torch.Tensor:
        if bucket.buffer.num_shards > 1:
            start, end = bucket.shard_range(bucket.buffer.shard_index)
            return bucket.buffer.grad_data[start:end]
        return bucket.grad_view()

    def zero_grad_buffer(self) -> None:
        """Zeroes every gradient buffer and forgets the reduction state of the buckets.

        In-flight reductions are waited for first so that none writes into zeroed memory.
        """
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
            bucket.reset_grad_state()
        self._next_grad_bucket = 0
        self._grad_sync_done = False
        for buffer in self.param_grad_buffers:
            buffer.grad_data.zero_()
        for param in self.param_bucket:
            param.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally, without any collective, inside the context.

        Use it for every micro-batch but the last of a step; the backward pass of the last
        micro-batch (outside the context) then reduces the accumulated sum. The previous state
        is restored on exit, also on exceptions, so contexts nest.

        Yields:
            None.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # ---------------------------------------------------------------- parameters

    def mark_params_updated(self) -> None:
        """Records that this rank's shard of every bucket changed and must be all-gathered.

        Called by the distributed optimizer after it wrote the updated shards.
        """
        for bucket in self.buckets:
            bucket.param_stale = bucket.buffer.num_shards > 1

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Starts the all-gather of updated parameter shards (distributed optimizer only).

        With ``overlap_param_gather`` and the forward pre-hooks enabled, only the all-gather of
        the first bucket used by the forward pass is dispatched; the hooks wait for it and
        prefetch the next. Otherwise (or with ``force_sync``) every stale bucket is gathered and
        waited for before returning, so the parameters are complete.

        Args:
            force_sync: Gather everything now, whatever the overlap setting.
        """
        if force_sync or not (self.config.overlap_param_gather and self.param_sync_hooks.enabled):
            self.finish_param_sync()
            return
        self._dispatch_param_gather(up_to=len(self.buckets) - 1)

    def _dispatch_param_gather(self, up_to: int) -> None:
        # Forward order is the reverse of the gradient order; dispatch in that strict order.
        for bucket in reversed(self.buckets[up_to:]):
            if not bucket.param_stale or bucket.param_work is not None:
                continue
            start, end = bucket.shard_range(bucket.buffer.shard_index)
            bucket.param_work = dist.all_gather_into_tensor(
                bucket.param_view(),
                bucket.buffer.param_data[start:end],
                group=bucket.buffer.comm.group,
                async_op=True,
            )

    def finish_param_sync(self, bucket: Bucket | None = None) -> None:
        """Waits until parameters are complete: one bucket (and those before it) or all.

        Args:
            bucket: The bucket whose parameters a module is about to use; None finishes every
                bucket. After finishing a bucket, the next one in forward order is prefetched.
        """
        target = 0 if bucket is None else bucket.index
        if not any(b.param_stale for b in self.buckets[target:]):
            return
        self._dispatch_param_gather(up_to=target)
        for pending in reversed(self.buckets[target:]):
            if pending.param_work is not None:
                pending.param_work.wait()
                pending.param_work = None
            pending.param_stale = False
        if target > 0:
            self._dispatch_param_gather(up_to=target - 1)

    @property
    def param_sync_pending(self) -> bool:
        """Whether some parameters still wait for their all-gather."""
        return any(b.param_stale for b in self.buckets)

    def enable_forward_pre_hook(self) -> None:
        """Registers the forward pre-hooks that finish parameter all-gathers (idempotent).

        Hooks go only on modules that directly own bucketed parameters, found in the module
        tree as it is now; each handle is recorded.

        Raises:
            ParallelConfigError: Without ``use_distributed_optimizer`` and
                ``overlap_param_gather``, where there is nothing for the hooks to finish.
        """
        if not (self.config.use_distributed_optimizer and self.config.overlap_param_gather):
            raise ParallelConfigError(
                "enable_forward_pre_hook() needs use_distributed_optimizer=True and "
                "overlap_param_gather=True in DDPConfig"
            )
        self.param_sync_hooks.enable()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Removes every recorded forward pre-hook; never raises and may be called repeatedly.

        Args:
            param_sync: Then finish all pending parameter all-gathers, so that the parameters
                are complete without the hooks.
        """
        self.param_sync_hooks.disable()
        if param_sync:
            self.finish_param_sync()

    @contextlib.contextmanager
    def param_sync_hooks_disabled(self) -> Iterator[None]:
        """Context in which the hooks are off and the parameters fully synchronised.

        On exit (also on exceptions) the hooks are re-enabled only if they were enabled on
        entry, so the contexts nest and enable/disable always balance.

        Yields:
            None.
        """
        was_enabled = self.param_sync_hooks.enabled
        self.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            if was_enabled:
                self.param_sync_hooks.enable()

    # ---------------------------------------------------------------- offload

    @torch.inference_mode(False)
    def offload_to_cpu(self, *, params: bool = True, grads: bool = True) -> None:
        """Moves the parameter and/or gradient buffers to host memory, freeing device memory.

        Parameters are synchronised first. Host copies are pinned when the device is CUDA.
        Parameters and ``main_grad`` stay views of the (now host) buffers. Parts already
        offloaded are left as they are.

        Args:
            params: Offload the parameter buffers.
            grads: Offload the gradient buffers (in-flight reductions are finished first).
        """
        self.finish_param_sync()
        cpu = torch.device("cpu")
        if grads and "grads" not in self._offloaded:
            for bucket in self.buckets:
                if bucket.grad_work is not None:
                    bucket.grad_work.wait()
                    bucket.grad_work = None
            for buffer in self.param_grad_buffers:
                buffer.grad_data = move_tensor(buffer.grad_data, cpu)
            self._offloaded.add("grads")
        if params and "params" not in self._offloaded:
            for buffer in self.param_grad_buffers:
                buffer.param_data = move_tensor(buffer.param_data, cpu)
            self._offloaded.add("params")
        for buffer in self.param_grad_buffers:
            buffer.bind_views()

    @torch.inference_mode(False)
    def reload_from_cpu(self) -> None:
        """Moves offloaded buffers back to the device, bit for bit; a no-op when none is."""
        if "grads" in self._offloaded:
            for buffer in self.param_grad_buffers:
                buffer.grad_data = move_tensor(buffer.grad_data, self.device)
        if "params" in self._offloaded:
            for buffer in self.param_grad_buffers:
                buffer.param_data = move_tensor(buffer.param_data, self.device)
        self._offloaded.clear()
        for buffer in self.param_grad_buffers:
            buffer.bind_views()

    @property
    def offloaded(self) -> frozenset[str]:
        """Which buffers are in host memory: a subset of ``{"params", "grads"}``."""
        return frozenset(self._offloaded)


def _comm_groups(
    state: Any,
) -> tuple[CommGroup, CommGroup | None, CommGroup | None, CommGroup | None]:
    """Dense data-parallel, expert data-parallel, tensor- and expert-parallel groups."""
    if state is None:
        if not dist.is_initialized():
            raise ParallelStateError(
                "state=None needs torch.distributed initialised (the world is the dp group)"
            )
        return CommGroup(None, dist.get_world_size(), dist.get_rank()), None, None, None

    def view(prefix: str) -> CommGroup | None:
        if not hasattr(state, f"{prefix}_group"):
            return None
        return CommGroup(
            getattr(state, f"{prefix}_group"),
            int(getattr(state, f"{prefix}_size")),
            int(getattr(state, f"{prefix}_rank")),
        )

    # Context-parallel ranks see other tokens of the same sequences: dense gradients are
    # reduced over data x context.
    dense = view("dp_cp") or view("dp")
    if dense is None:
        raise ParallelTypeError(
            f"state must be a ParallelState (with dp_group, dp_size, dp_rank) or None, "
            f"got {type(state).__name__}"
        )
    return dense, view("expert_dp"), view("tp"), view("ep")
