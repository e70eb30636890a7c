"""Data-parallel wrapper with contiguous buffers, bucketed overlapped gradient reduction and
parameter all-gather for a distributed optimizer, finished lazily by forward pre-hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.distributed.buffers import Bucket, ParamAndGradBuffer
from mcore_parallel.distributed.config import DDPConfig
from mcore_parallel.distributed.groups import DataParallelGroups
from mcore_parallel.distributed.hooks import ParamSyncHooks
from mcore_parallel.distributed.offload import move_buffers
from mcore_parallel.distributed.param_sync import ParamSync
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
    accumulated into ``param.main_grad`` (float32 for bf16/fp16 parameters unless
    ``grad_reduce_in_fp32=False``) by a
    post-accumulate-grad hook, which leaves ``param.grad`` as None. Buckets of the gradient
    buffer are all-reduced (or reduce-scattered under a distributed optimizer) in a fixed order
    on every rank: with ``overlap_grad_reduce`` as soon as a bucket and all buckets before it are
    complete during backward, otherwise in :meth:`finish_grad_sync`. Gradients end up averaged
    over the group. Dense gradients are reduced over the data x context group when ``state`` has
    one (context-parallel ranks see different tokens of the same sequences). Parameters
    partitioned over ``"ep"`` (:func:`~mcore_parallel.sharding.set_partition_dim`) go to
    separate buffers reduced over the expert-data-parallel group and divided by the dense
    data x context size, like the dense ones: each expert's gradient already sums the
    contributions of the tokens its expert-parallel peers sent it, so the sum over expert-DP
    covers every data x context rank's tokens once. Parameters marked ``sequence_parallel = True`` have their gradients summed over the
    tensor-parallel group in :meth:`finish_grad_sync` (``param.grad`` stays None, so
    ``allreduce_sequence_parallel_grads`` is not needed with this wrapper). The groups used
    are in :attr:`groups` (``tp_comm`` and ``ep_comm`` are shortcuts).

    Args:
        module: The model. Its parameters must all live on one device.
        config: Buffering and communication options; defaults to ``DDPConfig()``.
        state: A :class:`~mcore_parallel.state.ParallelState`; a ``ProcessGroup``, the
            data-parallel group of a model trained on a subset of the world; or None, which
            uses the whole world as the data-parallel group.

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
        self.groups = DataParallelGroups.of(state)
        """The groups gradients are reduced over, and the model-parallel ones."""
        dense, expert = self.groups.dense, self.groups.expert
        self.tp_comm, self.ep_comm = self.groups.tp, self.groups.ep
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
            grad_dtype = _grad_dtype(param.dtype, config.grad_reduce_in_fp32)
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
            # Expert gradients end up divided by the dense (dp x cp) size too: each already sums
            # the contributions of its expert-parallel peers' tokens.
            reduced_by = comm.size if config.average_in_collective else 1
            # Summed gradients: undo only the collective's own averaging.
            divide_by = self.dp_size if config.average_over_data_parallel else 1
            buffer = ParamAndGradBuffer(
                group_params,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                device=self.device,
                bucket_size=bucket_size,
                comm=comm,
                shard=config.use_distributed_optimizer,
                grad_scale=reduced_by / divide_by,
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
        self._param_sync = ParamSync(self.buckets)
        self.param_sync_hooks = ParamSyncHooks(module, self.param_bucket, self.finish_param_sync)
        """Record of the forward pre-hooks that finish parameter all-gathers."""
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

        The load runs the wrapped module's ``load_state_dict`` post-hooks; a
        ``DistributedOptimizer`` built over this model registers one that refreshes its fp32
        main parameters from the loaded parameters, so the next step starts from them.

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
        return self.module.load_state_dict(state_dict, strict=strict)

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
        self._param_sync.mark_updated()

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
        self._param_sync.dispatch(up_to=len(self.buckets) - 1)

    def finish_param_sync(self, bucket: Bucket | None = None) -> None:
        """Waits until parameters are complete: one bucket (and those before it) or all.

        Args:
            bucket: The bucket whose parameters a module is about to use; None finishes every
                bucket. After finishing a bucket, the next one in forward order is prefetched.
        """
        self._param_sync.finish(bucket)

    @property
    def param_sync_pending(self) -> bool:
        """Whether some parameters still wait for their all-gather."""
        return self._param_sync.pending

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
        params = params and "params" not in self._offloaded
        grads = grads and "grads" not in self._offloaded
        cpu = torch.device("cpu")
        move_buffers(self.param_grad_buffers, self.buckets, cpu, params=params, grads=grads)
        self._offloaded |= {name for name, moved in (("params", params), ("grads", grads)) if moved}

    def reload_from_cpu(self) -> None:
        """Moves offloaded buffers back to the device, bit for bit; a no-op when none is."""
        move_buffers(
            self.param_grad_buffers,
            self.buckets,
            self.device,
            params="params" in self._offloaded,
            grads="grads" in self._offloaded,
        )
        self._offloaded.clear()

    @property
    def offloaded(self) -> frozenset[str]:
        """Which buffers are in host memory: a subset of ``{"params", "grads"}``."""
        return frozenset(self._offloaded)


def _grad_dtype(param_dtype: torch.dtype, reduce_in_fp32: bool | None) -> torch.dtype:
    """Gradient buffer dtype: float32 for low-precision parameters unless told otherwise."""
    if reduce_in_fp32 is None:
        low_precision = param_dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if low_precision else param_dtype
    return torch.float32 if reduce_in_fp32 else param_dtype
