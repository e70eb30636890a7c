"""Rollouts: prompts split over the data-parallel ranks, sampled by the inference engine.

Every rank builds an :class:`mcore_inference.InferenceEngine` over the policy model for the
step, generates ``group_size`` completions for each of its prompts, scores them, closes the
engine (its KV cache and CUDA graphs are released before training) and all-gathers the
rollouts over the regular data-parallel group.

Under expert parallelism the engines of an EP group step together (see
:class:`mcore_inference.InferenceEngine`), so every rank builds one, also without prompts of its
own, and calls ``generate`` as many times as the rank with the largest shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from mcore_inference import (
    InferenceConfig,
    InferenceEngine,
    SamplingParams,
    find_expert_parallel_group,
)
from mcore_rl.errors import RLInputError, RLStateError
from mcore_rl.hf import PromptTokenizer
from mcore_rl.reference import unwrap_model
from mcore_rl.tasks import Problem, Task

__all__ = ["Rollout", "evaluate_greedy", "generate_rollouts", "shard_range"]


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


def generate_rollouts(
    model: nn.Module,
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
) -> list[Rollout]:
    """Generates and scores ``group_size`` completions per problem, split over DP ranks.

    Args:
        model: The policy (wrapped or not); only its forward is called.
        problems: All problems of the step, identical on every rank.
        task: Scores completions.
        tokenizer: Encodes prompts and decodes completions.
        group_size: Completions per problem.
        max_new_tokens: Most tokens per completion.
        temperature: Sampling temperature.
        seed: Seed of this rank's sampling for this step.
        parallel_generation_tasks: Most requests given to the engine at once.
        use_cuda_graphs: Let the engine capture decode CUDA graphs.
        dp_group: The regular data-parallel group; None for a single rank.
        require_stop: Completions cut at ``max_new_tokens`` without eos earn reward 0.

    Returns:
        The rollouts of every rank, grouped by problem (``group_size`` consecutive rollouts per
        problem, problems in order), identical on every rank.

    Raises:
        RLInputError: If ``group_size``, ``max_new_tokens`` or ``parallel_generation_tasks``
            is below 1 or ``temperature`` is not positive.
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
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    start, end = shard_range(len(problems), dp_rank, dp_size)
    mine = [(i, problems[i]) for i in range(start, end) for _ in range(group_size)]
    prompts = [tokenizer.encode_prompt(p.prompt) for _, p in mine]
    local: list[Rollout] = []
    policy = unwrap_model(model)
    # EP peers must make the same generate calls: as many as the largest shard needs.
    expert_parallel = find_expert_parallel_group(policy) is not None
    largest_shard = -(-len(problems) // dp_size) * group_size
    requests = largest_shard if expert_parallel else len(mine)
    calls = -(-requests // parallel_generation_tasks)
    if calls:
        longest = max((len(p) for p in prompts), default=1) + max_new_tokens
        # The same batch size on every EP rank gives them the same decode graph buckets.
        batch = min(parallel_generation_tasks, requests)
        config = InferenceConfig(
            max_batch_size=batch,
            max_sequence_length=longest,
            block_size=16,
            attention_split_size=256,
            max_tokens_per_step=max(2048, batch),
            use_cuda_graphs=use_cuda_graphs,
            seed=seed,
        )
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_new_tokens,
            stop_token_ids=tokenizer.eos_token_ids,
            return_logprobs=True,
        )
        engine = InferenceEngine(policy, config)
        try:
            results = []
            for call in range(calls):
                offset = call * parallel_generation_tasks
                results.extend(engine.generate(prompts[offset : offset + batch], params))
        finally:
            engine.close()
        eos = set(tokenizer.eos_token_ids)
        texts, stopped = [], []
        for result in results:
            if result.error is not None or result.logprobs is None:
                raise RLStateError(f"the inference engine failed a request: {result.error}")
            texts.append(tokenizer.decode(result.tokens))
            stopped.append(bool(result.tokens) and result.tokens[-1] in eos)
        scored = [i for i, done in enumerate(stopped) if done or not require_stop]
        rewards = [0.0] * len(results)
        values = task.score_batch([mine[i][1] for i in scored], [texts[i] for i in scored])
        for position, score in zip(scored, values):
            rewards[position] = score
        for (index, _), prompt, result, text, reward in zip(mine, prompts, results, texts, rewards):
            local.append(
                Rollout(
                    prompt_index=index,
                    prompt_ids=prompt,
                    completion_ids=list(result.tokens),
                    inference_logprobs=list(result.logprobs or []),
                    reward=reward,
                    finish_reason=str(getattr(result.finish_reason, "value", result.finish_reason)),
                    text=text,
                )
            )
    if dp_size == 1:
        return local
    gathered: list[Any] = [None] * dp_size
    dist.all_gather_object(gathered, local, group=dp_group)
    return [rollout for part in gathered for rollout in part]


def evaluate_greedy(
    model: nn.Module,
    problems: Sequence[Problem],
    *,
    task: Task,
    tokenizer: PromptTokenizer,
    max_new_tokens: int,
    use_cuda_graphs: bool = True,
    dp_group: Any = None,
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
        dp_group: The regular data-parallel group; None for a single rank.

    Returns:
        ``{"eval/pass@1", "eval/reward", "eval/prompts"}``, identical on every rank.
    """
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    start, end = shard_range(len(problems), dp_rank, dp_size)
    mine = list(problems[start:end])
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
        with InferenceEngine(unwrap_model(model), config) as engine:
            results = engine.generate(prompts, params)
        for result in results:
            if result.error is not None:
                raise RLStateError(f"the inference engine failed a request: {result.error}")
        rewards = task.score_batch(mine, [tokenizer.decode(r.tokens) for r in results])
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
