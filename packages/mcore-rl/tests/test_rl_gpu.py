"""On a GPU: 20 GRPO steps with CUDA graphs, allocated memory flat at every step start."""

import math

import pytest
import torch
import torch.distributed as dist

from mcore_rl.config import GRPOConfig
from mcore_rl.distributed import init_worker_state
from mcore_rl.run import run_grpo
from mcore_rl.worker import GRPOWorker

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_twenty_steps_with_cuda_graphs_keep_step_start_memory_within_one_percent(tmp_path):
    config = GRPOConfig.from_dict(
        {
            "run": {
                "device": "cuda",
                "num_steps": 20,
                "target_reward": None,
                "progress": False,
                "plot": False,
                "checkpoint_every": 10,
                "run_dir": str(tmp_path),
            },
            "model": {"hidden_size": 256, "num_layers": 4},
            "rollout": {
                "use_cuda_graphs": True,
                "offload_optimizer": True,
                "num_prompts": 32,
                "group_size": 8,
            },
            "loss": {"kl_beta": 0.01, "entropy_coef": 0.1},
        }
    )
    records = run_grpo(config).records
    allocated = [r["memory/allocated_bytes"] for r in records]
    assert len(allocated) == 20 and allocated[1] > 0
    for step, value in enumerate(allocated[1:], start=1):
        assert abs(value - allocated[1]) <= 0.01 * allocated[1], (step, allocated)
    # The 20 steps trained: finite losses, rewards in [0, 1], and the policy moved away from
    # the reference (KL is exactly 0 before the first update and positive once it changed).
    assert all(math.isfinite(float(r["loss"])) for r in records)
    assert all(0.0 <= float(r["reward/mean"]) <= 1.0 for r in records)
    kl = [float(r["kl"]) for r in records]
    assert kl[0] < 1e-3 and max(kl[1:]) > 1e-3, kl


def _kept_engine_captures(device: str, steps: int) -> tuple[list[tuple], bool]:
    """Decode graphs captured over ``steps`` GRPO steps of one worker, and whether its engine
    stayed the same object."""
    from mcore_inference.cuda_graphs import DecodeGraphRunner

    captures: list[tuple] = []
    capture = DecodeGraphRunner._capture

    def counted(self, batch, width, *args, **kwargs):
        # The key of a graph: bucket, width and the runner's other arguments (decode steps).
        captures.append((batch, width, *args, *sorted(kwargs.items())))
        return capture(self, batch, width, *args, **kwargs)

    config = GRPOConfig.from_dict(
        {
            "run": {"device": device, "progress": False},
            "model": {"hidden_size": 64, "num_layers": 2},
            "rollout": {
                "use_cuda_graphs": True,
                "keep_engine": True,
                "num_prompts": 8,
                "group_size": 4,
            },
            "loss": {"kl_beta": 0.01},
        }
    )
    worker = GRPOWorker(config, init_worker_state(config))
    DecodeGraphRunner._capture = counted  # type: ignore[method-assign]
    try:
        worker.step(0)
        engine = worker.inference.engine
        for step in range(1, steps):
            worker.step(step)
        same = engine is not None and worker.inference.engine is engine
    finally:
        DecodeGraphRunner._capture = capture  # type: ignore[method-assign]
        worker.close()
        dist.destroy_process_group()
    return captures, same


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_engine_captures_each_decode_graph_once_across_steps():
    # The trained weights reach the kept engine in place, so its graphs stay valid: a later
    # step may capture a bucket the first one did not need, never one again.
    captures, same_engine = _kept_engine_captures("cuda", steps=4)
    assert same_engine
    assert captures and len(captures) == len(set(captures)), captures
