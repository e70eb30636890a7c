"""Engine-owned CUDA graphs of hybrid (Mamba) models for decode AND non-decode steps.

A pure-decode step of ``n`` requests replays the decode graph of the smallest batch bucket
``>= n`` (single-step convolution and SSD state-update kernels). Any other step (prefill
chunks, or prefill mixed with decodes) of ``T`` tokens replays the non-decode graph of the
smallest token bucket ``>= T`` (chunked convolution and scan over ``cu_seqlens``): short
prefills then cost one graph launch instead of a few hundred kernel launches.

Every graph reads static buffers: token ids, positions and block-table rows ``[3, bucket]``
(a decode token sampled in the previous step and not yet read back is copied there on the
device); ``cu_seqlens`` and state slots of ``max_batch_size + 1`` sequences; and the rows whose
logits are sampled. Requests fill the first sequences; the padding tokens form one more
sequence on the scratch state slot (reading the scratch KV block), and the unused sequences are
empty, so a graph's launch shape depends on its bucket only and nothing is read on the host.
The logits are computed for the sampled rows only.

Graphs, buffers and the memory pool belong to this object; :meth:`HybridGraphRunner.close`
releases them (the engine calls it at ``close()``).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.cuda_graphs import _capture_stream
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.mamba_state import MambaStateCache
from mcore_models.mamba import MambaStepState

__all__ = ["HybridGraphRunner"]


class HybridGraphRunner:
    """Captures (lazily, per bucket) and replays decode and non-decode steps of a hybrid model.

    Args:
        model: A whole ``HybridModel`` on a CUDA device (first and last pipeline stage).
        cache: The engine's paged KV cache.
        states: The engine's Mamba state slots.
        block_tables: The engine's persistent int32 block table.
        padding_row: Row of ``block_tables`` holding only the scratch block.
        batch_sizes: Decode batch buckets.
        token_counts: Non-decode token buckets (empty: non-decode steps run eagerly).
    """

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        states: MambaStateCache,
        block_tables: torch.Tensor,
        padding_row: int,
        batch_sizes: tuple[int, ...],
        token_counts: tuple[int, ...],
    ) -> None:
        self._model = model
        self._cache = cache
        self._states = states
        self._block_tables = block_tables
        self.batch_sizes = batch_sizes
        self.token_counts = token_counts
        device = block_tables.device
        largest = max(batch_sizes[-1], token_counts[-1] if token_counts else 0)
        self._padding = torch.zeros((3, largest), dtype=torch.long, device=device)
        self._padding[2].fill_(padding_row)
        self._inputs = self._padding.clone()
        self.max_sequences = states.scratch_slot + 1
        """Sequences of every graph: one per request plus the padding sequence."""
        self._cu_seqlens = torch.zeros(self.max_sequences + 1, dtype=torch.int32, device=device)
        self._slots = torch.full(
            (self.max_sequences,), states.scratch_slot, dtype=torch.long, device=device
        )
        self._sample_rows = torch.zeros(self.max_sequences, dtype=torch.long, device=device)
        self._pool: Any = None
        """Memory pool of the graphs, created at the first capture."""
        self._graphs: dict[tuple[bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._enabled = bool(getattr(model, "pre_process", True)) and bool(
            getattr(model, "post_process", True)
        )

    @property
    def captured(self) -> tuple[tuple[str, int], ...]:
        """``("decode" | "mixed", bucket)`` of every graph captured so far."""
        return tuple(sorted(("decode" if d else "mixed", b) for d, b in self._graphs))

    def serves(self, microbatch: Microbatch) -> bool:
        """Whether a graph can run this step.

        Args:
            microbatch: The step.

        Returns:
            True for a decode step within the batch buckets or any other step within the
            token buckets (whole models only).
        """
        if not self._enabled or len(microbatch.entries) >= self.max_sequences:
            return False
        if microbatch.is_decode:
            return microbatch.num_tokens <= self.batch_sizes[-1]
        return bool(self.token_counts) and microbatch.num_tokens <= self.token_counts[-1]

    def _forward(self, decode: bool, bucket: int) -> torch.Tensor:
        inputs = self._inputs[:, :bucket]
        self._cache.prepare_step(self._block_tables, inputs[1], inputs[2])
        if decode:
            cu_seqlens = self._cu_seqlens[: bucket + 1]
            slots = self._slots[:bucket]
        else:
            cu_seqlens, slots = self._cu_seqlens, self._slots
        state = MambaStepState(
            conv_states=self._states.conv_states,
            ssm_states=self._states.ssm_states,
            cu_seqlens=cu_seqlens,
            slot_indices=slots,
            decode=decode,
        )
        hidden = self._model(
            inputs[0][None],
            inputs[1][None],
            kv_cache=self._cache,
            mamba_state=state,
            return_hidden=True,
        )
        rows = self._sample_rows[:bucket] if decode else self._sample_rows
        return self._model.compute_logits(hidden[0].index_select(0, rows))

    def _fill(self, microbatch: Microbatch | None, decode: bool, bucket: int) -> None:
        count = microbatch.num_tokens if microbatch is not None else 0
        if microbatch is not None:
            # Through Microbatch.inputs: rows whose token is a sample of the previous step still
            # on the device (asynchronous readback) take it from there, not the host placeholder.
            self._inputs[:, :count].copy_(microbatch.inputs(self._inputs.device))
        self._inputs[:, count:bucket].copy_(self._padding[:, count:bucket])
        scratch = self._states.scratch_slot
        offsets = [0]
        slots: list[int] = []
        entries = microbatch.entries if microbatch is not None else []
        for request, tokens in entries:
            slot = self._states.allocator.slot_of(request.request_id)
            assert slot is not None
            slots.append(slot)
            offsets.append(offsets[-1] + tokens)
        sequences = bucket if decode else self.max_sequences
        # Padding: one-token sequences (decode) or one sequence of the rest, then empty ones.
        while len(slots) < sequences:
            slots.append(scratch)
            offsets.append(offsets[-1] + 1 if decode else bucket)
        rows = list(microbatch.sample_rows) if microbatch is not None else []
        rows += [0] * (sequences - len(rows))
        host = torch.tensor(offsets, dtype=torch.int32)
        self._cu_seqlens[: sequences + 1].copy_(host, non_blocking=True)
        self._slots[:sequences].copy_(torch.tensor(slots), non_blocking=True)
        self._sample_rows[:sequences].copy_(torch.tensor(rows), non_blocking=True)

    def _capture(self, decode: bool, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on padding only (writes the scratch KV block and scratch state slot).
        self._fill(None, decode, bucket)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = _capture_stream(self._inputs.device)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(decode, bucket)
        torch.cuda.current_stream().wait_stream(stream)
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                logits = self._forward(decode, bucket)
        finally:
            self._cache.clear_step()
        self._graphs[(decode, bucket)] = (graph, logits)
        return graph, logits

    def capture_all(self) -> int:
        """Capture every decode and non-decode bucket's graph now instead of at first use.

        A server calls it at startup (through ``InferenceEngine.capture_graphs``): captured
        lazily, the first step of each new bucket stalls every running request for a capture
        and the compiles of its kernels.

        Returns:
            The number of graphs captured (those captured before are kept; 0 for a pipeline
            stage, which runs eagerly).
        """
        if not self._enabled:
            return 0
        count = 0
        for decode, buckets in ((True, self.batch_sizes), (False, self.token_counts)):
            for bucket in buckets:
                if (decode, bucket) not in self._graphs:
                    self._capture(decode, bucket)
                    count += 1
        return count

    def bucket_of(self, microbatch: Microbatch) -> tuple[bool, int]:
        """The graph a step replays.

        Args:
            microbatch: A step that :meth:`serves` accepts.

        Returns:
            ``(decode, bucket)``: whether it is a decode graph, and its batch or token bucket.
        """
        decode = microbatch.is_decode
        buckets = self.batch_sizes if decode else self.token_counts
        return decode, buckets[bisect.bisect_left(buckets, microbatch.num_tokens)]

    def run_padded_eagerly(self, microbatch: Microbatch) -> torch.Tensor:
        """Run a step through the graph's padded static buffers without capturing or replaying.

        The same computation as :meth:`run` (on any device), for checking the padding against
        unpadded eager steps where no GPU is available.

        Args:
            microbatch: A step that :meth:`serves` accepts.

        Returns:
            float32 logits of its sampling rows.
        """
        decode, bucket = self.bucket_of(microbatch)
        self._fill(microbatch, decode, bucket)
        try:
            logits = self._forward(decode, bucket)
        finally:
            self._cache.clear_step()
        return logits[: len(microbatch.sample_rows)]

    def run(self, microbatch: Microbatch) -> torch.Tensor:
        """Run one step in a graph (see :meth:`serves`).

        Args:
            microbatch: The step.

        Returns:
            float32 logits of its sampling rows ``[len(sample_rows), vocab]`` (a view of the
            graph's output, valid until the next run).
        """
        decode, bucket = self.bucket_of(microbatch)
        entry = self._graphs.get((decode, bucket))
        if entry is None:
            entry = self._capture(decode, bucket)
        graph, logits = entry
        self._fill(microbatch, decode, bucket)
        graph.replay()
        return logits[: len(microbatch.sample_rows)]

    def close(self) -> None:
        """Drop every graph, static buffer and the memory pool."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._pool = None
        self._model = None
        self._cache = None  # type: ignore[assignment]
        self._states = None  # type: ignore[assignment]
        self._block_tables = self._inputs = self._padding = None  # type: ignore[assignment]
        self._cu_seqlens = self._slots = self._sample_rows = None  # type: ignore[assignment]
