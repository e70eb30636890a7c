"""ShardedTensor validates the block it describes."""

import pytest
import torch

from mcore_parallel.errors import ParallelConfigError, ParallelTypeError
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


def test_block_that_does_not_fit_names_offset_shape_and_dimension():
    with pytest.raises(ParallelConfigError, match=r"global_offset=\(3, 0\).*global_shape=\(4, 3\)"):
        ShardedTensor(torch.zeros(2, 3), global_shape=(4, 3), global_offset=(3, 0))


@pytest.mark.parametrize(
    ("local", "replica_id", "name"), [([0.0], 0, "local"), (None, "1", "replica_id")]
)
def test_wrong_types_raise_type_error_naming_the_field(local, replica_id, name):
    local = torch.zeros(1) if local is None else local
    with pytest.raises(ParallelTypeError, match=name):
        ShardedTensor(local, (1,), (0,), replica_id=replica_id)


def test_negative_replica_id_raises():
    with pytest.raises(ParallelConfigError, match="replica_id"):
        ShardedTensor(torch.zeros(1), (1,), (0,), replica_id=-1)
