"""RL with expert parallelism: rollouts split prompts by the regular data-parallel rank and
gather over the data-parallel group, never the expert-data-parallel group (ep=2, 4 ranks)."""

from __future__ import annotations

from collections import Counter

import torch

from mcore_models import GPTConfig, GPTModel, MoEConfig
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed
from mcore_rl.rollout import generate_rollouts, shard_range
from mcore_rl.tasks import get_task, sample_problems
from mcore_rl.tokenizer import CharTokenizer

NUM_PROBLEMS, GROUP_SIZE = 8, 2


def _rollouts_under_expert_parallelism() -> dict:
    state = initialize(ep=2)
    task = get_task("arithmetic")
    tokenizer = CharTokenizer(task.alphabet)
    moe = MoEConfig(num_experts=4, top_k=2)
    config = GPTConfig.from_name("tiny", vocab_size=tokenizer.vocab_size, moe=moe, seed=7)
    model = GPTModel(config, state).eval()
    seen: list[torch.Tensor] = []
    handle = model.register_forward_pre_hook(lambda _, args: seen.append(args[0].flatten()))
    problems = sample_problems(task, NUM_PROBLEMS, seed=0)
    # One new token: a single prefill pass per rank, so the expert-parallel all-to-alls of
    # every rank pair up whatever each rank samples.
    rollouts = generate_rollouts(
        model,
        problems,
        task=task,
        tokenizer=tokenizer,
        group_size=GROUP_SIZE,
        max_new_tokens=1,
        temperature=1.0,
        seed=state.dp_rank,
        use_cuda_graphs=False,
        dp_group=state.dp_group,
    )
    handle.remove()
    start, end = shard_range(NUM_PROBLEMS, state.dp_rank, state.dp_size)
    expected = Counter(
        token
        for problem in problems[start:end]
        for token in tokenizer.encode(problem.prompt) * GROUP_SIZE
    )
    return {
        "sizes": (state.dp_size, state.ep_size, state.expert_dp_size),
        "ranks": (state.dp_rank, state.expert_dp_rank),
        "local_experts": model.layers[0].mlp.experts.num_experts,
        "prompt_tokens_match_dp_shard": Counter(torch.cat(seen).tolist()) == expected,
        "prompt_indices": [r.prompt_index for r in rollouts],
        "completions": [r.completion_ids for r in rollouts],
    }


def test_rollouts_split_by_dp_rank_and_gather_over_dp_group_under_expert_parallelism():
    results = run_distributed(_rollouts_under_expert_parallelism, 4)
    assert {r["sizes"] for r in results} == {(4, 2, 2)}
    # Expert-DP ranks repeat across the ep pairs, so splitting by them would duplicate work.
    assert [r["ranks"] for r in results] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert all(r["local_experts"] == 2 for r in results)
    assert all(r["prompt_tokens_match_dp_shard"] for r in results)
    expected_order = [i for i in range(NUM_PROBLEMS) for _ in range(GROUP_SIZE)]
    for r in results:
        assert r["prompt_indices"] == expected_order
        assert r["completions"] == results[0]["completions"]
