"""GRPOConfig rejects bad values when it is built; in-process workers leave no process group
or thread setting behind."""

import random

import pytest
import torch
import torch.distributed as dist

from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLConfigError, TaskError
from mcore_rl.run import run_grpo
from mcore_rl.worker import build_task


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "gpu"),
        ("mode", "threads"),
        ("dtype", "float16"),
        ("advantage_estimator", "ppo"),
        ("packing_algorithm", "best_fit"),
    ],
)
def test_choice_fields_reject_values_outside_their_literal(field, value):
    with pytest.raises(RLConfigError, match=f"{field}='{value}' is unknown"):
        GRPOConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_low", 1.0),
        ("clip_low", -0.1),
        ("clip_high", -0.1),
        ("kl_beta", -0.5),
        ("entropy_coef", -1.0),
        ("importance_sampling_cap", 0.0),
    ],
)
def test_loss_fields_are_validated_by_the_config(field, value):
    with pytest.raises(RLConfigError, match=f"{field}={value}"):
        GRPOConfig(**{field: value})


def test_replace_validates_the_new_values():
    with pytest.raises(RLConfigError, match="device='tpu'"):
        GRPOConfig().replace(device="tpu")


def test_failed_worker_build_leaves_no_process_group(tmp_path):
    config = GRPOConfig(task="no-such-task", device="cpu", progress=False, run_dir=str(tmp_path))
    with pytest.raises(TaskError, match="task='no-such-task' is not registered"):
        run_grpo(config)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("field", "value", "low"),
    [("num_numbers", 1, 2), ("max_list_length", 1, 2), ("max_operand", -1, 0), ("num_steps", 0, 1)],
)
def test_count_fields_name_their_minimum(field, value, low):
    with pytest.raises(RLConfigError, match=f"{field}={value} must be >= {low}"):
        GRPOConfig(**{field: value})


def test_smallest_task_options_build_their_tasks():
    for task in ("countdown", "sort", "reverse", "arithmetic"):
        config = GRPOConfig(task=task, num_numbers=2, max_list_length=2, max_operand=0)
        problem = build_task(config).generate(random.Random(0))
        assert problem.prompt and problem.target


def test_loss_config_carries_the_loss_fields():
    config = GRPOConfig(
        clip_low=0.1, clip_high=0.3, kl_beta=0.02, entropy_coef=0.0, importance_sampling_cap=None
    )
    loss = config.loss_config()
    assert (loss.clip_low, loss.clip_high, loss.kl_beta) == (0.1, 0.3, 0.02)
    assert (loss.entropy_coef, loss.importance_sampling_cap) == (0.0, None)


def test_in_process_run_restores_the_torch_thread_count(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = GRPOConfig(
            cpu_threads=1,
            device="cpu",
            hidden_size=32,
            num_layers=1,
            num_prompts=2,
            group_size=2,
            max_new_tokens=2,
            num_steps=1,
            target_reward=None,
            progress=False,
            plot=False,
            checkpoint_every=0,
            run_dir=str(tmp_path),
        )
        run_grpo(config)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
