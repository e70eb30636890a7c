"""GRPOConfig: nested sections validated when built, the CLI spelling, presets; in-process
workers leave no process group or thread setting behind."""

import math
import random

import pytest
import torch
import torch.distributed as dist

from mcore_parallel import OptimizerConfig
from mcore_parallel.errors import ParallelConfigError
from mcore_rl.cli import parse_grpo_args
from mcore_rl.config import (
    GRPOConfig,
    ModelConfig,
    PackingConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from mcore_rl.errors import RLConfigError, TaskError
from mcore_rl.loss import LossConfig
from mcore_rl.presets import PRESETS, preset
from mcore_rl.run import run_grpo
from mcore_rl.worker import GRPOWorker, build_task
from mcore_rl.worker_config import model_config


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        (RunConfig, "device", "gpu"),
        (RunConfig, "mode", "threads"),
        (ModelConfig, "dtype", "float16"),
        (RolloutConfig, "advantage_estimator", "ppo"),
        (PackingConfig, "algorithm", "best_fit"),
    ],
)
def test_choice_fields_reject_values_outside_their_literal(section, field, value):
    with pytest.raises(RLConfigError, match=f"{field}='{value}' is unknown"):
        section(**{field: value})


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
def test_loss_section_is_the_loss_config_and_validates(field, value):
    with pytest.raises(RLConfigError, match=f"{field}={value}"):
        GRPOConfig().replace(loss={field: value})
    assert isinstance(GRPOConfig().loss, LossConfig)
    assert isinstance(GRPOConfig().optimizer, OptimizerConfig)


