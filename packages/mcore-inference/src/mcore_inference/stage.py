"""One rank's share of an engine step: its pipeline stage's forward and, on the last stage, sampling."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.cuda_graphs import DecodeGraphRunner
from mcore_inference.describe import fused_tp_communication
from mcore_inference.distributed import EngineGroups
from mcore_inference.expert_parallel import ExpertParallelSync
from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.mamba_graphs import HybridGraphRunner
from mcore_inference.mamba_state import MambaStateCache
from mcore_inference.sampling import sample_tokens, sampling_uniform
from mcore_inference.transfer import to_device
from mcore_kernels import token_logprobs
from mcore_models.mamba import MambaStepState

__all__ = ["SampleBuffers", "StageRunner", "sample_microbatch"]


class StageRunner:
    """Runs a microbatch through this rank's part of the model (eagerly or in a decode graph).

    Args:
        model: The model or this rank's pipeline stage.
        kv_cache: The engine's paged cache (this rank's heads and layers).
        block_tables: The scheduler's block table.
        padding_row: Block-table row holding only the scratch block.
        groups: The engine's process groups.
        lockstep: Per-step agreement with expert-parallel peers, or None.
        graphs: Decode CUDA graphs, or None.
        fuse_tp_communication: Hold the model's fused TP reduction on during each step.
        decoder: The engine's fused forward of the model, or None for the model's own.
    """

    def __init__(
        self,
        model: Any,
        kv_cache: PagedKVCache,
        block_tables: torch.Tensor,
        padding_row: int,
        groups: EngineGroups,
        lockstep: ExpertParallelSync | None,
        graphs: DecodeGraphRunner | None,
        fuse_tp_communication: bool = False,
        decoder: FusedDecoder | None = None,
    ) -> None:
        self.model = model
        self.decoder = decoder
        self.fuse_tp_communication = fuse_tp_communication
        self.kv_cache = kv_cache
        self.block_tables = block_tables
        self.padding_row = padding_row
        self.groups = groups
        self.lockstep = lockstep
        self.graphs = graphs
        parameter = next(model.parameters())
        self.device = parameter.device
        self.hidden_dtype = parameter.dtype
        self.hidden_size: int = model.config.hidden_size
        self.mamba_states: MambaStateCache | None = None
        """State slots of a hybrid model's Mamba layers (set by the engine), else None."""
        self.hybrid_graphs: HybridGraphRunner | None = None
        """Decode and non-decode CUDA graphs of a hybrid model (set by the engine)."""
        self.graph_mixed_steps = False
        """Run steps that prefill in the decode graphs too, when their tokens fit a bucket (set
        by the engine from ``InferenceConfig.cuda_graph_mixed_steps``)."""

    def _inputs(self, microbatch: Microbatch | None, pad_to: int) -> tuple[torch.Tensor, int, int]:
        num_real = microbatch.num_tokens if microbatch is not None else 0
        if microbatch is not None and pad_to <= num_real:
            rows = microbatch  # nothing to append: its lists are only read
        else:
            rows = Microbatch(entries=[])
            if microbatch is not None:
                rows.tokens = list(microbatch.tokens)
                rows.positions = list(microbatch.positions)
                rows.table_rows = list(microbatch.table_rows)
                rows.deferred_rows = microbatch.deferred_rows
                rows.deferred_columns = microbatch.deferred_columns
                rows.token_source = microbatch.token_source
            rows.pad(pad_to - num_real, self.padding_row)
        # Known on the host: the eager attention launches only the splits that can hold data.
        return rows.inputs(self.device), num_real, max(rows.positions) + 1

    def run(
        self, microbatch: Microbatch | None, received: torch.Tensor | None, *, has_work: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run this stage's microbatch (collective with expert-parallel peers).

        Args:
            microbatch: The microbatch at this stage in this step, or None.
            received: Its hidden states from the previous stage (not on the first stage).
            has_work: Whether this rank has work beyond this step (for the EP agreement).

        Returns:
            ``(output, logits)``: the hidden states for the next stage (a non-last stage with
            tokens) and the logits of the sampling rows (the last stage; float32, or in the
            model's dtype with the fused decoder), each or None.
        """
        with torch.no_grad(), fused_tp_communication(self.model, self.fuse_tp_communication):
            return self._run(microbatch, received, has_work)

    def _run(
        self, microbatch: Microbatch | None, received: torch.Tensor | None, has_work: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.mamba_states is not None:
            return self._run_hybrid(microbatch, received)
        num_real = microbatch.num_tokens if microbatch is not None else 0
        graphs = self.graphs
        decode = microbatch is None or num_real == 0 or microbatch.is_decode
        use_graphs = (
            graphs is not None
            and (decode or self.graph_mixed_steps)
            and num_real <= graphs.max_batch_size
        )
        pad_to = num_real
        if self.lockstep is not None:
            agreement = self.lockstep.agree(
                num_real,
                graphs.batch_sizes if use_graphs and graphs is not None else None,
                has_work=has_work,
            )
            if agreement.max_tokens == 0:
                return None, None
            use_graphs = agreement.use_graphs
            if use_graphs or self.lockstep.needs_equal_tokens:
                pad_to = agreement.max_tokens
            else:
                pad_to = max(num_real, 1)
        if pad_to == 0:
            return None, None
        inputs, num_real, max_context = self._inputs(microbatch, pad_to)
        sampling = microbatch is not None and bool(microbatch.sampling)
        if use_graphs and graphs is not None:
            try:
                # Expert-parallel peers keep one graph per bucket (their contexts differ).
                narrow = max_context if self.lockstep is None else None
                output = graphs.run(inputs, received, max_context=narrow)[:num_real]
                if not self.groups.is_last_stage:
                    return (output[None] if num_real else None), None
                if not sampling:
                    return None, None
                assert microbatch is not None
                if len(microbatch.sample_rows) != num_real:
                    # Rows of prompt tokens that sample nothing (a step that prefills, also one
                    # whose prompt chunks are single tokens): only the sampling rows.
                    rows = to_device(microbatch.sample_rows, torch.long, self.device)
                    output = output.index_select(0, rows)
                return None, output
            except Exception as exc:
                # A model that cannot be captured still serves, eagerly; the warning says why.
                warnings.warn(
                    f"CUDA graph decode failed ({type(exc).__name__}: {exc}); the engine "
                    "decodes eagerly from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
                graphs.close()
                self.graphs = None
        return self._eager(microbatch, inputs, num_real, max_context, received)

    def _run_hybrid(
        self, microbatch: Microbatch | None, received: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A hybrid (Mamba) model's step: in a decode or non-decode graph when one fits."""
        assert self.mamba_states is not None
        if microbatch is None or microbatch.num_tokens == 0:
            return None, None
        graphs = self.hybrid_graphs
        if graphs is not None and graphs.serves(microbatch):
            try:
                logits = graphs.run(microbatch)
                return None, logits if microbatch.sampling else None
            except Exception as exc:
                warnings.warn(
                    f"CUDA graph step failed ({type(exc).__name__}: {exc}); the engine runs "
                    "hybrid steps eagerly from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
                graphs.close()
                self.hybrid_graphs = None
        inputs, num_real, max_context = self._inputs(microbatch, microbatch.num_tokens)
        state = self.mamba_states.step_state(
            [(request.request_id, count) for request, count in microbatch.entries],
            decode=microbatch.is_decode,
        )
        return self._eager(microbatch, inputs, num_real, max_context, received, mamba_state=state)

    def _eager(
        self,
        microbatch: Microbatch | None,
        inputs: torch.Tensor,
        num_real: int,
        max_context: int,
        received: torch.Tensor | None,
        *,
        mamba_state: MambaStepState | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        groups = self.groups
        if groups.is_first_stage:
            stage_input = inputs[0][None]
        else:
            total = inputs.shape[1]
            hidden = (
                received
                if received is not None
                else torch.empty((1, 0, self.hidden_size), dtype=self.hidden_dtype)
            )
            if total > hidden.shape[1]:
                padding = torch.zeros(
                    (1, total - hidden.shape[1], self.hidden_size),
                    dtype=self.hidden_dtype,
                    device=self.device,
                )
                hidden = torch.cat([hidden.to(self.device), padding], dim=1)
            stage_input = hidden
        self.kv_cache.prepare_step(self.block_tables, inputs[1], inputs[2], max_context=max_context)
        sampling = groups.is_last_stage and microbatch is not None and microbatch.sampling
        if sampling and self.decoder is not None and mamba_state is None:
            # The forward and the LM head in one call, as the decode graphs run them.
            assert microbatch is not None
            rows = to_device(microbatch.sample_rows, torch.long, self.device)
            try:
                return None, self.decoder.logits(
                    stage_input, inputs[1][None], kv_cache=self.kv_cache, rows=rows
                )
            finally:
                self.kv_cache.clear_step()
        try:
            if self.decoder is not None and mamba_state is None:
                output = self.decoder(stage_input, inputs[1][None], kv_cache=self.kv_cache)
            else:
                extra = {"mamba_state": mamba_state} if mamba_state is not None else {}
                output = self.model(
                    stage_input,
                    inputs[1][None],
                    kv_cache=self.kv_cache,
                    return_hidden=True,
                    **extra,
                )
        finally:
            self.kv_cache.clear_step()
        if not groups.is_last_stage:
            return (output[:, :num_real] if num_real else None), None
        if microbatch is None or not microbatch.sampling:
            return None, None
        rows = to_device(microbatch.sample_rows, torch.long, self.device)
        sampled = output[0].index_select(0, rows)
        if self.decoder is not None and mamba_state is None:
            return None, self.decoder.compute_logits(sampled)
        return None, self.model.compute_logits(sampled)

    def close(self) -> None:
        """Drop the references to the model, cache and graphs."""
        self.graphs = None
        self.decoder = None
        if self.hybrid_graphs is not None:
            self.hybrid_graphs.close()
            self.hybrid_graphs = None
        self.mamba_states = None
        self.model = self.kv_cache = self.block_tables = None  # type: ignore[assignment]


class SampleBuffers:
    """Reused device buffers for the float64 ``[2, n]`` samples of consecutive steps.

    A step's samples are read by the copy to the host (in the same step) and by the next step,
    which feeds them to the model; every use is ordered on the one stream, so a buffer is free
    again two steps later. Reusing them saves an allocation and a fill per step: the
    log-probability row is refilled with NaN only when the buffer's last use had another width
    or wrote log-probs into it. Each view is contiguous (collectives broadcast it as is).

    Args:
        device: The engine's device.
        count: Buffers in turn (at least 3).
    """

    def __init__(self, device: torch.device, count: int = 3) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._clean_width: list[int] = []
        """Per buffer, the width whose second row holds NaN (-1: none known)."""
        self._count = max(3, count)
        self._next = 0

    def take(self, columns: int) -> tuple[torch.Tensor, bool]:
        """The next buffer, as a contiguous ``[2, columns]`` view.

        Args:
            columns: Sampled rows of the step.

        Returns:
            ``(samples, clean)``: the view, and whether its second row already holds NaN.
        """
        index = self._next
        self._next = (index + 1) % self._count
        capacity = self._buffers[0].numel() // 2 if self._buffers else 0
        if capacity < columns:
            # All buffers at once, of one size: the engine's memory does not change again
            # until a wider step comes.
            size = 2 * max(columns, 64)
            self._buffers = [
                torch.empty(size, dtype=torch.float64, device=self.device)
                for _ in range(self._count)
            ]
            self._clean_width = [-1] * self._count
        view = self._buffers[index][: 2 * columns].view(2, columns)
        return view, self._clean_width[index] == columns

    def mark(self, samples: torch.Tensor, clean: bool) -> None:
        """Record whether the second row of ``samples`` (a view from :meth:`take`) is NaN.

        Args:
            samples: A view returned by :meth:`take`.
            clean: Whether its second row holds NaN in every column.
        """
        for index, buffer in enumerate(self._buffers):
            if buffer.data_ptr() == samples.data_ptr():
                self._clean_width[index] = samples.shape[1] if clean else -1


def sample_microbatch(
    logits: torch.Tensor,
    microbatch: Microbatch,
    *,
    logits_dtype: torch.dtype | None = None,
    buffers: SampleBuffers | None = None,
) -> torch.Tensor:
    """Sample the next token of every sampling request of a microbatch.

    Args:
        logits: ``[n, vocab]`` logits of the sampling rows (float32, or already in
            ``logits_dtype``).
        microbatch: The microbatch (its ``sampling`` requests, in row order).
        logits_dtype: The dtype the model computed the logits in before the float32 upcast
            (its parameter dtype); the log-probs are computed from the logits in that dtype, as
            a training forward's ``token_logprobs`` reads them (see :func:`_row_logprobs`).
        buffers: Reused buffers for the result (None: a new tensor).

    Returns:
        float64 ``[2, n]``: token ids and their log-probabilities (NaN where not asked), in a
        form one broadcast carries to the other ranks.
    """
    requests = microbatch.sampling
    params = [r.params for r in requests]
    # The index of the token being sampled is the number of tokens fed after the prompt: also
    # right for a request whose previous token is still deferred (not in ``output`` yet).
    uniforms = [0.0] * len(requests)
    logprob_rows = []
    for i, p in enumerate(params):
        if p.temperature:
            r = requests[i]
            uniforms[i] = sampling_uniform(r.seed, r.num_computed - len(r.prompt))
        if p.return_logprobs:
            logprob_rows.append(i)
    new_tokens = sample_tokens(logits, params, uniforms)
    if buffers is None:
        samples = torch.full(
            (2, len(requests)), float("nan"), dtype=torch.float64, device=logits.device
        )
    else:
        samples, clean = buffers.take(len(requests))
        if not clean and len(logprob_rows) < len(params):
            samples[1].fill_(float("nan"))
        buffers.mark(samples, not logprob_rows)
    samples[0].copy_(new_tokens)
    if logprob_rows:
        # Every row (the common case) needs no gather and no scatter.
        every = len(logprob_rows) == len(params)
        index = None if every else to_device(logprob_rows, torch.long, logits.device)
        row_logits = logits if index is None else logits.index_select(0, index)
        row_tokens = new_tokens if index is None else new_tokens.index_select(0, index)
        # logprobs of the sampling distribution at the request's temperature (greedy: 1).
        temperatures = [params[i].temperature or 1.0 for i in logprob_rows]
        values = _row_logprobs(row_logits, row_tokens, temperatures, logits_dtype)
        if index is None:
            samples[1].copy_(values)
        else:
            samples[1].index_copy_(0, index, values.to(torch.float64))
    return samples


def _row_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: list[float],
    logits_dtype: torch.dtype | None,
) -> torch.Tensor:
    """float32 ``log_softmax(logits / t)[token]`` of every row, bitwise as a training forward.

    The trainer calls ``token_logprobs(logits, targets, temperature=t)`` on the logits in the
    model's dtype; so does this, one call per distinct temperature, on the float32 logits cast
    back to ``logits_dtype`` (exact: they were upcast from it). Feeding the same values in
    float32 instead would not do: the kernel's vector loads, and with them the order in which
    a row's exponentials are summed, follow the element size (8 bf16 or 4 float32 per thread),
    a one-ulp difference in the log-prob for a large vocabulary.
    """
    if logits_dtype is not None and logits_dtype != logits.dtype:
        logits = logits.to(logits_dtype)
    distinct = sorted(set(temperatures))
    if len(distinct) == 1:
        values = token_logprobs(logits, tokens, temperature=distinct[0])
        assert isinstance(values, torch.Tensor)
        return values
    values = torch.empty(tokens.shape[0], dtype=torch.float32, device=logits.device)
    for temperature in distinct:
        rows = [i for i, t in enumerate(temperatures) if t == temperature]
        index = to_device(rows, torch.long, logits.device)
        part = token_logprobs(
            logits.index_select(0, index), tokens.index_select(0, index), temperature=temperature
        )
        assert isinstance(part, torch.Tensor)
        values.index_copy_(0, index, part)
    return values
