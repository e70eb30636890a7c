"""Mode switches of a worker restore their state: hooks, offload, weights, engine teardown."""

import gc

import pytest
import torch
import torch.distributed as dist

from mcore_inference import InferenceEngine
from mcore_inference.kv_cache import PagedKVCache
from mcore_rl.config import GRPOConfig
from mcore_rl.distributed import init_worker_state
from mcore_rl.reference import unwrap_model
from mcore_rl.tasks import Problem, register_task
from mcore_rl.worker import GRPOWorker

FAIL = {"now": False}


def _verify(problem, completion):
    if FAIL["now"]:
        raise RuntimeError("injected verifier failure")
    return 0.0


register_task(
    "explode-test",
    lambda rng: Problem(prompt=f"{rng.randint(0, 9)}=", target="0"),
    _verify,
    overwrite=True,
)


@pytest.fixture
def worker():
    config = GRPOConfig.from_dict(
        {
            "task": {"name": "explode-test"},
            "model": {"hidden_size": 32, "num_layers": 1},
            "rollout": {
                "num_prompts": 2,
                "group_size": 2,
                "max_new_tokens": 2,
                "offload_optimizer": True,
                "reward_requires_stop": False,
            },
            "loss": {"kl_beta": 0.1, "entropy_coef": 0.1},
            "run": {"progress": False, "device": "cpu"},
        }
    )
    worker = GRPOWorker(config, init_worker_state(config))
    yield worker
    dist.destroy_process_group()


def _weights(worker):
    return {n: p.detach().clone() for n, p in unwrap_model(worker.model).named_parameters()}


def test_step_failure_restores_hooks_offload_and_weights(worker):
    hooks = worker.model.param_sync_hooks
    assert hooks.enabled
    worker.step(0)
    worker.optimizer.start_param_sync(force_sync=True)
    before = _weights(worker)
    FAIL["now"] = True
    try:
        with pytest.raises(RuntimeError, match="injected verifier failure"):
            worker.step(1)  # fails inside generation, with the optimizer offloaded
    finally:
        FAIL["now"] = False
    assert hooks.enabled
    assert not worker.model.offloaded and not worker.optimizer._state_offloaded
    after = _weights(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not worker.reference._active


def test_no_engine_or_kv_cache_survives_generation(worker):
    worker.step(0)
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) in (InferenceEngine, PagedKVCache)]
    assert alive == []


def test_failed_checkpoint_save_keeps_hooks_and_weights(worker, tmp_path):
    worker.step(0)
    worker.optimizer.start_param_sync(force_sync=True)
    before = _weights(worker)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint root should be")
    with pytest.raises(OSError):
        worker.save_checkpoint(blocker, 1)
    assert worker.model.param_sync_hooks.enabled
    after = _weights(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)
    worker.save_checkpoint(tmp_path / "ok", 1)  # and the worker can still save
    assert (tmp_path / "ok" / "latest").exists()
