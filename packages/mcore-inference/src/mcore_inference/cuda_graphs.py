"""Engine-owned CUDA graphs of pure-decode steps, one per padded batch size.

The graphs, their static input buffers and their memory pool belong to this object, which the
engine owns; nothing is attached to the model's module tree, so the model is the same object
with the same modules whether graphs exist or not. :meth:`DecodeGraphRunner.close` drops every
graph, buffer and the pool, so their memory returns to the allocator.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from mcore_inference.block_allocator import SCRATCH_BLOCK
from mcore_inference.kv_cache import PagedKVCache

__all__ = ["DecodeGraphRunner"]

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


class DecodeGraphRunner:
    """Captures (lazily, per bucket) and replays the decode forward of ``model`` over ``cache``.

    A batch of ``n`` decode tokens runs in the graph of the smallest captured bucket ``>= n``;
    the padded rows read token 0 at position 0 and write their key/value into the scratch
    block, so they never touch a request's cache.

    Args:
        model: A ``GPTModel`` on a CUDA device.
        cache: The engine's paged KV cache.
        batch_sizes: Sorted padded batch sizes to capture.
        max_blocks_per_sequence: Width of the block table rows.
    """

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        batch_sizes: tuple[int, ...],
        max_blocks_per_sequence: int,
    ) -> None:
        self._model = model
        self._cache = cache
        self.batch_sizes = batch_sizes
        device = cache.keys.device
        largest = batch_sizes[-1]
        self._input_ids = torch.zeros((1, largest), dtype=torch.long, device=device)
        self._position_ids = torch.zeros((1, largest), dtype=torch.long, device=device)
        self._slot_mapping = torch.zeros(largest, dtype=torch.long, device=device)
        self._block_tables = torch.zeros(
            (largest, max_blocks_per_sequence), dtype=torch.int32, device=device
        )
        self._context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._pool: Any = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        """Largest batch a graph serves."""
        return self.batch_sizes[-1]

    @property
    def captured(self) -> tuple[int, ...]:
        """Batch sizes captured so far."""
        return tuple(sorted(self._graphs))

    def _pad_inputs(self) -> None:
        self._input_ids.zero_()
        self._position_ids.zero_()
        self._slot_mapping.fill_(SCRATCH_BLOCK * self._cache.block_size)
        self._block_tables.fill_(SCRATCH_BLOCK)
        self._context_lens.fill_(1)

    def _forward(self, batch: int) -> torch.Tensor:
        self._cache.set_step(
            self._slot_mapping[:batch], self._block_tables[:batch], self._context_lens[:batch]
        )
        hidden = self._model(
            self._input_ids[:, :batch],
            self._position_ids[:, :batch],
            kv_cache=self._cache,
            return_hidden=True,
        )
        return self._model.compute_logits(hidden[0])

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (lazy initialisation and Triton compilation must not be
        # recorded); padded inputs make the warm-up write only into the scratch block.
        self._pad_inputs()
        # NOTE: one side stream for every warm-up and capture: each new stream would get its
        # own cuBLAS workspace, which the allocator keeps for the life of the process.
        stream = _capture_stream(self._input_ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            logits = self._forward(batch)
        self._cache.clear_step()
        self._graphs[batch] = (graph, logits)
        return graph, logits

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Run one decode step of ``n <= max_batch_size`` tokens through a graph.

        Args:
            input_ids: int64 ``[n]`` token of each request.
            position_ids: int64 ``[n]`` position of each token.
            slot_mapping: int64 ``[n]`` cache slot of each token.
            block_tables: int32 ``[n, max_blocks]`` block table of each token's request.
            context_lens: int32 ``[n]`` context length of each token.

        Returns:
            float32 logits ``[n, vocab]`` (a view of the graph's output, valid until the next
            run).
        """
        count = input_ids.shape[0]
        bucket = self.batch_sizes[bisect.bisect_left(self.batch_sizes, count)]
        entry = self._graphs.get(bucket)
        if entry is None:
            entry = self._capture(bucket)
        graph, logits = entry
        self._input_ids[0, :count].copy_(input_ids)
        self._position_ids[0, :count].copy_(position_ids)
        self._slot_mapping[:count].copy_(slot_mapping)
        self._block_tables[:count].copy_(block_tables)
        self._context_lens[:count].copy_(context_lens)
        if count < bucket:
            self._input_ids[0, count:bucket].zero_()
            self._position_ids[0, count:bucket].zero_()
            self._slot_mapping[count:bucket].fill_(SCRATCH_BLOCK * self._cache.block_size)
            self._block_tables[count:bucket].fill_(SCRATCH_BLOCK)
            self._context_lens[count:bucket].fill_(1)
        graph.replay()
        return logits[:count]

    def close(self) -> None:
        """Drop every graph, static buffer and the memory pool."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._pool = None
        self._model = None
        self._cache = None  # type: ignore[assignment]
        del self._input_ids, self._position_ids, self._slot_mapping
        del self._block_tables, self._context_lens
