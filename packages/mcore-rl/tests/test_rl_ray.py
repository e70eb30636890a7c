"""Two Ray actors in a placement group run GRPO steps over torch.distributed."""

import json

import pytest

from mcore_rl.config import GRPOConfig
from mcore_rl.run import run_grpo

ray = pytest.importorskip("ray")


def test_two_actor_ray_run_trains_and_checkpoints(tmp_path):
    config = GRPOConfig(
        mode="ray",
        num_workers=2,
        device="cpu",
        hidden_size=32,
        num_layers=1,
        num_prompts=4,
        group_size=2,
        max_new_tokens=2,
        num_steps=2,
        target_reward=None,
        progress=False,
        plot=False,
        checkpoint_every=0,
        run_dir=str(tmp_path),
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run_grpo(config)
    finally:
        ray.shutdown()
    assert [r["step"] for r in result.records] == [0, 1]
    for record in result.records:
        assert record["rollouts"] == 8  # both ranks' shares gathered over DP
        assert record["packing/bins_per_rank"] >= 1
    assert (tmp_path / "checkpoints" / "latest").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
