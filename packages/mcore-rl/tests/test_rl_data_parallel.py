"""Data parallelism: two ranks train exactly like one, rollouts are gathered over DP."""

import random

import pytest
import torch
import torch.distributed as dist

from mcore_parallel.testing import run_distributed
from mcore_rl.config import GRPOConfig
from mcore_rl.distributed import init_worker_state
from mcore_rl.reference import unwrap_model
from mcore_rl.rollout import Rollout
from mcore_rl.worker import GRPOWorker

TINY = {
    "model": {"hidden_size": 32, "num_layers": 1},
    "rollout": {"num_prompts": 4, "group_size": 3, "max_new_tokens": 2},
    "loss": {"kl_beta": 0.1, "entropy_coef": 0.1},
    "optimizer": {"lr": 1e-2},
    "run": {"progress": False, "device": "cpu"},
}


def _fixed_rollouts(vocab_size):
    rng = random.Random(0)
    rollouts = []
    for prompt in range(5):
        prompt_ids = [1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 6))]
        for _ in range(3):
            completion = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 5))]
            rollouts.append(
                Rollout(
                    prompt_index=prompt,
                    prompt_ids=prompt_ids,
                    completion_ids=completion,
                    inference_logprobs=[-rng.uniform(2.5, 3.5) for _ in completion],
                    reward=rng.choice([0.0, 0.1, 1.0]),
                    finish_reason="stop_token",
                    text="",
                )
            )
    return rollouts


def _train_fixed(max_tokens_per_microbatch, *, recompute_old_logprobs=False, minibatches=1):
    packing = {"max_tokens_per_microbatch": max_tokens_per_microbatch}
    config = GRPOConfig.from_dict(
        {**TINY, "packing": {**packing, "minibatches_per_step": minibatches}}
    )
    worker = GRPOWorker(config, init_worker_state(config))
    metrics = worker.train_on_rollouts(
        _fixed_rollouts(worker.tokenizer.vocab_size),
        recompute_old_logprobs=recompute_old_logprobs,
    )
    worker.optimizer.start_param_sync(force_sync=True)
    params = {n: p.detach().clone() for n, p in unwrap_model(worker.model).named_parameters()}
    return metrics, params


def _two_ranks():
    metrics, params = _train_fixed(16)
    config = GRPOConfig.from_dict(TINY)
    worker = GRPOWorker(config, init_worker_state(config))
    step = worker.step(0)
    return metrics, params, step, dist.get_world_size()


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_two_ranks, 2)


def test_two_ranks_with_small_microbatches_train_like_one_rank(two_rank_results):
    single_metrics, single_params = _train_fixed(4096)
    dist.destroy_process_group()
    for metrics, params, _, world in two_rank_results:
        assert world == 2
        assert metrics["packing/bins_per_rank"] > 1  # several microbatches per rank
        for name in ("loss", "kl", "entropy", "reward/mean", "clip_fraction"):
            assert abs(metrics[name] - single_metrics[name]) < 1e-5, name
        # The gradient norm sees any error in the loss scaling (Adam's update would not).
        assert metrics["grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
        for name, value in single_params.items():
            # Adam's first step is about lr * sign(grad): near-zero gradients flip with
            # rounding, so parameters agree to a small fraction of lr (1e-2).
            torch.testing.assert_close(params[name], value, atol=1e-4, rtol=0)


def test_rollouts_are_split_and_gathered_over_dp(two_rank_results):
    steps = [{k: v for k, v in r[2].items() if not k.startswith("time/")} for r in two_rank_results]
    assert steps[0] == steps[1]
    assert steps[0]["rollouts"] == TINY["rollout"]["num_prompts"] * TINY["rollout"]["group_size"]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_first_minibatch_reuses_the_training_forward_as_old_logprobs(minibatches):
    # The step's first minibatch trains on the generating weights, so the training forward's
    # own log-probs are its old log-probs; the separate forward-only pass gives the same step.
    reused, reused_params = _train_fixed(16, minibatches=minibatches)
    dist.destroy_process_group()
    recomputed, recomputed_params = _train_fixed(
        16, recompute_old_logprobs=True, minibatches=minibatches
    )
    dist.destroy_process_group()
    if minibatches == 1:
        assert reused["ratio"] == pytest.approx(1.0, abs=1e-6)
    else:  # the second minibatch trains after one update: its ratio leaves 1
        assert abs(reused["ratio"] - 1.0) > 1e-3
    assert reused["clip_fraction"] == recomputed["clip_fraction"]
    for name in ("loss", "kl", "entropy", "token_prob_error", "ratio", "grad_norm"):
        assert reused[name] == pytest.approx(recomputed[name], rel=1e-6, abs=1e-7), name
    for name, value in recomputed_params.items():
        torch.testing.assert_close(reused_params[name], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_reference_pass_runs_only_when_kl_beta_is_positive(kl_beta, monkeypatch):
    # kl_beta = 0: no reference weights swapped in and no forward-only pass at all (the first
    # minibatch's old log-probs come from its training forward).
    config = GRPOConfig.from_dict(
        {
            **TINY,
            "loss": {"kl_beta": kl_beta, "entropy_coef": 0.1},
            "packing": {"max_tokens_per_microbatch": 16},
        }
    )
    worker = GRPOWorker(config, init_worker_state(config))
    calls = {"reference": 0, "forward": 0}
    use_reference_weights = worker.reference.use_reference_weights
    forward_logprobs = worker.trainer.forward_logprobs

    def counted_reference():
        calls["reference"] += 1
        return use_reference_weights()

    def counted_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward_logprobs(*args, **kwargs)

    monkeypatch.setattr(worker.reference, "use_reference_weights", counted_reference)
    monkeypatch.setattr(worker.trainer, "forward_logprobs", counted_forward)
    times: dict[str, float] = {}
    phases: list[str] = []
    try:
        worker.train_on_rollouts(_fixed_rollouts(worker.tokenizer.vocab_size), times, phases.append)
    finally:
        dist.destroy_process_group()
    if kl_beta > 0.0:
        assert phases == ["logprobs", "reference", "train"] and "reference" in times
        assert calls["reference"] == 1 and calls["forward"] >= 1
    else:
        assert phases == ["logprobs", "train"] and "reference" not in times
        assert calls == {"reference": 0, "forward": 0}
