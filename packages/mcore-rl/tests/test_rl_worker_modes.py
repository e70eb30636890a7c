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


def _build_worker(keep_engine=True, max_new_tokens=2):
    config = GRPOConfig.from_dict(
        {
            "task": {"name": "explode-test"},
            "model": {"hidden_size": 32, "num_layers": 1},
            "rollout": {
                "num_prompts": 2,
                "group_size": 2,
                "max_new_tokens": max_new_tokens,
                "keep_engine": keep_engine,
                "offload_optimizer": True,
                "reward_requires_stop": False,
            },
            "loss": {"kl_beta": 0.1, "entropy_coef": 0.1},
            "run": {"progress": False, "device": "cpu"},
        }
    )
    return GRPOWorker(config, init_worker_state(config))


@pytest.fixture
def worker():
    worker = _build_worker()
    yield worker
    worker.close()
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


def _alive():
    gc.collect()
    return [o for o in gc.get_objects() if type(o) in (InferenceEngine, PagedKVCache)]


def test_no_engine_or_kv_cache_survives_generation_without_keep_engine():
    worker = _build_worker(keep_engine=False)
    try:
        worker.step(0)
        assert worker.inference.engine is None
        assert _alive() == []
    finally:
        worker.close()
        dist.destroy_process_group()


def test_kept_engine_is_built_once_and_closed_with_the_worker(worker):
    worker.step(0)
    engine = worker.inference.engine
    assert engine is not None and not engine.closed
    for step in (1, 2):
        worker.step(step)
        assert worker.inference.engine is engine  # no new engine, KV cache or graphs per step
    assert sorted(type(o).__name__ for o in _alive()) == ["InferenceEngine", "PagedKVCache"]
    # Longer requests than its size build it again, larger (a power of two of KV blocks),
    # never beyond the model's context.
    length = engine.config.max_sequence_length
    assert worker.inference.engine_for(length) is engine
    bigger = worker.inference.engine_for(length + 1)
    assert bigger is not engine and engine.closed
    assert bigger.config.max_sequence_length >= length + 1
    context = worker.inference._engine_config.max_sequence_length
    assert worker.inference.engine_for(context).config.max_sequence_length == context
    worker.close()
    del engine, bigger
    assert _alive() == []


def test_kept_engine_gives_the_same_steps_as_an_engine_per_step():
    # Sampling is seeded per request, so the engine's lifetime changes nothing.
    runs = []
    for keep in (True, False):
        worker = _build_worker(keep_engine=keep, max_new_tokens=3)
        try:
            runs.append([worker.step(step) for step in range(2)])
        finally:
            worker.close()
            dist.destroy_process_group()
    for kept, fresh in zip(*runs):
        for name in ("reward/mean", "loss", "kl", "entropy", "response/length"):
            assert kept[name] == fresh[name], name


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
