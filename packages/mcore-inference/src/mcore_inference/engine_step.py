"""One engine step: batch building, the stage forward (graph or eager), sampling, hand-off.

Each step admits waiting requests, lets the scheduler pick the step's tokens, flattens them
into one :class:`~mcore_inference.batch.Microbatch`, runs it through this rank's stage with
:class:`~mcore_inference.stage.StageRunner` (a captured decode CUDA graph when one fits, else
the eager forward), samples on the last stage, exchanges hidden states between pipeline
stages, and applies the tokens of the microbatch leaving the pipeline (at once, or one step
late with the asynchronous readback).
"""

from __future__ import annotations

from typing import Any

from mcore_inference.batch import build_microbatch
from mcore_inference.config import InferenceConfig
from mcore_inference.cuda_graphs import DecodeGraphRunner
from mcore_inference.distributed import EngineGroups
from mcore_inference.engine_results import _ResultBook
from mcore_inference.errors import UnsupportedModelError
from mcore_inference.expert_parallel import (
    ExpertParallelSync,
    find_expert_parallel_group,
    find_expert_tensor_parallel_group,
)
from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.mamba_graphs import HybridGraphRunner
from mcore_inference.mamba_state import MambaStateCache
from mcore_inference.multi_step import plan_run, run_length
from mcore_inference.request import FinishReason, Request, RequestStatus
from mcore_inference.scheduler import Scheduler
from mcore_inference.stage import SampleBuffers, StageRunner, sample_microbatch
from mcore_kernels.batch_invariant import batch_invariant_mode

__all__ = ["build_stage_runner"]


