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
from mcore_inference.sample_step import (
    SampleBuffers,
    SamplingPlan,
    sample_microbatch,
)
from mcore_inference.transfer import to_device
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
                output = graphs.run(inputs, received, max_context=narrow, decode=decode)[:num_real]
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
                self._drop_graphs(graphs, exc)
        return self._eager(microbatch, inputs, num_real, max_context, received)

    def _drop_graphs(self, graphs: Any, exc: Exception) -> None:
        """Decode eagerly from now on after a graph failed (a model that cannot be captured
        still serves); the warning says why."""
        warnings.warn(
            f"CUDA graph decode failed ({type(exc).__name__}: {exc}); the engine "
            "decodes eagerly from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        graphs.close()
        self.graphs = None

    def run_steps(
        self,
        microbatch: Microbatch,
        plan: SamplingPlan,
        samples: torch.Tensor,
        *,
        logits_dtype: torch.dtype | None = None,
    ) -> None:
        """Run a multi-step decode microbatch: ``microbatch.steps`` steps, sampled on the device.

        One stage, no expert-parallel lockstep (see :mod:`mcore_inference.multi_step`). The
        first step runs as :meth:`run` would; each further step feeds every row the token the
        step before sampled, one position further, without host values: the decode graph of
        the batch again (its table width chosen for the run's last position), or the eager
        forward.

        Args:
            microbatch: A pure decode microbatch whose rows all sample.
            plan: The sampling plan of its steps.
            samples: float64 ``[steps, 2, n]`` receiving each step's tokens and log-probs.
            logits_dtype: The dtype the model computed the logits in.
        """
        with torch.no_grad(), fused_tp_communication(self.model, self.fuse_tp_communication):
            steps = microbatch.steps
            inputs, num_real, max_context = self._inputs(microbatch, microbatch.num_tokens)
            graphs = self.graphs
            logits: torch.Tensor | None = None
            if graphs is not None and num_real <= graphs.max_batch_size:
                try:
                    logits = graphs.run(inputs, max_context=max_context + steps - 1, decode=True)[
                        :num_real
                    ]
                except Exception as exc:
                    self._drop_graphs(graphs, exc)
                    graphs = None
            if logits is not None and graphs is not None:
                for step in range(steps):
                    # Every step but the last writes the next one's tokens and positions.
                    feed = graphs.next_inputs(num_real) if step + 1 < steps else None
                    tokens = plan.sample(
                        logits, samples[step], step, logits_dtype=logits_dtype, feed=feed
                    )
                    if feed is not None:
                        logits = graphs.run_next(tokens, fed=True)[:num_real]
                return
            for step in range(steps):
                if step:
                    inputs[0, :num_real].copy_(tokens)
                    inputs[1, :num_real].add_(1)
                _, logits = self._eager(microbatch, inputs, num_real, max_context + step, None)
                assert logits is not None
                tokens = plan.sample(logits, samples[step], step, logits_dtype=logits_dtype)

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
        self.kv_cache.prepare_step(
            self.block_tables,
            inputs[1],
            inputs[2],
            max_context=max_context,
            one_token_per_sequence=microbatch is not None and microbatch.is_decode,
        )
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
