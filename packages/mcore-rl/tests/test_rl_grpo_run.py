"""The GRPO loop in-process: a short run through the CLI, resume, flat memory, evaluation,
summary, and one-line errors for what a user gets wrong."""

import json

import pytest
import torch.distributed as dist

from mcore_parallel.testing import run_distributed
from mcore_rl.cli import main
from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLCheckpointError, RLError
from mcore_rl.metrics import TensorBoardLog
from mcore_rl.run import run_grpo
from mcore_rl.workers import InProcessWorkers

TINY = {
    "model": {"hidden_size": 32, "num_layers": 1},
    "rollout": {"num_prompts": 4, "group_size": 3, "max_new_tokens": 2},
    "run": {"progress": False, "device": "cpu", "target_reward": None},
    "loss": {"kl_beta": 0.05},
}
TINY_ARGS = [
    "--model.hidden-size", "32", "--model.num-layers", "1", "--rollout.num-prompts", "4",
    "--rollout.group-size", "3", "--rollout.max-new-tokens", "2", "--run.device", "cpu",
    "--run.target-reward", "None", "--loss.kl-beta", "0.05", "--run.no-progress",
]  # fmt: skip


def _config(**sections):
    merged = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return GRPOConfig.from_dict(merged)


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("time/", "memory/"))}


def test_cli_runs_three_steps_and_writes_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["--run.num-steps", "3", "--run.run-dir", str(run_dir), "--eval.every", "2"]
    status = main(["grpo", *TINY_ARGS, *args, "--eval.num-prompts", "4"])
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
    # Evaluated after step 2 (every 2) and after the last step; 4 held-out prompts each time.
    assert [("eval/pass@1" in r) for r in records] == [False, True, True]
    assert all(r["eval/prompts"] == 4 for r in records[1:])
    assert (run_dir / "metrics.png").stat().st_size > 1000
    assert json.loads((run_dir / "config.json").read_text())["run"]["num_steps"] == 3
    assert (run_dir / "checkpoints" / "latest").exists()
    summary = (run_dir / "summary.md").read_text()
    assert "| mean reward |" in summary and "held-out pass@1" in summary
    assert "step    2 | reward" in capsys.readouterr().out


def test_resume_reproduces_metrics_of_uninterrupted_run(tmp_path):
    config = _config(run={"num_steps": 4, "checkpoint_every": 2, "run_dir": str(tmp_path / "a")})
    straight = run_grpo(config).records
    first = run_grpo(config.replace(run={"run_dir": str(tmp_path / "b"), "num_steps": 2}))
    assert len(first.records) == 2
    resumed = run_grpo(config.replace(run={"run_dir": str(tmp_path / "b"), "resume": True}))
    assert [r["step"] for r in resumed.records] == [0, 1, 2, 3]
    assert [_comparable(r) for r in resumed.records] == [_comparable(r) for r in straight]
    on_disk = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in on_disk] == [0, 1, 2, 3]


def _resume_at_target(run_dir):
    # Rank 0 reads the resumed metrics (target already reached); rank 1 does not. Both must
    # stop without another step: a rank entering a step alone would hang in its collectives.
    config = _config(
        run={"run_dir": run_dir, "resume": True, "num_steps": 10, "target_reward": 0.5,
             "target_window": 1, "plot": False}
    )  # fmt: skip
    result = run_grpo(config)
    return result.reached_target, len(result.records) if dist.get_rank() == 0 else None


def test_resumed_multi_rank_run_stops_on_every_rank_when_rank0_sees_the_target(tmp_path):
    run_dir = tmp_path / "run"
    run_grpo(_config(run={"run_dir": str(run_dir), "num_steps": 2, "plot": False}))
    # Mark the finished steps as having reached the target, as a run that stopped there would.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines[-1]["reward/mean"] = 1.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    results = run_distributed(_resume_at_target, 2, str(run_dir), timeout=120)
    assert results == [(True, 2), (True, None)]


def test_memory_flat_over_ten_steps(tmp_path):
    config = _config(
        run={"num_steps": 10, "checkpoint_every": 0, "run_dir": str(tmp_path), "plot": False}
    )
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


def test_resume_without_checkpoint_raises(tmp_path):
    with pytest.raises(RLCheckpointError, match="holds no checkpoint"):
        run_grpo(_config(run={"run_dir": str(tmp_path), "resume": True}))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "nope"], "error: preset='nope' is unknown"),
        (["--run.resume", "--run.run-dir", "{tmp}"], "holds no checkpoint to resume"),
        (["--model.hf-path", "{tmp}/missing"], "model.hf_path='{tmp}/missing' is not a directory"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["grpo", *args, "--run.device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == captured.err.strip().splitlines()[0]  # one line
    assert message.format(tmp=tmp_path) in captured.err
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rollout.group-size", "0"], "group_size=0 must be >= 2"),
        (["--rollout.group-size", "1"], "group_size=1 must be >= 2"),
        (["--optimizer.lr", "nan"], "lr=nan must be"),
        (["--optimizer.clip-grad", "nan"], "clip_grad=nan must be"),
    ],
)
def test_cli_value_errors_exit_2_without_traceback(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error


def test_tensorboard_logs_every_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(
        run={"num_steps": 2, "run_dir": str(tmp_path), "tensorboard": True, "plot": False}
    )
    records = run_grpo(config).records
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [r["step"] for r in records]
    # TensorBoard stores float32.
    assert [e.value for e in scalars] == pytest.approx([r["reward/mean"] for r in records])


def test_tensorboard_log_names_the_missing_extra_or_writes_events(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(RLError, match="needs the tensorboard package"):
            TensorBoardLog(tmp_path)
    else:
        log = TensorBoardLog(tmp_path)
        log.append({"step": 0, "reward/mean": 0.5, "note": "text is skipped"})
        log.close()
        assert list(tmp_path.glob("events.out.tfevents.*"))
