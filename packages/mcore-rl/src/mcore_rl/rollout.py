"""Rollouts: prompts split over the data-parallel ranks, sampled by the inference engine.

Every rank generates ``group_size`` completions for each prompt of its data-parallel shard and
scores them, then the rollouts are all-gathered over the data-parallel group. The engine is
either built over the policy model for the call and closed afterwards (its KV cache and CUDA
graphs are released before training), or a long-lived engine is passed in (a separate inference
model whose weights are updated in place between steps). The ranks of one model replica (tensor
and pipeline parallel) run the same requests and get the same results.

Every request samples with its own seed, derived from the call's seed and the request's place
among all the step's requests, so the rollouts do not depend on the layout or on which rank
generated them.

Under expert parallelism the engines of an EP group step together (see
:class:`mcore_inference.InferenceEngine`), so every rank builds one, also without prompts of its
own, and calls ``generate`` as many times as the rank with the largest shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from mcore_inference import (
    InferenceConfig,
    InferenceEngine,
    SamplingParams,
    find_expert_parallel_group,
)
from mcore_rl.errors import RLInputError, RLStateError, TokenizerError
from mcore_rl.hf import PromptTokenizer
from mcore_rl.reference import unwrap_model
from mcore_rl.seeding import derive_seed
from mcore_rl.tasks import Problem, Task

if TYPE_CHECKING:
    from mcore_parallel import ParallelState

__all__ = ["Rollout", "evaluate_greedy", "generate_rollouts", "request_seed", "shard_range"]


def request_seed(seed: int, prompt_index: int, sample: int) -> int:
    """The sampling seed of one request: a pure function of the call's seed and its place.

    Args:
        seed: Seed of the step's sampling (the same on every rank).
        prompt_index: Index of the prompt among the step's prompts.
        sample: Index of the completion within the prompt's group.

    Returns:
        A non-negative 31-bit seed.
    """
    return derive_seed(seed, prompt_index, sample)


@dataclass(kw_only=True, slots=True)
class Rollout:
    """One sampled completion with everything training needs."""

    prompt_index: int
    """Index of the problem among the step's problems."""
    prompt_ids: list[int]
    """Prompt token ids (bos first)."""
    completion_ids: list[int]
    """Generated token ids (eos included when the completion stopped)."""
    inference_logprobs: list[float]
    """Log-probs the inference engine sampled the completion with."""
    reward: float
    """The task's reward in [0, 1]."""
    finish_reason: str
    """Why generation stopped (``stop_token`` or ``length``)."""
    text: str
    """The decoded completion."""


