"""Warm-up of every kernel variant the engine's steps can launch, so none compiles later.

Triton compiles a kernel once per specialisation: the dtypes and 16-byte alignment of its
tensors, each int argument's ``== 1`` / ``% 16 == 0`` class and the constexpr values, several of
which follow the step's token count (row blocks, launch configurations chosen by the number of
programs, programmatic dependent launch up to a token count) or its table width (eager steps
cut the block table to their longest context). A compile takes 0.1-1 s, during which every
running request waits. The decode CUDA graphs compile their buckets' variants when captured;
this module runs the rest once: the eager forward (prefill, mixed and large decode steps) at
token counts on both sides of every threshold (1 to 5, each power of two and the next count,
the graph buckets, the step budget) over a one-block and a full-width table, and the sampler
(argmax, log-probs) at those row counts up to ``max_batch_size``. Padding tokens (token 0 at
position 0 through the scratch row) touch no request's cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mcore_inference.config import SamplingParams
from mcore_inference.describe import fused_tp_communication
from mcore_inference.sample_step import _row_logprobs
from mcore_inference.sampling import sample_tokens
from mcore_kernels.batch_invariant import batch_invariant_mode

if TYPE_CHECKING:
    from mcore_inference.engine import InferenceEngine

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

    Only for a single-stage engine without expert-parallel lockstep and Mamba layers (the
    others' steps are collective or stateful); does nothing elsewhere. Safe between steps
    while requests run: the padding tokens write only into the scratch block.

    Args:
        engine: An open engine.

    Returns:
        The number of forwards run.
    """
    runner = engine._runner
    cache = engine.kv_cache
    scheduler = engine.scheduler
    config = engine.config
    if (
        runner is None
        or cache is None
        or scheduler is None
        or engine.groups.pp_size != 1
        or engine._ep is not None
        or runner.mamba_states is not None
    ):
        return 0
    device = engine.device
    budget = int(config.max_tokens_per_step or config.max_batch_size)
    buckets = runner.graphs.batch_sizes if runner.graphs is not None else ()
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
    with (
        torch.no_grad(),
        batch_invariant_mode(config.batch_invariant),
        fused_tp_communication(runner.model, fused_tp),
    ):
        for count in token_counts:
            inputs = torch.zeros((3, count), dtype=torch.long, device=device)
            inputs[2].fill_(scheduler.padding_row)
            for context in sorted(contexts):
                cache.prepare_step(
                    scheduler.block_tables, inputs[1], inputs[2], max_context=context
                )
                try:
                    if runner.decoder is not None:
                        hidden = runner.decoder(inputs[0][None], inputs[1][None], kv_cache=cache)
                    else:
                        hidden = runner.model(
                            inputs[0][None], inputs[1][None], kv_cache=cache, return_hidden=True
                        )
                finally:
                    cache.clear_step()
                forwards += 1
            if count > config.max_batch_size:
                continue
            # The sampler's rows: one per sampling request.
            rows = hidden[0].index_select(0, torch.arange(count, device=device))
            if runner.decoder is not None:
                logits = runner.decoder.compute_logits(rows)
            else:
                logits = runner.model.compute_logits(rows)
            tokens = sample_tokens(logits, [greedy] * count, [0.0] * count)
            _row_logprobs(logits, tokens, [1.0] * count, runner.hidden_dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return forwards
