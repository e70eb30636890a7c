"""Block allocator: all-or-nothing allocation, the scratch block, double-free detection."""

import pytest

from mcore_inference import BlockAllocator, BlockAllocatorError, KVCacheExhaustedError
from mcore_inference.block_allocator import SCRATCH_BLOCK


def test_allocate_hands_out_distinct_blocks_never_the_scratch_block():
    allocator = BlockAllocator(9)
    blocks = allocator.allocate(5) + allocator.allocate(3)
    assert sorted(blocks) == list(range(1, 9))
    assert SCRATCH_BLOCK not in blocks
    assert allocator.num_free == 0


def test_allocate_more_than_free_raises_and_takes_nothing():
    allocator = BlockAllocator(5)
    allocator.allocate(2)
    with pytest.raises(KVCacheExhaustedError, match="count=3"):
        allocator.allocate(3)
    assert allocator.num_free == 2


def test_free_returns_blocks_for_reuse():
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    allocator.free(first[:2])
    assert allocator.num_free == 2
    again = allocator.allocate(2)
    assert sorted(again) == sorted(first[:2])


def test_double_free_raises_and_frees_nothing():
    allocator = BlockAllocator(6)
    blocks = allocator.allocate(3)
    allocator.free(blocks[:1])
    with pytest.raises(BlockAllocatorError, match=rf"\[{blocks[0]}\]"):
        allocator.free(blocks)
    assert allocator.num_free == 3


def test_fewer_than_two_blocks_is_rejected():
    with pytest.raises(BlockAllocatorError, match="num_blocks=1"):
        BlockAllocator(1)
