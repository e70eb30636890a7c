"""Two Ray actors in a placement group run GRPO steps over torch.distributed; a failed
setup releases them; a run shuts down the Ray instance it started (and only that one)."""

import json

import pytest

from mcore_rl.config import GRPOConfig
from mcore_rl.errors import TaskError
from mcore_rl.run import run_grpo

ray = pytest.importorskip("ray")


def _ray_config(run_dir, **run):
    return GRPOConfig.from_dict(
        {
            "run": {
                "mode": "ray",
                "num_workers": 2,
                "device": "cpu",
                "num_steps": 2,
                "target_reward": None,
                "progress": False,
                "plot": False,
                "checkpoint_every": 0,
                "run_dir": str(run_dir),
                **run,
            },
            "model": {"hidden_size": 32, "num_layers": 1},
            "rollout": {"num_prompts": 4, "group_size": 2, "max_new_tokens": 2},
        }
    )


def test_run_shuts_down_the_ray_instance_it_started(tmp_path):
    # Runs first in this module, before the module's cluster fixture starts Ray. The actor's
    # setup fails (cheapest path through Ray); close and failed setups share the release.
    assert not ray.is_initialized()
    config = _ray_config(tmp_path, num_workers=1).replace(task={"name": "no-such-task"})
    with pytest.raises(TaskError, match="no-such-task"):
        run_grpo(config)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_two_actor_ray_run_trains_and_checkpoints(ray_cluster, tmp_path):
    result = run_grpo(_ray_config(tmp_path))
    assert ray.is_initialized()  # the caller's Ray instance is left running
    assert [r["step"] for r in result.records] == [0, 1]
    for record in result.records:
        assert record["rollouts"] == 8  # both ranks' shares gathered over DP
        assert record["packing/bins_per_rank"] >= 1
    assert (tmp_path / "checkpoints" / "latest").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]


def test_failed_actor_setup_removes_the_placement_group(ray_cluster, tmp_path):
    config = GRPOConfig.from_dict(
        {
            "run": {
                "mode": "ray",
                "num_workers": 2,
                "device": "cpu",
                "progress": False,
                "run_dir": str(tmp_path),
            },
            "task": {"name": "no-such-task"},
        }
    )
    with pytest.raises(TaskError, match="task='no-such-task' is not registered"):
        run_grpo(config)
    groups = ray.util.placement_group_table().values()
    assert groups and all(group["state"] == "REMOVED" for group in groups)
