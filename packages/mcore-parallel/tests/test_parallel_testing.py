"""run_distributed: per-rank results, failure propagation, timeout, no process left behind."""

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore_parallel.errors import DistributedRunError, DistributedTimeoutError, ParallelConfigError
from mcore_parallel.testing import run_distributed


def _all_reduce_rank(scale: float) -> dict:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": value * scale,
        "pid": os.getpid(),
    }


def _fail_on_rank_1(pid_dir: str) -> int:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both pids are on disk before anything fails
    if dist.get_rank() == 1:
        raise KeyError("deliberate failure on rank 1")
    # Rank 0 blocks in a collective that rank 1 never joins; it must still be cleaned up.
    dist.barrier()
    return 0


def _hang_on_rank_1(pid_dir: str) -> int:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(600)
    return 0


def _assert_pids_gone(pid_dir: Path, world_size: int) -> None:
    pids = [int(Path(pid_dir, f"{rank}.pid").read_text()) for rank in range(world_size)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


def test_results_come_back_in_rank_order_from_real_collectives():
    results = run_distributed(_all_reduce_rank, 3, 2.0)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 for r in results)
    assert all(torch.equal(r["sum"], torch.tensor([6.0])) for r in results)
    assert len({r["pid"] for r in results}) == 3


def test_failure_names_rank_with_traceback_and_leaves_no_process(tmp_path):
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_fail_on_rank_1, 2, str(tmp_path), timeout=60)
    message = str(info.value)
    assert "rank 1" in message
    assert "deliberate failure on rank 1" in message and "Traceback" in message
    _assert_pids_gone(tmp_path, 2)


def test_timeout_raises_and_leaves_no_process(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match=r"ranks \[1\]"):
        run_distributed(_hang_on_rank_1, 2, str(tmp_path), timeout=10)
    assert time.monotonic() - start < 40
    _assert_pids_gone(tmp_path, 2)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"world_size": 0}, "world_size"), ({"world_size": 2, "timeout": 0}, "timeout")],
)
def test_invalid_arguments_raise(kwargs, name):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ParallelConfigError, match=name):
        run_distributed(_all_reduce_rank, world_size, 1.0, **kwargs)


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_see_the_callers_current_environment(monkeypatch):
    # Start the rank process server first, then change the environment.
    run_distributed(_read_env, 1, "MCORE_TEST_FLAG")
    monkeypatch.setenv("MCORE_TEST_FLAG", "set-after-start")
    assert run_distributed(_read_env, 2, "MCORE_TEST_FLAG") == ["set-after-start"] * 2