def shard_range(count: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous, balanced share ``[start, end)`` of ``count`` items for ``rank`` of ``size``.

    Args:
        count: Items to split.
        rank: This rank.
        size: Number of ranks.

    Returns:
        ``(start, end)``; the first ``count % size`` ranks get one more item.
    """
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _decode(tokenizer: PromptTokenizer, tokens: Sequence[int]) -> str | None:
    # A model vocabulary padded to split over tensor-parallel ranks holds ids the tokenizer
    # does not know; a completion sampling one is invalid (reward 0), not an error of the run.
    try:
        return tokenizer.decode(tokens)
    except TokenizerError:
        return None


def generate_rollouts(
    model: nn.Module | None,
    problems: Sequence[Problem],
    *,
    task: Task,
    tokenizer: PromptTokenizer,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    parallel_generation_tasks: int = 512,
    use_cuda_graphs: bool = True,
    dp_group: Any = None,
    require_stop: bool = True,
    engine: InferenceEngine | None = None,
    state: ParallelState | None = None,
) -> list[Rollout]:
    """Generates and scores ``group_size`` completions per problem, split over DP ranks.

    Args:
        model: The policy (wrapped or not); only its forward is called. Ignored (may be None)
            when ``engine`` is given.
        problems: All problems of the step, identical on every rank.
        task: Scores completions.
        tokenizer: Encodes prompts and decodes completions.
        group_size: Completions per problem.
        max_new_tokens: Most tokens per completion.
        temperature: Sampling temperature.
        seed: Seed of the step's sampling, identical on every rank; request ``j`` of prompt
            ``i`` samples with :func:`request_seed` ``(seed, i, j)``.
        parallel_generation_tasks: Most requests given to the engine at once.
        use_cuda_graphs: Let the engine capture decode CUDA graphs.
        dp_group: The data-parallel group of the generation layout; None for a single replica.
        require_stop: Completions cut at ``max_new_tokens`` without eos earn reward 0.
            Completions holding an id the tokenizer cannot decode (the padding of a vocabulary
            split over tensor-parallel ranks) always do.
        engine: A long-lived engine to generate with (not closed here); None builds one over
            ``model`` for this call.
        state: Parallel state of ``model`` when it is tensor- or pipeline-parallel (passed to
            the engine built here).

    Returns:
        The rollouts of every rank, grouped by problem (``group_size`` consecutive rollouts per
        problem, problems in order), identical on every rank.

    Raises:
        RLInputError: If ``group_size``, ``max_new_tokens`` or ``parallel_generation_tasks``
            is below 1, ``temperature`` is not positive, or neither ``model`` nor ``engine``
            is given.
        RLStateError: If the engine failed a request.
    """
    for name, value in (
        ("group_size", group_size),
        ("max_new_tokens", max_new_tokens),
        ("parallel_generation_tasks", parallel_generation_tasks),
    ):
        if value < 1:
            raise RLInputError(f"{name}={value} must be >= 1")
    if not temperature > 0.0:
        raise RLInputError(f"temperature={temperature} must be > 0")
    if model is None and engine is None:
        raise RLInputError("generate_rollouts needs a model or an engine (both are None)")
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    # With a parallel state (or a long-lived engine) the engine shares the requests over the
    # data-parallel replicas itself and returns every result on every rank; otherwise each
    # rank generates its shard of the prompts here and the rollouts are gathered.
    engine_shares = engine is not None or state is not None
    start, end = (
        (0, len(problems)) if engine_shares else shard_range(len(problems), dp_rank, dp_size)
    )
    mine = [(i, j, problems[i]) for i in range(start, end) for j in range(group_size)]
    prompts = [tokenizer.encode_prompt(p.prompt) for _, _, p in mine]
    policy = engine.model if engine is not None else unwrap_model(model)  # type: ignore[arg-type]
    # EP peers must make the same generate calls: as many as the largest shard needs.
    expert_parallel = find_expert_parallel_group(policy) is not None and not engine_shares
    largest_shard = -(-len(problems) // dp_size) * group_size
    requests = largest_shard if expert_parallel else len(mine)
    calls = -(-requests // parallel_generation_tasks)
    results: list[Any] = []
    if calls:
        params = [
            SamplingParams(
                temperature=temperature,
                max_tokens=max_new_tokens,
                stop_token_ids=tokenizer.eos_token_ids,
                return_logprobs=True,
                seed=request_seed(seed, index, sample),
            )
            for index, sample, _ in mine
        ]
        batch = min(parallel_generation_tasks, requests)
        owned = engine is None
        if engine is None:
            longest = max((len(p) for p in prompts), default=1) + max_new_tokens
            # The same batch size on every EP rank gives them the same decode graph buckets.
            config = InferenceConfig(
                max_batch_size=batch,
                max_sequence_length=longest,
                block_size=16,
                attention_split_size=256,
                max_tokens_per_step=max(2048, batch),
                use_cuda_graphs=use_cuda_graphs,
                seed=seed,
            )
            engine = InferenceEngine(policy, config, state=state)
        try:
            for call in range(calls):
                offset = call * parallel_generation_tasks
                results.extend(
                    engine.generate(
                        prompts[offset : offset + batch], params[offset : offset + batch]
                    )
                )
        finally:
            if owned:
                engine.close()
    for result in results:
        if result.error is not None or result.logprobs is None:
            raise RLStateError(f"the inference engine failed a request: {result.error}")
    texts = [_decode(tokenizer, result.tokens) for result in results]
    # Shared results are on every rank: each rank of the run scores its share.
    scorers = dist.group.WORLD if engine_shares and dist.is_initialized() else None
    rewards = _score(results, texts, mine, task, tokenizer, require_stop, scorers)
    local = [
        Rollout(
            prompt_index=index,
            prompt_ids=prompt,
            completion_ids=list(result.tokens),
            inference_logprobs=list(result.logprobs or []),
            reward=reward,
            finish_reason=str(getattr(result.finish_reason, "value", result.finish_reason)),
            text=text or "",
        )
        for (index, _, _), prompt, result, text, reward in zip(
            mine, prompts, results, texts, rewards
        )
    ]
    if dp_size == 1 or engine_shares:
        return local
    gathered: list[Any] = [None] * dp_size
    dist.all_gather_object(gathered, local, group=dp_group)
    return [rollout for part in gathered for rollout in part]


def _score(
    results: list[Any],
    texts: list[str | None],
    requests: list[tuple[int, int, Problem]],
    task: Task,
    tokenizer: PromptTokenizer,
    require_stop: bool,
    group: Any,
) -> list[float]:
    """Rewards of the results (0 for undecodable or, with ``require_stop``, unstopped ones);
    with a ``group`` every rank of it scores its share and the scores are all-gathered."""
    eos = set(tokenizer.eos_token_ids)
    size = dist.get_world_size(group) if group is not None else 1
    start, end = shard_range(len(results), dist.get_rank(group) if size > 1 else 0, size)
    rewards = [0.0] * (end - start)
    scored = []
    for position in range(start, end):
        tokens = results[position].tokens
        stopped = bool(tokens) and tokens[-1] in eos
        if texts[position] is not None and (stopped or not require_stop):
            scored.append(position)
    values = task.score_batch([requests[i][2] for i in scored], [texts[i] or "" for i in scored])
    for position, score in zip(scored, values):
        rewards[position - start] = score
    if size == 1:
        return rewards
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, rewards, group=group)
    return [reward for part in gathered for reward in part]


def evaluate_greedy(
    model: nn.Module,
    problems: Sequence[Problem],
    *,
    task: Task,
    tokenizer: PromptTokenizer,
    max_new_tokens: int,
    use_cuda_graphs: bool = True,
    dp_group: Any = None,
    engine: InferenceEngine | None = None,
    state: ParallelState | None = None,
) -> dict[str, float]:
    """Greedy pass@1 and mean reward on held-out problems, split over the DP ranks.

    One greedy completion per problem; a completion passes when its reward is 1 (full marks).
    Completions cut at ``max_new_tokens`` are scored as they are.

    Args:
        model: The policy (wrapped or not).
        problems: The held-out problems, identical on every rank.
        task: Scores completions.
        tokenizer: Encodes prompts and decodes completions.
        max_new_tokens: Most tokens per completion.
        use_cuda_graphs: Let the engine capture decode CUDA graphs.
        dp_group: The data-parallel group of the generation layout; None for a single replica.
        engine: A long-lived engine to generate with (not closed here); None builds one over
            ``model`` for this call.
        state: Parallel state of ``model`` when it is tensor- or pipeline-parallel.

    Returns:
        ``{"eval/pass@1", "eval/reward", "eval/prompts"}``, identical on every rank.
    """
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    start, end = shard_range(len(problems), dp_rank, dp_size)
    # With a parallel state (or a long-lived engine) the engine shares the prompts over the
    # data-parallel replicas and every rank gets all results; each rank scores its share.
    engine_shares = engine is not None or state is not None
    mine = list(problems) if engine_shares else list(problems[start:end])
    rewards: list[float] = []
    if mine:
        prompts = [tokenizer.encode_prompt(p.prompt) for p in mine]
        config = InferenceConfig(
            max_batch_size=len(prompts),
            max_sequence_length=max(len(p) for p in prompts) + max_new_tokens,
            block_size=16,
            attention_split_size=256,
            max_tokens_per_step=max(2048, len(prompts)),
            use_cuda_graphs=use_cuda_graphs,
        )
        params = SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=tokenizer.eos_token_ids
        )
        if engine is not None:
            results = engine.generate(prompts, params)
        else:
            with InferenceEngine(unwrap_model(model), config, state=state) as owned:
                results = owned.generate(prompts, params)
        for result in results:
            if result.error is not None:
                raise RLStateError(f"the inference engine failed a request: {result.error}")
        if engine_shares:
            mine, results = mine[start:end], results[start:end]
        rewards = task.score_batch(mine, [_decode(tokenizer, r.tokens) or "" for r in results])
    totals = [sum(rewards), float(sum(r >= 1.0 for r in rewards)), float(len(rewards))]
    if dp_size > 1:
        gathered: list[Any] = [None] * dp_size
        dist.all_gather_object(gathered, totals, group=dp_group)
        totals = [sum(part[i] for part in gathered) for i in range(3)]
    count = max(totals[2], 1.0)
    return {
        "eval/reward": totals[0] / count,
        "eval/pass@1": totals[1] / count,
        "eval/prompts": totals[2],
    }
