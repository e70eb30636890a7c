"""Contiguous parameter and gradient buffers split into communication buckets.

Every trainable parameter of a :class:`~mcore_parallel.distributed.ddp.DistributedDataParallel`
becomes a view into one flat parameter buffer, and its gradient (``param.main_grad``) a view
into a flat gradient buffer of the same layout. Buckets are contiguous ranges of both buffers
that are reduced (and, with a distributed optimizer, all-gathered) by one collective each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Bucket", "CommGroup", "ParamAndGradBuffer"]

# Shards start on multiples of this many elements so that each rank's part of a collective is
# aligned for the interconnect (256 bytes for fp32).
_SHARD_ALIGNMENT = 64


@dataclass(frozen=True)
class CommGroup:
    """A process group with this rank's view of it.

    Attributes:
        group: The group (None is the default group).
        size: Number of ranks in it.
        rank: This rank's index in it.
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int


@dataclass(eq=False)
class Bucket:
    """A contiguous range of a :class:`ParamAndGradBuffer` reduced by one collective.

    Attributes:
        buffer: The buffer holding this bucket.
        index: Position of the bucket in the owning DDP's global bucket list.
        params: Parameters whose elements lie in this bucket, in buffer order.
        offset: First element of the bucket in the buffer.
        numel: Number of elements, padding included (a multiple of the number of shards).
        pending_grads: Parameters whose gradient has not arrived in this backward pass.
        grad_work: Handle of the in-flight gradient collective, if any.
        param_work: Handle of the in-flight parameter all-gather, if any.
        param_stale: Whether the optimizer updated this rank's shard since the last gather.
    """

    buffer: ParamAndGradBuffer
    index: int
    params: list[torch.nn.Parameter]
    offset: int
    numel: int
    pending_grads: set[torch.nn.Parameter] = field(default_factory=set)
    grad_work: dist.Work | None = None
    param_work: dist.Work | None = None
    param_stale: bool = False

    def grad_view(self) -> torch.Tensor:
        """Returns the bucket's slice of the gradient buffer.

        Returns:
            A 1-D view of ``numel`` elements.
        """
        return self.buffer.grad_data[self.offset : self.offset + self.numel]

    def param_view(self) -> torch.Tensor:
        """Returns the bucket's slice of the parameter buffer.

        Returns:
            A 1-D view of ``numel`` elements.
        """
        return self.buffer.param_data[self.offset : self.offset + self.numel]

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Returns the buffer range ``[start, end)`` of one shard of this bucket.

        Args:
            shard: Index of the shard (the data-parallel rank under a distributed optimizer).

        Returns:
            Start and end element in buffer coordinates.
        """
        size = self.numel // self.buffer.num_shards
        start = self.offset + shard * size
        return start, start + size

    def reset_grad_state(self) -> None:
        """Forgets which gradients arrived, ready for the next backward pass."""
        self.pending_grads = set(self.params)
        self.grad_work = None


class ParamAndGradBuffer:
    """Flat parameter and gradient storage for parameters of one dtype pair.

    Args:
        params: Parameters in the order they get their gradients (reverse of the forward order),
            so that buckets fill one after the other during backward.
        param_dtype: dtype of every parameter in ``params``.
        grad_dtype: dtype of the gradient buffer (float32 when reducing in fp32).
        device: Device of both buffers.
        bucket_size: Elements after which a new bucket starts (a parameter never spans two).
        comm: Group over which the gradients are reduced (and parameters gathered).
        shard: Split each bucket into ``comm.size`` optimizer shards (distributed optimizer);
            every bucket's size is then padded to a multiple of ``64 x comm.size``.
        grad_scale: Factor applied to the reduced gradients (1.0: none).
        is_expert: Whether the parameters are expert-parallel (reduced over expert-DP).
        first_bucket_index: Index given to this buffer's first bucket.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
        bucket_size: int,
        comm: CommGroup,
        shard: bool,
        grad_scale: float,
        is_expert: bool,
        first_bucket_index: int,
    ) -> None:
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.comm = comm
        self.num_shards = comm.size if shard else 1
        self.shard_index = comm.rank if shard else 0
        """Index of the shard this rank updates (0 when unsharded)."""
        self.grad_scale = grad_scale
        self.is_expert = is_expert
        self.param_range: dict[torch.nn.Parameter, tuple[int, int]] = {}
        """Buffer range ``[start, end)`` of each parameter."""
        self.param_bucket: dict[torch.nn.Parameter, Bucket] = {}
        """Bucket of each parameter."""
        self.buckets: list[Bucket] = []
        """Buckets in gradient-arrival order."""

        layout: list[tuple[list[torch.nn.Parameter], int, int]] = []
        current: list[torch.nn.Parameter] = []
        bucket_start = offset = 0
        for param in params:
            self.param_range[param] = (offset, offset + param.numel())
            offset += param.numel()
            current.append(param)
            if offset - bucket_start >= bucket_size:
                offset = self._padded(offset, bucket_start)
                layout.append((current, bucket_start, offset - bucket_start))
                current, bucket_start = [], offset
        if current:
            offset = self._padded(offset, bucket_start)
            layout.append((current, bucket_start, offset - bucket_start))
        self.numel = offset

        self.param_data: torch.Tensor = torch.zeros(self.numel, dtype=param_dtype, device=device)
        """Flat storage of the parameters; each parameter's ``data`` is a view of it."""
        self.grad_data: torch.Tensor = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        """Flat storage of the gradients; each parameter's ``main_grad`` is a view of it."""
        for param in params:
            start, end = self.param_range[param]
            self.param_data[start:end].copy_(param.data.reshape(-1))
        for position, (bucket_params, start, numel) in enumerate(layout):
            bucket = Bucket(self, first_bucket_index + position, bucket_params, start, numel)
            bucket.reset_grad_state()
            self.buckets.append(bucket)
            for param in bucket_params:
                self.param_bucket[param] = bucket
        self.bind_views()

    def _padded(self, end: int, bucket_start: int) -> int:
        if self.num_shards == 1:
            return end
        multiple = self.num_shards * _SHARD_ALIGNMENT
        return bucket_start + -(-(end - bucket_start) // multiple) * multiple

    def bind_views(self) -> None:
        """Points every parameter's ``data`` and ``main_grad`` at the current buffers.

        Called after construction and whenever a buffer is replaced (offload, reload).
        """
        for param, (start, end) in self.param_range.items():
            param.data = self.param_data[start:end].view(param.shape)
            param.main_grad = self.grad_data[start:end].view(param.shape)  # type: ignore[attr-defined]
