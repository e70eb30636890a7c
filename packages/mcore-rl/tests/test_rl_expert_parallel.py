"""RL with expert parallelism: rollouts split prompts by the regular data-parallel rank and
gather over the data-parallel group, never the expert-data-parallel group (ep=2, 4 ranks).

The EP peers of each pair get different work: rank 0 has two problems and rank 1 one (so rank 0
makes two ``generate`` calls of ``PARALLEL_TASKS`` requests and rank 1 one), rank 2 has one and
rank 3 none, and sampled completions stop at different lengths. Generation still completes
because the engines step together and idle ranks run padding forwards."""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch.distributed as dist

from mcore_models import GPTConfig, GPTModel, MoEConfig, parallelize
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed
from mcore_rl.rollout import generate_rollouts, shard_range
from mcore_rl.tasks import get_task, sample_problems
from mcore_rl.tokenizer import CharTokenizer

NUM_PROBLEMS, GROUP_SIZE, MAX_NEW_TOKENS, PARALLEL_TASKS = 3, 2, 8, 2


def _count_call(counter: list[int], *_: object) -> None:
    counter[0] += 1


def _prompts_fed(calls: list[tuple[list[int], list[int]]]) -> Counter:
    """Prompts in the model's inputs: runs of tokens at positions 0, 1, 2 ... in one forward.

    Decode tokens sit past their prompt and padding rows are a lone pad token at position 0,
    so only prompts (bos, then at least one character) form runs of two or more.
    """
    prompts: list[list[int]] = []
    for ids, positions in calls:
        current: list[int] | None = None
        for token, position in zip(ids, positions):
            if position == 0:
                current = [token]
                prompts.append(current)
            elif current is not None and position == len(current):
                current.append(token)
            else:
                current = None
    return Counter(tuple(p) for p in prompts if len(p) > 1)


def _rollouts_under_expert_parallelism() -> dict:
    state = initialize(ep=2)
    task = get_task("arithmetic")
    tokenizer = CharTokenizer(task.alphabet)
    moe = MoEConfig(num_experts=4, top_k=2)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, moe=moe, seed=7)
    model = parallelize(GPTModel(config), state).eval()
    calls: list[tuple[list[int], list[int]]] = []
    forwards = [0]
    handles = [
        model.register_forward_pre_hook(
            lambda _, args: calls.append((args[0].flatten().tolist(), args[1].flatten().tolist()))
        ),
        model.register_forward_pre_hook(partial(_count_call, forwards)),
    ]
    problems = sample_problems(task, NUM_PROBLEMS, seed=0)
    rollouts = generate_rollouts(
        model,
        problems,
        task=task,
        tokenizer=tokenizer,
        group_size=GROUP_SIZE,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=1.0,
        seed=state.dp_rank,
        parallel_generation_tasks=PARALLEL_TASKS,
        use_cuda_graphs=False,
        dp_group=state.dp_group,
    )
    for handle in handles:
        handle.remove()
    start, end = shard_range(NUM_PROBLEMS, state.dp_rank, state.dp_size)
    expected = Counter(
        tuple(tokenizer.encode(problem.prompt))
        for problem in problems[start:end]
        for _ in range(GROUP_SIZE)
    )
    forward_counts: list[int] = [0] * state.ep_size
    dist.all_gather_object(forward_counts, forwards[0], group=state.ep_group)
    return {
        "sizes": (state.dp_size, state.ep_size, state.expert_dp_size),
        "ranks": (state.dp_rank, state.expert_dp_rank),
        "local_experts": model.layers[0].mlp.experts.num_experts,
        "prompts_match_dp_shard": _prompts_fed(calls) == expected,
        "ep_forward_counts": forward_counts,
        "prompt_indices": [r.prompt_index for r in rollouts],
        "completions": [r.completion_ids for r in rollouts],
    }


def test_rollouts_split_by_dp_rank_and_gather_over_dp_group_under_expert_parallelism():
    results = run_distributed(_rollouts_under_expert_parallelism, 4)
    assert {r["sizes"] for r in results} == {(4, 2, 2)}
    # Expert-DP ranks repeat across the ep pairs, so splitting by them would duplicate work.
    assert [r["ranks"] for r in results] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert all(r["local_experts"] == 2 for r in results)
    assert all(r["prompts_match_dp_shard"] for r in results)
    # Lock step: both ranks of each EP pair ran the same number of forwards (more than one).
    for r in results:
        counts = r["ep_forward_counts"]
        assert counts[0] == counts[1] > 1
    expected_order = [i for i in range(NUM_PROBLEMS) for _ in range(GROUP_SIZE)]
    for r in results:
        assert r["prompt_indices"] == expected_order
        assert r["completions"] == results[0]["completions"]
    lengths = [len(c) for c in results[0]["completions"]]
    assert len(set(lengths)) > 1 and max(lengths) == MAX_NEW_TOKENS
