"""ShardedTensor validates the block it describes."""

import pytest
import torch

from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.sharding import ShardedTensor


def test_block_inside_global_tensor_is_accepted():
    shard = ShardedTensor(torch.zeros(2, 3), global_shape=[4, 3], global_offset=[2, 0])
    assert shard.global_shape == (4, 3)
    assert shard.global_offset == (2, 0)
    assert not shard.is_full


def test_full_block_reports_full():
    assert ShardedTensor(torch.zeros(4), (4,), (0,)).is_full


@pytest.mark.parametrize(
    ("shape", "offset"),
    [((4, 3), (3, 0)), ((4,), (0, 0)), ((4, 3), (-1, 0))],
)
def test_block_outside_or_mismatched_raises(shape, offset):
    with pytest.raises(ParallelConfigError):
        ShardedTensor(torch.zeros(2, 3), global_shape=shape, global_offset=offset)


def test_negative_replica_id_raises():
    with pytest.raises(ParallelConfigError, match="replica_id"):
        ShardedTensor(torch.zeros(1), (1,), (0,), replica_id=-1)
