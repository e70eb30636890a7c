"""Warm-up of every kernel variant the engine's steps can launch, so none compiles later.

Triton compiles a kernel once per specialisation: the dtypes and 16-byte alignment of its
tensors, each int argument's ``== 1`` / ``% 16 == 0`` class and the constexpr values, several of
which follow the step's token count (row blocks, launch configurations chosen by the number of
programs, programmatic dependent launch up to a token count) or its table width (eager steps
cut the block table to their longest context). A compile takes 0.1-1 s, during which every
running request waits. The decode CUDA graphs (and a hybrid model's decode and non-decode
graphs) compile their buckets' variants when captured; this module runs the rest once: the
eager forward of this rank's stage (prefill, mixed and large decode steps) at token counts on
both sides of every threshold (1 to 5, each power of two and the next count, the graph buckets,
the step budget) over a one-block and a full-width table, and on the last stage the sampler
(argmax, log-probs, and with multi-step decode the argmax that feeds the next step) at those
row counts up to ``max_batch_size``.

Every engine layout is covered: a pipeline stage after the first runs on zero hidden states
(no stage exchanges anything), a hybrid model runs both its decode and its non-decode Mamba
paths on the scratch state slot, and the ranks of an expert-parallel group run the same
forwards in the same order (the MoE layers' exchanges pair up; every rank calls it, as it
calls :meth:`~mcore_inference.InferenceEngine.capture_graphs`). Padding tokens (positions 0
through the scratch row, token ids spread over the vocabulary so that MoE routing reaches
several experts) touch no request's cache or Mamba state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mcore_inference.config import SamplingParams
from mcore_inference.describe import fused_tp_communication
from mcore_inference.sample_step import _row_logprobs
from mcore_inference.sampling import sample_tokens
from mcore_kernels.batch_invariant import batch_invariant_mode
from mcore_kernels.row_argmax import greedy_feed

if TYPE_CHECKING:
    from mcore_inference.engine import InferenceEngine
    from mcore_inference.kv_cache import PagedKVCache
    from mcore_inference.scheduler import Scheduler
    from mcore_inference.stage import StageRunner

__all__ = ["warm_up_counts", "warm_up_engine"]


def warm_up_counts(limit: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Token (or row) counts that visit both sides of the kernels' count thresholds.

    Args:
        limit: The largest count a step can have.
        extra: Further counts to include (and each one's successor), e.g. the graph buckets.

    Returns:
        Sorted counts in ``[1, limit]``: 1 to 5, every power of two and the counts on either
        side of it, ``extra`` and their successors, and ``limit``.
    """
    counts = {1, 2, 3, 4, 5, limit}
    power = 1
    while power <= limit:
        counts.update((power - 1, power, power + 1))
        power *= 2
    for count in extra:
        counts.update((count, count + 1))
    return tuple(sorted(c for c in counts if 1 <= c <= limit))


def warm_up_engine(engine: InferenceEngine) -> int:
    """Run the engine's eager forward and sampler at every count of :func:`warm_up_counts`.

    Collective like a step: under tensor, pipeline or expert parallelism every rank of the
    model replica (and of the expert-parallel group) calls it. Safe between steps while
    requests run: the padding tokens write only into the scratch block and the scratch Mamba
    state slot.

    Args:
        engine: An open engine.

    Returns:
        The number of forwards run.
    """
    runner = engine._runner
    cache = engine.kv_cache
    scheduler = engine.scheduler
    config = engine.config
    if runner is None or cache is None or scheduler is None:
        return 0
    device = engine.device
    groups = engine.groups
    mamba = runner.mamba_states
    budget = int(config.max_tokens_per_step or config.max_batch_size)
    buckets: tuple[int, ...] = runner.graphs.batch_sizes if runner.graphs is not None else ()
    if runner.hybrid_graphs is not None:
        buckets = (*runner.hybrid_graphs.batch_sizes, *runner.hybrid_graphs.token_counts)
    token_counts = warm_up_counts(budget, buckets)
    # Table widths: one block, then 1, 2, 4 ... attention splits, and the whole table.
    full_context = scheduler.block_tables.shape[1] * cache.block_size
    contexts = {cache.block_size, full_context}
    context = cache.split_size
    while context < full_context:
        contexts.add(context)
        context *= 2
    greedy = SamplingParams(temperature=0.0)
    forwards = 0
    fused_tp = runner.fuse_tp_communication
    # A hybrid model's steps run the Mamba layers' decode or non-decode path (one token per
    # request, or chunks); a decode step has at most one token per request.
    modes: tuple[bool | None, ...] = (None,) if mamba is None else (False, True)
    with (
        torch.no_grad(),
        batch_invariant_mode(config.batch_invariant),
        fused_tp_communication(runner.model, fused_tp),
    ):
        for count in token_counts:
            inputs = torch.zeros((3, count), dtype=torch.long, device=device)
            torch.arange(count, out=inputs[0]).remainder_(engine.vocab_size)
            inputs[2].fill_(scheduler.padding_row)
            if groups.is_first_stage:
                stage_input = inputs[0][None]
            else:
                stage_input = torch.zeros(
                    (1, count, runner.hidden_size), dtype=runner.hidden_dtype, device=device
                )
            for decode in modes:
                if decode and count > config.max_batch_size:
                    continue
                for context in sorted(contexts):
                    hidden = _stage_forward(runner, cache, scheduler, inputs, stage_input,
                                            context, decode)  # fmt: skip
                    forwards += 1
            if count > config.max_batch_size or not groups.is_last_stage:
                continue
            # The sampler's rows: one per sampling request.
            rows = hidden[0].index_select(0, torch.arange(count, device=device))
            if runner.decoder is not None and mamba is None:
                logits = runner.decoder.compute_logits(rows)
            else:
                logits = runner.model.compute_logits(rows)
            tokens = sample_tokens(logits, [greedy] * count, [0.0] * count)
            _row_logprobs(logits, tokens, [1.0] * count, runner.hidden_dtype)
            if runner.graphs is not None and config.multi_step_decode > 1:
                # Multi-step graph runs of greedy rows feed the next step from the argmax
                # (``GREEDY_FEED``): the graphs' input rows and a samples row, same layouts.
                feed = torch.zeros(
                    (3, runner.graphs.batch_sizes[-1]), dtype=torch.long, device=device
                )
                samples = torch.empty((2, count), dtype=torch.float64, device=device)
                greedy_feed(logits, samples[0], feed[0, :count], feed[1, :count])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return forwards


def _stage_forward(
    runner: StageRunner,
    cache: PagedKVCache,
    scheduler: Scheduler,
    inputs: torch.Tensor,
    stage_input: torch.Tensor,
    context: int,
    decode: bool | None,
) -> torch.Tensor:
    """One eager forward of this rank's stage over padding tokens (as ``StageRunner._eager``).

    ``decode`` is None for a model without Mamba layers, else whether the Mamba layers take
    their decode path (every padding token its own sequence on the scratch state slot).
    """
    cache.prepare_step(scheduler.block_tables, inputs[1], inputs[2], max_context=context)
    try:
        if decode is not None:
            assert runner.mamba_states is not None
            state = runner.mamba_states.step_state([], decode=decode, padding=inputs.shape[1])
            return runner.model(
                stage_input, inputs[1][None], kv_cache=cache, return_hidden=True, mamba_state=state
            )
        if runner.decoder is not None:
            return runner.decoder(stage_input, inputs[1][None], kv_cache=cache)
        return runner.model(stage_input, inputs[1][None], kv_cache=cache, return_hidden=True)
    finally:
        cache.clear_step()
