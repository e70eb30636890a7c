"""A save killed with SIGKILL at any moment leaves the previous checkpoint loadable.

Each attempt forks a child (from a forkserver that imported torch once, so children start in
milliseconds) that saves a new step; the parent kills it after a random delay spread over the
measured duration of a save. Whatever the moment, loading the root must give exactly the
checkpoint that ``latest`` names, which is the previous one or, if the commit got through, the
new one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import torch

import mcore_ckpt
from mcore_ckpt.layout import read_latest

ATTEMPTS = 20


def state_for(step: int) -> dict:
    return {
        "model": {f"w{i}": torch.full((128, 256), float(step * 10 + i)) for i in range(4)},
        "optimizer": {"exp_avg": torch.arange(4096, dtype=torch.float64) + step},
        "step": step,
    }


def empty_state() -> dict:
    return {
        "model": {f"w{i}": torch.zeros(128, 256) for i in range(4)},
        "optimizer": {"exp_avg": torch.zeros(4096, dtype=torch.float64)},
        "step": None,
    }


def _save_in_child(root: str, step: int, ready) -> None:
    torch.set_num_threads(1)
    state = state_for(step)
    ready.set()
    mcore_ckpt.save(root, state, step=step, keep_last=3)
    os._exit(0)


def _run_child(context, root, step: int, kill_after: float | None) -> float:
    ready = context.Event()
    child = context.Process(target=_save_in_child, args=(str(root), step, ready))
    child.start()
    assert ready.wait(timeout=60), "child did not start"
    start = time.monotonic()
    if kill_after is None:
        child.join(timeout=60)
        assert child.exitcode == 0
    else:
        time.sleep(kill_after)
        child.kill()
        child.join()
    return time.monotonic() - start


def test_sigkill_at_random_points_during_save_leaves_a_loadable_checkpoint(tmp_path):
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "mcore_ckpt"])
    mcore_ckpt.save(tmp_path, state_for(0), step=0)
    duration = _run_child(context, tmp_path, 1, kill_after=None)
    previous = 1
    rng = random.Random(7)
    for attempt in range(ATTEMPTS):
        step = attempt + 2
        # Stratified over [0, 1.2 x duration] so that every phase of the save gets hit.
        kill_after = duration * 1.2 * (attempt + rng.random()) / ATTEMPTS
        _run_child(context, tmp_path, step, kill_after)

        latest = read_latest(tmp_path)
        target = empty_state()
        info = mcore_ckpt.load(tmp_path, target)
        assert info.name == latest
        assert info.step in (previous, step), (attempt, kill_after, info.step)
        expected = state_for(info.step)
        for name, tensor in expected["model"].items():
            assert torch.equal(target["model"][name], tensor), (attempt, name)
        assert torch.equal(target["optimizer"]["exp_avg"], expected["optimizer"]["exp_avg"])
        assert target["step"] == info.step
        previous = info.step

    # The next save removes what the killed ones left behind and applies retention.
    mcore_ckpt.save(tmp_path, state_for(100), step=100, keep_last=3)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert leftovers == []
    committed = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert len(committed) == 3 and committed[-1] == "step_000000100"
