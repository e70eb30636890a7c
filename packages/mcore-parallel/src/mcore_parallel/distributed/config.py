"""Configuration dataclasses of data parallelism: the DDP wrapper and the distributed optimizer."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mcore_parallel.errors import ParallelConfigError

__all__ = ["DDPConfig", "OptimizerConfig", "default_bucket_size"]


def default_bucket_size(dp_size: int) -> int:
    """Default number of elements per gradient bucket for a data-parallel group of ``dp_size``.

    Megatron-Core uses ``max(40_000_000, 1_000_000 * dp_size)`` elements so that each rank's
    share of a bucket stays large enough to saturate the interconnect as the group grows
    (``megatron/core/distributed/distributed_data_parallel.py``, NVIDIA/Megatron-LM).

    Args:
        dp_size: Number of data-parallel ranks.

    Returns:
        The bucket size in elements.

    Raises:
        ParallelConfigError: If ``dp_size`` is smaller than 1.
    """
    if dp_size < 1:
        raise ParallelConfigError(f"dp_size={dp_size} must be >= 1")
    return max(40_000_000, 1_000_000 * dp_size)


@dataclass(kw_only=True, slots=True)
class DDPConfig:
    """How :class:`~mcore_parallel.distributed.ddp.DistributedDataParallel` buffers and reduces."""

    grad_reduce_in_fp32: bool | None = None
    """Accumulate and reduce gradients in float32 even when parameters are bf16/fp16. None (the
    default) means True for bf16/fp16 parameters (fp32 gradient accumulation is the default for
    low-precision models) and the parameter's own dtype otherwise; False keeps bf16/fp16
    gradients (half the gradient memory, lossy accumulation)."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction asynchronously as soon as its gradients are complete."""

    bucket_size: int | None = None
    """Elements per bucket; ``None`` picks ``max(40M, 1M x dp)``; ``0`` puts everything in one."""

    average_in_collective: bool = False
    """Average with ``ReduceOp.AVG`` inside the collective instead of SUM then divide after."""

    average_over_data_parallel: bool = True
    """Gradients are the mean over the data-parallel ranks (the usual per-rank mean loss).
    False sums them instead: for losses already normalised by a global count (a per-token loss
    divided by the tokens of every rank, as in RL), so no factor has to be undone."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1): reduce-scatter + all-gather."""

    overlap_param_gather: bool = False
    """Finish parameter all-gathers lazily in forward pre-hooks (needs the distributed optimizer)."""

    check_for_nan_in_grad: bool = False
    """Raise when a reduced gradient holds NaN or Inf (costs one reduction per buffer)."""

    def __post_init__(self) -> None:
        if self.grad_reduce_in_fp32 is not None and not isinstance(self.grad_reduce_in_fp32, bool):
            raise ParallelConfigError(
                f"grad_reduce_in_fp32={self.grad_reduce_in_fp32!r} must be None (fp32 for "
                "bf16/fp16 parameters), True or False"
            )
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size < 0
        ):
            raise ParallelConfigError(
                f"bucket_size={self.bucket_size!r} must be None (default), 0 (one bucket) or a "
                "positive int (elements)"
            )
        for name in ("average_in_collective", "average_over_data_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ParallelConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ParallelConfigError(
                "overlap_param_gather=True needs use_distributed_optimizer=True: without a "
                "sharded optimizer there is no parameter all-gather to overlap"
            )

    def resolved_bucket_size(self, dp_size: int) -> int:
        """Bucket size in elements for a data-parallel group of ``dp_size`` ranks.

        Args:
            dp_size: Number of data-parallel ranks.

        Returns:
            ``bucket_size`` when set (``0`` means unbounded), else :func:`default_bucket_size`.
        """
        if self.bucket_size is None:
            return default_bucket_size(dp_size)
        return self.bucket_size if self.bucket_size > 0 else sys.maxsize


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW hyper-parameters of :class:`~mcore_parallel.distributed.optimizer.DistributedOptimizer`."""

    lr: float = 1e-3
    """Learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and of its square."""

    eps: float = 1e-8
    """Term added to the denominator for numerical stability."""

    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW), applied to every parameter unless
    ``exclude_from_weight_decay`` or explicit parameter groups say otherwise."""

    exclude_from_weight_decay: bool = False
    """Without explicit parameter groups, apply no weight decay to norms, biases and
    embeddings (the rule of :func:`~mcore_parallel.distributed.param_groups.no_weight_decay_names`)."""

    clip_grad: float = 0.0
    """Clip the global gradient norm to this value before the step; ``0`` disables clipping."""

    reshardable_state_dict: bool = False
    """Make ``sharded_state_dict()`` without arguments return the reshardable form: blocks of
    the global parameters that load under any tp, ep and dp size, at the cost of a dp
    all-gather and a full copy of the local shard's state (see
    :meth:`~mcore_parallel.distributed.optimizer.DistributedOptimizer.sharded_state_dict`)."""

    def __post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ParallelConfigError(f"lr={self.lr} must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ParallelConfigError(f"betas={self.betas} must be two values in [0, 1)")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.eps > 0.0:
            raise ParallelConfigError(f"eps={self.eps} must be > 0")
        if not self.weight_decay >= 0.0:
            raise ParallelConfigError(f"weight_decay={self.weight_decay} must be >= 0")
        if not isinstance(self.exclude_from_weight_decay, bool):
            raise ParallelConfigError(
                f"exclude_from_weight_decay={self.exclude_from_weight_decay!r} must be a bool"
            )
        if not isinstance(self.reshardable_state_dict, bool):
            raise ParallelConfigError(
                f"reshardable_state_dict={self.reshardable_state_dict!r} must be a bool"
            )
        if not self.clip_grad >= 0.0:
            raise ParallelConfigError(f"clip_grad={self.clip_grad} must be >= 0 (0 disables)")
