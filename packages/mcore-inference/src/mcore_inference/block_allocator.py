"""Free-list allocator of the fixed-size blocks of the paged KV cache."""

from __future__ import annotations

from collections import deque

from mcore_inference.errors import BlockAllocatorError, KVCacheExhaustedError

__all__ = ["SCRATCH_BLOCK", "BlockAllocator"]

SCRATCH_BLOCK = 0
"""Block never handed out: padded (graph) batch rows write their keys and values there."""


class BlockAllocator:
    """Hands out KV blocks ``1 .. num_blocks - 1`` (block 0 is the scratch block).

    Allocation is all-or-nothing: a request either gets every block it asked for or the
    allocator is left unchanged. A block may be shared (requests whose prompts begin with the
    same blocks of tokens, see ``InferenceConfig.share_prompt_prefixes``): :meth:`share` adds a
    holder, and the block returns to the free list when its last holder frees it.

    Args:
        num_blocks: Blocks in the cache, the scratch block included (at least 2).

    Raises:
        BlockAllocatorError: If ``num_blocks`` is below 2.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise BlockAllocatorError(
                f"num_blocks={num_blocks!r}; expected an integer >= 2 (block 0 is scratch)"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._used: set[int] = set()
        self._extra_holders: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks free right now."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks.

        Args:
            count: Number of blocks (>= 0).

        Returns:
            The block ids.

        Raises:
            BlockAllocatorError: If ``count`` is negative.
            KVCacheExhaustedError: If fewer than ``count`` blocks are free (nothing is taken).
        """
        if count < 0:
            raise BlockAllocatorError(f"count={count}; expected a non-negative number of blocks")
        if count > len(self._free):
            raise KVCacheExhaustedError(
                f"count={count} blocks requested but only {len(self._free)} of "
                f"{self.capacity} are free"
            )
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a holder to allocated blocks (each holder frees them once).

        Args:
            blocks: Allocated blocks, each once.

        Raises:
            BlockAllocatorError: If a block is not currently allocated or repeats (nothing is
                shared then).
        """
        if len(set(blocks)) != len(blocks) or not self._used.issuperset(blocks):
            raise BlockAllocatorError(
                f"blocks={sorted(blocks)} hold a repeat or a block that is not allocated; "
                "expected distinct blocks returned by allocate()"
            )
        for block in blocks:
            self._extra_holders[block] = self._extra_holders.get(block, 0) + 1

    def holders(self, block: int) -> int:
        """Holders of a block (0 when it is free).

        Args:
            block: Block id.

        Returns:
            The count.
        """
        return self._extra_holders.get(block, 0) + 1 if block in self._used else 0

    def free(self, blocks: list[int]) -> None:
        """Release one hold on each block; a block without holders returns to the free list.

        Args:
            blocks: Blocks obtained from :meth:`allocate` (or :meth:`share`), each once.

        Raises:
            BlockAllocatorError: If a block is not currently allocated or repeats (nothing is
                freed then).
        """
        if len(set(blocks)) != len(blocks) or not self._used.issuperset(blocks):
            bad = sorted(set(b for b in blocks if b not in self._used or blocks.count(b) > 1))
            raise BlockAllocatorError(
                f"blocks={bad} are not allocated (double free or foreign block); "
                "expected blocks returned by allocate()"
            )
        extra = self._extra_holders
        released = []
        for block in blocks:
            count = extra.get(block, 0)
            if count:
                if count == 1:
                    del extra[block]
                else:
                    extra[block] = count - 1
            else:
                released.append(block)
        self._used.difference_update(released)
        self._free.extend(released)