class _StepLoop(_ResultBook):
    """The step loop (a base of ``InferenceEngine``)."""

    _sample_buffers: SampleBuffers | None = None
    """Reused device buffers of the sampled tokens (created at the first sampling step)."""

    @property
    def _graphs(self) -> DecodeGraphRunner | None:
        return self._runner.graphs if self._runner is not None else None

    def _pipeline_busy(self) -> bool:
        deferred = self._deferred
        # Deferred tokens of requests that all ended (aborted) are work for nobody.
        if deferred is not None and any(
            request.status == RequestStatus.ACTIVE for request in deferred.microbatch.sampling
        ):
            return True
        return any(microbatch is not None for microbatch in self._pipeline)

    def _revalidate_graphs(self, *, per_step: bool = False) -> None:
        # Once per public call, not per step: weights cannot move while the engine runs.
        if self._decoder is not None:
            # A generate/stream call copies the fused weights outright (one pass over them;
            # broadcasts and `.data` writes do not bump version counters); a single step, which
            # a serving loop calls per token, copies only after a counted change.
            if per_step:
                self._decoder.refresh()
            else:
                self._decoder.refresh_now()
        graphs = self._graphs
        if graphs is not None:
            graphs.drop_if_weights_moved()

    def _step(self, *, progress: bool) -> list[Request]:
        """One step; returns the finished requests, plus the ones that got a token if ``progress``.

        Every stage runs the microbatch at its position in ``self._pipeline`` (index = stage),
        sends its output to the next stage while receiving its next input, and the microbatch
        at the last stage leaves with its sampled tokens.
        """
        reports, self._unreported = self._unreported, []
        assert self.scheduler is not None and self._runner is not None
        groups = self.groups
        pp = groups.pp_size
        if self._deferred is not None and self._deferred.ends_by_length:
            # Read now the tokens that end requests by length, so their blocks are free for
            # this step's admission exactly as in the synchronous engine (same batches).
            self._complete_deferred(reports, progress=progress)
        self.scheduler.admit()
        # A pipeline splits the decoding requests into one group per stage.
        max_decode = None if pp == 1 else -(-len(self.scheduler.active) // pp)
        batch = self.scheduler.schedule(max_decode)
        microbatch = build_microbatch(batch) if batch else None
        if microbatch is not None and microbatch.deferred_rows:
            assert self._deferred is not None
            microbatch.token_source = self._deferred.samples
        plan = None
        if microbatch is not None and self._multi_step > 1:
            steps = run_length(microbatch, self._multi_step)
            if steps > 1:
                plan = plan_run(microbatch, steps, self.device)
        self._pipeline.appendleft(microbatch)
        mine = self._pipeline[groups.pp_rank] if groups.pp_rank < len(self._pipeline) else None
        received, self._stage_input = self._stage_input, None
        has_work = bool(self.scheduler.waiting or self.scheduler.active or self._pipeline_busy())
        if mine is None and self._ep is None and pp == 1:
            self._pipeline.pop()
            self._complete_deferred(reports, progress=progress)
            return reports + self._take_unreported()
        samples = None
        try:
            with batch_invariant_mode(self.config.batch_invariant):
                if plan is not None and mine is not None:
                    # A multi-step run (one stage): every step sampled on the device.
                    output, logits = None, None
                    samples = self._run_buffers.take(
                        mine.steps, len(mine.sampling), nan_logprobs=not plan.every_logprob
                    )
                    self._runner.run_steps(
                        mine, plan, samples, logits_dtype=self._runner.hidden_dtype
                    )
                else:
                    output, logits = self._runner.run(mine, received, has_work=has_work)
        except Exception as exc:  # a failed step fails its requests, never the engine
            self._complete_deferred(reports, progress=progress)
            if mine is None or groups.replica_size > 1 or self._ep is not None:
                # Peers are inside collectives of this step: no recovery without them.
                self._unreported = reports + self._unreported
                raise
            self._pipeline.pop()
            message = f"step failed: {type(exc).__name__}: {exc}"
            for request, _ in mine.entries:
                request.in_flight -= 1
                request.awaiting_token = False
                request.unread = 0
                if request.status == RequestStatus.ACTIVE:
                    self._finish(request, FinishReason.ERROR, error=message)
            if self.kv_cache is not None:
                self.kv_cache.clear_step()
            return reports + self._take_unreported()
        if logits is not None and mine is not None and self._decides_samples():
            if self._sample_buffers is None:
                self._sample_buffers = SampleBuffers(self.device)
            samples = sample_microbatch(
                logits,
                mine,
                logits_dtype=getattr(self._runner, "hidden_dtype", None),
                buffers=self._sample_buffers,
            )
        if pp > 1:
            # The microbatch that moves into this stage at the next step.
            ahead = groups.pp_rank - 1
            following = self._pipeline[ahead] if 0 <= ahead < len(self._pipeline) else None
            expects = following is not None and following.num_tokens > 0
            runner = self._runner
            self._stage_input = groups.exchange_stages(
                output if not groups.is_last_stage and mine is not None else None,
                (1, following.num_tokens, runner.hidden_size)
                if expects and following is not None
                else None,
                runner.hidden_dtype,
            )
        if len(self._pipeline) == pp:
            leaving = self._pipeline.pop()
            if self._readback is not None and leaving is not None and leaving.sampling:
                # Copy this step's tokens to the host in the background; read the previous
                # step's (their copy came before this step's kernels) while the GPU works.
                assert samples is not None
                deferred = self._readback.start(leaving, samples)
                self._complete_deferred(reports, progress=progress)
                self._defer(deferred)
            elif leaving is not None:
                self._complete_deferred(reports, progress=progress)
                self._complete(leaving, samples, reports, progress=progress)
        return reports + self._take_unreported()


def build_stage_runner(
    model: Any,
    config: InferenceConfig,
    groups: EngineGroups,
    kv_cache: PagedKVCache,
    scheduler: Scheduler,
    decoder: FusedDecoder | None,
    mamba_states: MambaStateCache | None,
) -> tuple[StageRunner, ExpertParallelSync | None]:
    """The runner of an engine's stage forwards, with its CUDA graphs and EP lockstep.

    Args:
        model: The model or this rank's pipeline stage.
        config: The engine configuration.
        groups: The engine's process groups.
        kv_cache: The engine's paged KV cache.
        scheduler: The engine's scheduler (its block tables and padding row).
        decoder: The fused decoder, or None for the model's own forward.
        mamba_states: A hybrid model's Mamba state slots, or None.

    Returns:
        ``(runner, lockstep)``: the :class:`~mcore_inference.stage.StageRunner` (decode
        graphs on CUDA with ``config.use_cuda_graphs``; hybrid graphs for a hybrid model) and
        the per-step agreement with expert-parallel peers (None without expert parallelism).

    Raises:
        UnsupportedModelError: If a hybrid model has expert-parallel layers.
    """
    device = next(model.parameters()).device
    graphs: DecodeGraphRunner | None = None
    if config.use_cuda_graphs and device.type == "cuda" and mamba_states is None:
        graphs = DecodeGraphRunner(
            model,
            kv_cache,
            scheduler.block_tables,
            scheduler.padding_row,
            config.graph_batch_sizes(),
            decoder,
        )
    ep_group = find_expert_parallel_group(model)
    etp_group = find_expert_tensor_parallel_group(model)
    lockstep_groups = [g for g in (ep_group, etp_group) if g is not None]
    if lockstep_groups and mamba_states is not None:
        raise UnsupportedModelError(
            f"model={type(model).__name__} has Mamba layers and expert parallelism; "
            "expected a hybrid model without expert-parallel MoE layers"
        )
    lockstep = (
        ExpertParallelSync(model, lockstep_groups[0], device, tuple(lockstep_groups[1:]))
        if lockstep_groups
        else None
    )
    runner = StageRunner(
        model,
        kv_cache,
        scheduler.block_tables,
        scheduler.padding_row,
        groups,
        lockstep,
        graphs,
        # Hybrid models reduce with plain all-reduces (no fused norm path).
        config.fuse_tp_communication and groups.tp_group is not None and mamba_states is None,
        decoder,
    )
    # Steps that prefill may replay the decode graphs (one stage, no lockstep peers).
    runner.graph_mixed_steps = (
        config.cuda_graph_mixed_steps and groups.pp_size == 1 and lockstep is None
    )
    if runner.graph_mixed_steps and graphs is not None:
        scheduler.graph_step_tokens = graphs.max_batch_size
    if mamba_states is not None:
        runner.mamba_states = mamba_states
        if config.use_cuda_graphs and device.type == "cuda":
            runner.hybrid_graphs = HybridGraphRunner(
                model,
                kv_cache,
                mamba_states,
                scheduler.block_tables,
                scheduler.padding_row,
                config.graph_batch_sizes(),
                config.graph_prefill_token_counts(),
            )
    return runner, lockstep
