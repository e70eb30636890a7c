"""Asynchronous saves: snapshot at call time, wait(), and failures surfaced later."""

from __future__ import annotations

import pytest
import torch

import mcore_ckpt
from mcore_ckpt.errors import AsyncSaveError
from mcore_ckpt.layout import read_latest


def test_changes_after_async_save_returns_do_not_reach_the_checkpoint(tmp_path):
    weights = torch.arange(12.0).reshape(3, 4)
    history = [1, 2]
    state = {"w": weights, "history": history}
    handle = mcore_ckpt.save(tmp_path, state, async_save=True)
    weights.mul_(-1.0)
    history.append(3)
    handle.wait()
    target = {"w": torch.zeros(3, 4), "history": None}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4))
    assert target["history"] == [1, 2]


def test_wait_returns_the_committed_checkpoint_named_by_latest(tmp_path):
    handle = mcore_ckpt.save(tmp_path, {"x": torch.ones(2)}, async_save=True, step=3)
    path = handle.wait()
    assert handle.done()
    assert path == tmp_path / "step_000000003"
    assert read_latest(tmp_path) == path.name


def test_async_failure_raises_on_wait_and_keeps_previous_checkpoint(tmp_path):
    mcore_ckpt.save(tmp_path, {"x": torch.tensor(1.0), "f": 0})
    handle = mcore_ckpt.save(tmp_path, {"x": torch.tensor(2.0), "f": lambda: 0}, async_save=True)
    with pytest.raises(AsyncSaveError, match="step_000000001"):
        handle.wait()
    target = {"x": torch.tensor(0.0)}
    mcore_ckpt.load(tmp_path, target)
    assert target["x"].item() == 1.0


def test_async_failure_not_waited_for_raises_on_the_next_call_once(tmp_path):
    mcore_ckpt.save(tmp_path, {"f": lambda: 0}, async_save=True)
    with pytest.raises(AsyncSaveError):
        mcore_ckpt.save(tmp_path, {"x": torch.tensor(5.0)})
    # Reported once: the next save goes through and cleans up the partial directory.
    mcore_ckpt.save(tmp_path, {"x": torch.tensor(6.0)})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    target = {"x": torch.tensor(0.0)}
    mcore_ckpt.load(tmp_path, target)
    assert target["x"].item() == 6.0


def test_staging_buffers_are_reused_by_the_next_save_of_the_same_root(tmp_path):
    for value in (1.0, 2.0):
        mcore_ckpt.save(tmp_path, {"x": torch.full((4,), value)}, async_save=True).wait()
    target = {"x": torch.zeros(4)}
    mcore_ckpt.load(tmp_path, target)
    assert torch.equal(target["x"], torch.full((4,), 2.0))
    mcore_ckpt.release_staging_buffers(tmp_path)
