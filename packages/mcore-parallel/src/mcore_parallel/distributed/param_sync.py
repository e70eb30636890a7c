"""All-gather of the parameter shards a distributed optimizer updated, optionally overlapped.

After a sharded optimizer step every rank holds fresh values only for its shard of each bucket.
:class:`ParamSync` all-gathers them bucket by bucket, in the forward order (the reverse of the
gradient order) and in the same order on every rank; with forward pre-hooks
(:class:`~mcore_parallel.distributed.hooks.ParamSyncHooks`) the wait for a bucket happens
right before the first module that uses it runs, and the next bucket is prefetched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from mcore_parallel.distributed.buffers import Bucket

__all__ = ["ParamSync"]


class ParamSync:
    """Tracks which buckets hold stale parameters and gathers them.

    Args:
        buckets: Every bucket of the model, in gradient order (their ``index`` order).
    """

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self.buckets = list(buckets)

    def mark_updated(self) -> None:
        """Records that this rank's shard of every sharded bucket changed."""
        for bucket in self.buckets:
            bucket.param_stale = bucket.buffer.num_shards > 1

    @property
    def pending(self) -> bool:
        """Whether some parameters still wait for their all-gather."""
        return any(b.param_stale for b in self.buckets)

    def dispatch(self, up_to: int) -> None:
        """Launches the all-gathers of stale buckets ``up_to`` and after, last bucket first.

        Args:
            up_to: Index of the last bucket (in forward order) to launch.
        """
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

    def finish(self, bucket: Bucket | None = None) -> None:
        """Waits until parameters are complete: one bucket (and those before it) or all.

        Args:
            bucket: The bucket whose parameters a module is about to use; None finishes every
                bucket. After finishing a bucket, the next one in forward order is prefetched.
        """
        target = 0 if bucket is None else bucket.index
        if not any(b.param_stale for b in self.buckets[target:]):
            return
        self.dispatch(up_to=target)
        for pending in reversed(self.buckets[target:]):
            if pending.param_work is not None:
                pending.param_work.wait()
                pending.param_work = None
            pending.param_stale = False
        if target > 0:
            self.dispatch(up_to=target - 1)
