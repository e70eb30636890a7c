"""The GRPO loop in-process: a short run through the CLI, resume, flat memory."""

import json

import pytest

from mcore_rl.cli import main, parse_grpo_args
from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLCheckpointError, RLConfigError
from mcore_rl.run import run_grpo
from mcore_rl.workers import InProcessWorkers

TINY = dict(
    hidden_size=32,
    num_layers=1,
    num_prompts=4,
    group_size=3,
    max_new_tokens=2,
    progress=False,
    device="cpu",
    target_reward=None,
    kl_beta=0.05,
)
TINY_ARGS = [
    "--hidden-size", "32", "--num-layers", "1", "--num-prompts", "4", "--group-size", "3",
    "--max-new-tokens", "2", "--device", "cpu", "--target-reward", "None", "--kl-beta", "0.05",
]  # fmt: skip


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("time/", "memory/"))}


def test_cli_runs_three_steps_and_writes_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    status = main(["grpo", *TINY_ARGS, "--num-steps", "3", "--run-dir", str(run_dir)])
    assert status == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["rollouts"] == 12
        assert record["kl"] >= 0.0
        assert 0.0 < record["packing/efficiency"] <= 1.0
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    assert (run_dir / "metrics.png").stat().st_size > 1000
    assert json.loads((run_dir / "config.json").read_text())["num_steps"] == 3
    assert (run_dir / "checkpoints" / "latest").exists()
    assert "step    2 | reward" in capsys.readouterr().out


def test_resume_reproduces_metrics_of_uninterrupted_run(tmp_path):
    config = GRPOConfig(**TINY, num_steps=4, checkpoint_every=2, run_dir=str(tmp_path / "a"))
    straight = run_grpo(config).records
    first = run_grpo(config.replace(run_dir=str(tmp_path / "b"), num_steps=2))
    assert len(first.records) == 2
    resumed = run_grpo(config.replace(run_dir=str(tmp_path / "b"), resume=True))
    assert [r["step"] for r in resumed.records] == [0, 1, 2, 3]
    assert [_comparable(r) for r in resumed.records] == [_comparable(r) for r in straight]
    on_disk = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in on_disk] == [0, 1, 2, 3]


def test_memory_flat_over_ten_steps(tmp_path):
    config = GRPOConfig(**TINY, num_steps=10, checkpoint_every=0, run_dir=str(tmp_path), plot=False)
    workers = InProcessWorkers(config)
    try:
        workers.worker.track_live_tensors = True
        records = run_grpo(config, workers).records
    finally:
        workers.close()
    counts = [r["memory/live_tensors"] for r in records]
    sizes = [r["memory/live_tensor_bytes"] for r in records]
    # Step 0 starts before the optimizer has state; every later step starts like step 1.
    assert counts[1:] == [counts[1]] * 9, counts
    assert sizes[1:] == [sizes[1]] * 9, sizes


def test_resume_without_checkpoint_and_bad_options_raise(tmp_path):
    with pytest.raises(RLCheckpointError, match="holds no checkpoint"):
        run_grpo(GRPOConfig(**TINY, run_dir=str(tmp_path), resume=True))
    with pytest.raises(RLConfigError, match="group_size=1"):
        GRPOConfig(group_size=1)
    with pytest.raises(RLConfigError, match="preset='huge'"):
        parse_grpo_args(["--preset", "huge"])
    config = parse_grpo_args(["--preset", "countdown-0.5b", "--lr", "3e-4"])
    assert (config.model, config.task, config.lr) == ("qwen2.5-0.5b", "countdown", 3e-4)
