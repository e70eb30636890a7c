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

from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_models.moe import set_decode_expert_padding

__all__ = ["DecodeGraphRunner"]

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


class DecodeGraphRunner:
    """Captures (lazily, per bucket) and replays the decode forward of ``model`` over ``cache``.

    A batch of ``n`` decode tokens runs in the graph of the smallest captured bucket ``>= n``.
    While every token's context fits in one attention split (known on the host), a second graph
    per bucket reads only the first split's columns of the block table: its attention is one
    launch without a merge, and its results are the same bits.
    The graph reads one static ``[3, bucket]`` int64 input (token ids, positions, block table
    rows) and derives the cache metadata inside the graph. On a pipeline stage without the
    embedding it also reads a static ``[1, bucket, hidden]`` buffer of the previous stage's
    hidden states, and a stage without the output layer returns hidden states, not logits. Padded rows read token 0 at
    position 0 through the table row ``padding_row``, which must stay all scratch blocks, so
    they write only into the scratch block and never touch a request's cache.

    Args:
        model: A ``GPTModel`` on a CUDA device.
        cache: The engine's paged KV cache.
        block_tables: The engine's persistent int32 block table (fixed address).
        padding_row: Row of ``block_tables`` that holds only the scratch block.
        batch_sizes: Sorted padded batch sizes to capture.
        decoder: The engine's fused forward of the model, or None for the model's own.
    """

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        block_tables: torch.Tensor,
        padding_row: int,
        batch_sizes: tuple[int, ...],
        decoder: FusedDecoder | None = None,
    ) -> None:
        self._model = model
        self._decoder = decoder
        self._cache = cache
        self._block_tables = block_tables
        self.batch_sizes = batch_sizes
        largest = batch_sizes[-1]
        padding = torch.zeros((3, largest), dtype=torch.long, device=block_tables.device)
        padding[2].fill_(padding_row)
        self._padding = padding
        self._inputs = padding.clone()
        self._hidden: torch.Tensor | None = None
        if not getattr(model, "pre_process", True):
            parameter = next(model.parameters())
            self._hidden = torch.zeros(
                (1, largest, model.config.hidden_size),
                dtype=parameter.dtype,
                device=block_tables.device,
            )
        self._last_stage = bool(getattr(model, "post_process", True))
        self._pool: Any = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """``(bucket, block-table width, decode)`` -> graph and its output. ``decode``: the
        graph's steps feed every sequence one token (only separate from the graphs of mixed
        steps where the decoder computes them differently: :meth:`_decode_key`)."""
        self._full_width = block_tables.shape[1]
        self._narrow_width = min(self._full_width, cache.split_size // cache.block_size)
        self._weight_addresses = self._current_weight_addresses()
        self._current: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None
        """The graph and output of the last :meth:`run` (continued by :meth:`run_next`)."""

    def _current_weight_addresses(self) -> tuple[int, ...]:
        tensors = [*self._model.parameters(), *self._model.buffers()]
        return tuple(t.data_ptr() for t in tensors)

    def drop_if_weights_moved(self) -> bool:
        """Drop the captured graphs if a parameter or buffer of the model changed storage.

        Graphs read weights at the addresses seen at capture: in-place updates (optimizer
        steps, ``load_state_dict``) are picked up, but re-allocated weights (offload to the
        CPU and back, ``model.to``) would leave them reading freed memory.

        Returns:
            True if the graphs were dropped (they are recaptured on demand).
        """
        addresses = self._current_weight_addresses()
        if addresses == self._weight_addresses:
            return False
        self._release_graphs()
        self._pool = torch.cuda.graph_pool_handle()
        self._weight_addresses = addresses
        return True

    @property
    def max_batch_size(self) -> int:
        """Largest batch a graph serves."""
        return self.batch_sizes[-1]

    @property
    def captured(self) -> tuple[int, ...]:
        """Batch sizes captured so far."""
        return tuple(sorted({batch for batch, _, _ in self._graphs}))

    def _decode_key(self, batch: int, decode: bool) -> bool:
        """Whether a step of ``batch`` tokens takes a graph of its own when it is a decode step:
        only where the fused decoder runs such steps differently
        (``FusedDecoder.one_token_per_sequence_matters``)."""
        decoder = self._decoder
        return decode and decoder is not None and decoder.one_token_per_sequence_matters(batch)

    def _forward(self, batch: int, width: int, decode: bool = False) -> torch.Tensor:
        inputs = self._inputs[:, :batch]
        self._cache.prepare_step(
            self._block_tables[:, :width], inputs[1], inputs[2], one_token_per_sequence=decode
        )
        stage_input = inputs[0][None] if self._hidden is None else self._hidden[:, :batch]
        if self._decoder is not None and self._last_stage:
            return self._decoder.logits(stage_input, inputs[1][None], kv_cache=self._cache)
        if self._decoder is not None:
            hidden = self._decoder(stage_input, inputs[1][None], kv_cache=self._cache)
        else:
            hidden = self._model(
                stage_input, inputs[1][None], kv_cache=self._cache, return_hidden=True
            )
        if not self._last_stage:
            return hidden[0]
        if self._decoder is not None:
            return self._decoder.compute_logits(hidden[0])
        return self._model.compute_logits(hidden[0])

    def _capture(
        self, batch: int, width: int, decode: bool = False
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up outside the graph (lazy initialisation and Triton compilation must not be
        # recorded); padded inputs make the warm-up write only into the scratch block.
        self._inputs.copy_(self._padding)
        # NOTE: one side stream for every warm-up and capture: each new stream would get its
        # own cuBLAS workspace, which the allocator keeps for the life of the process.
        stream = _capture_stream(self._inputs.device)
        graph = torch.cuda.CUDAGraph()
        # MoE layers route with fixed-shape drop-and-pad while their kernels are recorded
        # (dropless routing sizes buffers on the host); the layers' previous mode is restored.
        with set_decode_expert_padding(self._model, True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch, width, decode)
            torch.cuda.current_stream().wait_stream(stream)
            try:
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    logits = self._forward(batch, width, decode)
            finally:
                self._cache.clear_step()
        self._graphs[batch, width, decode] = (graph, logits)
        return graph, logits

    def run(
        self,
        inputs: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        max_context: int | None = None,
        decode: bool = False,
    ) -> torch.Tensor:
        """Run one decode step of ``n <= max_batch_size`` tokens through a graph.

        Args:
            inputs: int64 ``[3, n]``: token ids, positions and block table rows.
            hidden: ``[1, m, hidden]`` states from the previous stage (``m <= n``; the rest
                are padding rows), on a stage without the embedding.
            max_context: The step's largest position + 1 when known on the host: within one
                attention split, the graph of the narrow block table runs.
            decode: Every sequence feeds one token (padding rows aside): a step that
                prefills passes False (see :meth:`_decode_key`).

        Returns:
            logits ``[n, vocab]`` (float32, or in the model's dtype with the fused decoder: see
            ``FusedDecoder.compute_logits``), or the stage's output hidden states ``[n, hidden]``
            on a stage without the output layer (a view of the graph's output, valid until the
            next run).
        """
        count = inputs.shape[1]
        bucket = self.batch_sizes[bisect.bisect_left(self.batch_sizes, count)]
        width = self._full_width
        if max_context is not None and max_context <= self._narrow_width * self._cache.block_size:
            width = self._narrow_width
        key = self._decode_key(bucket, decode)
        entry = self._graphs.get((bucket, width, key))
        if entry is None:
            entry = self._capture(bucket, width, key)
        graph, logits = entry
        self._inputs[:, :count].copy_(inputs)
        if count < bucket:
            self._inputs[:, count:bucket].copy_(self._padding[:, count:bucket])
        if self._hidden is not None:
            received = 0
            if hidden is not None:
                received = hidden.shape[1]
                self._hidden[:, :received].copy_(hidden)
            self._hidden[:, received:bucket].zero_()
        graph.replay()
        self._current = entry
        return logits[:count]

    def next_inputs(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's token and position rows of the first ``count`` rows, for a sampler that
        feeds the next step itself (see :meth:`run_next`'s ``fed``).

        Args:
            count: Real rows of the run.

        Returns:
            int64 ``[count]`` views: the tokens, then the positions.
        """
        return self._inputs[0, :count], self._inputs[1, :count]

    def run_next(self, tokens: torch.Tensor, *, fed: bool = False) -> torch.Tensor:
        """Run the next decode step of the batch of the last :meth:`run`, in the same graph.

        Multi-step decode (:mod:`mcore_inference.multi_step`): every real row is fed ``tokens``
        one position further than in the previous step, in the same block-table row; the
        padding rows are unchanged. No host value is uploaded. The caller keeps every row's
        position within the graph's table width (the ``max_context`` of the first step covers
        the whole run).

        Args:
            tokens: int64 ``[n]`` tokens of the ``n`` real rows (the previous step's samples).
            fed: The sampler already wrote ``tokens`` into :meth:`next_inputs` and advanced
                the positions (``SamplingPlan.sample``'s ``feed``): no copies here.

        Returns:
            The graph's output for the real rows, as :meth:`run` returns it.
        """
        entry = self._current
        assert entry is not None, "run_next needs a run() before it"
        count = tokens.shape[0]
        if not fed:
            self._inputs[0, :count].copy_(tokens)
            self._inputs[1, :count].add_(1)
        graph, logits = entry
        graph.replay()
        return logits[:count]

    def capture_all(self, *, mixed_steps: bool = False) -> int:
        """Capture every bucket's graphs now (both block-table widths) instead of at first use.

        A server calls it at startup: captured lazily, the first step of each new batch size
        (or the first past one attention split) stalls every running request for a capture.

        Args:
            mixed_steps: Steps that prefill replay these graphs too
                (``InferenceConfig.cuda_graph_mixed_steps``): also capture the graphs of such
                steps at the buckets where decode steps take graphs of their own
                (:meth:`_decode_key`), so that no prefill captures one while requests wait.

        Returns:
            The number of graphs captured (those captured before are kept).
        """
        count = 0
        for bucket in self.batch_sizes:
            keys = {self._decode_key(bucket, True)}
            if mixed_steps:
                keys.add(self._decode_key(bucket, False))
            for key in sorted(keys, reverse=True):
                for width in sorted({self._narrow_width, self._full_width}):
                    if (bucket, width, key) not in self._graphs:
                        self._capture(bucket, width, key)
                        count += 1
        return count

    def _release_graphs(self) -> None:
        self._current = None
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def close(self) -> None:
        """Drop every graph, static buffer and the memory pool."""
        self._release_graphs()
        self._pool = None
        self._model = None
        self._decoder = None
        self._cache = None  # type: ignore[assignment]
        self._block_tables = self._inputs = self._padding = None  # type: ignore[assignment]
        self._hidden = None