@pytest.mark.parametrize("field", ["lr", "clip_grad", "weight_decay"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_optimizer_values_must_be_finite(field, value):
    with pytest.raises((RLConfigError, ParallelConfigError), match=f"{field}="):
        GRPOConfig().replace(optimizer={field: value})


@pytest.mark.parametrize("argument", ["--optimizer.lr", "--optimizer.clip-grad"])
def test_cli_rejects_nan_learning_rate_and_clip(argument, capsys):
    # tyro reports a value error of a section as a usage error: exit status 2, no traceback.
    with pytest.raises(SystemExit) as exit_info:
        parse_grpo_args([argument, "nan"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "=nan must be" in error and "Traceback" not in error


def test_loss_values_must_be_finite():
    with pytest.raises(RLConfigError, match="kl_beta=nan must be a finite number"):
        GRPOConfig().replace(loss={"kl_beta": math.nan})


@pytest.mark.parametrize("value", [0, 1, -3])
def test_group_size_gives_the_same_minimum_for_every_value_below_it(value):
    with pytest.raises(RLConfigError, match=f"group_size={value} must be >= 2"):
        RolloutConfig(group_size=value)
    RolloutConfig(group_size=2)


def test_replace_validates_the_new_values_and_names():
    with pytest.raises(RLConfigError, match="device='tpu'"):
        GRPOConfig().replace(run={"device": "tpu"})
    with pytest.raises(RLConfigError, match="not fields of section 'run'"):
        GRPOConfig().replace(run={"lr": 1.0})
    with pytest.raises(RLConfigError, match="'training' is not a GRPOConfig section"):
        GRPOConfig().replace(training={})


def test_to_dict_and_from_dict_round_trip():
    config = GRPOConfig().replace(
        reward={"functions": ("math", "format"), "weights": (1.0, 0.5)},
        optimizer={"lr": 3e-4},
        model={"name": "tiny", "hidden_size": 48},
    )
    assert GRPOConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("size", ["tp", "pp", "vp", "cp", "ep", "dp"])
def test_parallel_sizes_must_be_positive(size):
    with pytest.raises(RLConfigError, match=f"{size}=0 must be >= 1"):
        ParallelConfig(**{size: 0})


def test_model_parallel_layouts_are_accepted_except_what_is_not_built():
    config = GRPOConfig().replace(
        model={"moe": {"num_experts": 4}},
        train_parallel={"tp": 2, "pp": 2, "vp": 2, "ep": 2, "sequence_parallel": True},
        infer_parallel={"tp": 2, "pp": 2, "ep": 2},
    )
    assert config.train_parallel.vp == 2 and config.infer_parallel.ep == 2
    assert GRPOConfig().replace(train_parallel={"cp": 2, "tp": 2}).train_parallel.cp == 2
    with pytest.raises(RLConfigError, match=r"batch_invariant=True with train_parallel\.cp=2"):
        GRPOConfig().replace(train_parallel={"cp": 2}, model={"batch_invariant": True})
    with pytest.raises(RLConfigError, match=r"infer_parallel\.cp=2 is not supported"):
        GRPOConfig().replace(infer_parallel={"cp": 2})
    with pytest.raises(RLConfigError, match=r"infer_parallel\.cp_method='all_gather' is not"):
        GRPOConfig().replace(infer_parallel={"cp_method": "all_gather"})
    with pytest.raises(RLConfigError, match=r"cp_method='ulysses' is unknown"):
        ParallelConfig(cp=2, cp_method="ulysses")


def test_cli_spells_sections_with_dots():
    config = parse_grpo_args(
        [
            "--model.hf-path", "/models/qwen", "--data.path", "gsm8k.jsonl",
            "--reward.functions", "math", "format", "--optimizer.lr", "3e-4",
            "--train-parallel.dp", "2", "--rollout.group-size", "4",
        ]
    )  # fmt: skip
    assert config.model.hf_path == "/models/qwen"
    assert config.data.path == "gsm8k.jsonl"
    assert config.reward.functions == ("math", "format")
    assert (config.optimizer.lr, config.train_parallel.dp, config.rollout.group_size) == (
        3e-4,
        2,
        4,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--infer-parallel.cp", "2"], "infer_parallel.cp=2 is not supported"),
        (
            ["--train-parallel.cp", "2", "--model.batch-invariant"],
            "batch_invariant=True with train_parallel.cp=2",
        ),
        (["--infer-parallel.vp", "2", "--infer-parallel.pp", "2"], "infer_parallel.vp=2"),
        (["--infer-parallel.sequence-parallel", "--infer-parallel.tp", "2"], "sequence_parallel"),
        (["--train-parallel.vp", "2"], "vp=2 needs pp > 1"),
        (["--train-parallel.sequence-parallel"], "sequence_parallel=True needs tp > 1"),
    ],
)
def test_cli_reports_unsupported_layouts_without_a_traceback(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_grpo_args(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    # One line, like every other user error of the CLI (not tyro's box).
    assert error.startswith("error: ") and len(error.strip().splitlines()) == 1, error


def test_cli_takes_a_context_parallel_layout():
    config = parse_grpo_args(
        ["--train-parallel.cp", "2", "--train-parallel.cp-method", "all_gather"]
    )
    assert (config.train_parallel.cp, config.train_parallel.cp_method) == (2, "all_gather")
    assert config.train_parallel.data_parallel_size(4) == 2
    assert not config.train_parallel.same_model_layout(config.infer_parallel)


def test_cli_takes_model_parallel_layouts():
    config = parse_grpo_args(
        ["--train-parallel.tp", "2", "--train-parallel.pp", "2", "--train-parallel.vp", "2",
         "--infer-parallel.tp", "1", "--infer-parallel.pp", "2"]
    )  # fmt: skip
    train, infer = config.train_parallel, config.infer_parallel
    assert (train.tp, train.pp, train.vp, infer.tp, infer.pp) == (2, 2, 2, 1, 2)
    assert not train.same_model_layout(infer)
    assert train.data_parallel_size(8) == 2 and infer.data_parallel_size(8) == 4
    with pytest.raises(RLConfigError, match="does not fill the 6 ranks"):
        train.data_parallel_size(6)


def test_presets_build_and_keep_the_main_job_defaults():
    assert preset("tiny-arith") == GRPOConfig()
    config = parse_grpo_args(["--preset", "countdown-0.5b", "--optimizer.lr", "3e-4"])
    assert (config.model.name, config.task.name, config.optimizer.lr) == (
        "qwen2.5-0.5b",
        "countdown",
        3e-4,
    )
    for name in PRESETS:
        preset(name)
    with pytest.raises(RLConfigError, match="preset='nope' is unknown"):
        preset("nope")


def test_gpt_583m_preset_has_the_seed_report_shape():
    config = preset("gpt-583m")
    shape = model_config(config, config.model.vocab_size)
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads) == (24, 1152, 16)
    per_layer = 4 * 1152**2 + 3 * 1152 * shape.ffn_hidden_size + 2 * 1152
    embeddings = shape.vocab_size * 1152 * (1 if shape.tie_word_embeddings else 2)
    assert 580e6 < 24 * per_layer + embeddings + 1152 < 586e6


def test_hf_path_excludes_shape_overrides_and_datasets_need_it():
    with pytest.raises(RLConfigError, match="hidden_size=64 cannot change the shape"):
        ModelConfig(hf_path="/models/qwen", hidden_size=64)
    with pytest.raises(RLConfigError, match=r"data\.path='x\.jsonl' needs model\.hf_path"):
        GRPOConfig().replace(data={"path": "x.jsonl"})


def test_reward_weights_must_match_functions():
    with pytest.raises(RLConfigError, match="one weight per function"):
        RewardConfig(functions=("math", "format"), weights=(1.0,))
    with pytest.raises(RLConfigError, match="not all zero"):
        RewardConfig(functions=("math",), weights=(0.0,))
    with pytest.raises(RLConfigError, match=r"timeout=0\.0"):
        RewardConfig(timeout=0.0)


def test_failed_worker_build_leaves_no_process_group(tmp_path):
    config = GRPOConfig(
        task=TaskConfig(name="no-such-task"),
        run=RunConfig(device="cpu", progress=False, run_dir=str(tmp_path)),
    )
    with pytest.raises(TaskError, match="task='no-such-task' is not registered"):
        run_grpo(config)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("field", "value", "low"),
    [("num_numbers", 1, 2), ("max_list_length", 1, 2), ("max_operand", -1, 0)],
)
def test_task_fields_name_their_minimum(field, value, low):
    with pytest.raises(RLConfigError, match=f"{field}={value} must be >= {low}"):
        TaskConfig(**{field: value})
    with pytest.raises(RLConfigError, match="num_steps=0 must be >= 1"):
        RunConfig(num_steps=0)


def test_smallest_task_options_build_their_tasks():
    for task in ("countdown", "sort", "reverse", "arithmetic"):
        config = GRPOConfig(
            task=TaskConfig(name=task, num_numbers=2, max_list_length=2, max_operand=0)
        )
        problem = build_task(config).generate(random.Random(0))
        assert problem.prompt and problem.target


def test_worker_uses_the_optimizer_section(tmp_path):
    config = GRPOConfig().replace(
        model={"hidden_size": 32, "num_layers": 1},
        optimizer={"lr": 0.25, "betas": (0.5, 0.75)},
        run={"device": "cpu"},
    )
    from mcore_rl.distributed import init_worker_state

    worker = GRPOWorker(config, init_worker_state(config))
    try:
        assert worker.optimizer.config.lr == 0.25
        assert worker.optimizer.config.betas == (0.5, 0.75)
    finally:
        dist.destroy_process_group()


def test_in_process_run_restores_the_torch_thread_count(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = GRPOConfig().replace(
            run={
                "cpu_threads": 1,
                "device": "cpu",
                "num_steps": 1,
                "target_reward": None,
                "progress": False,
                "plot": False,
                "checkpoint_every": 0,
                "run_dir": str(tmp_path),
            },
            model={"hidden_size": 32, "num_layers": 1},
            rollout={"num_prompts": 2, "group_size": 2, "max_new_tokens": 2},
        )
        run_grpo(config)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
