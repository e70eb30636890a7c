"""One process per rank for the multi-rank tests of mcore-kernels.

mcore-kernels is a leaf package and cannot use ``mcore_parallel.testing.run_distributed``, so the
tests share this helper instead. Each rank joins a real process group (gloo on CPU, NCCL on
GPUs), runs ``fn(rank, world, *args)`` and sends its return value back as ``torch.save`` bytes:
a queued tensor would travel as a shared-memory handle that dies with the child. Every child is
joined, or killed, before the call returns.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_ranks"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        options: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            options["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            **options,
        )
        value = fn(rank, world, *args)
        dist.destroy_process_group()
        payload = io.BytesIO()
        torch.save(value, payload)
        results.put((rank, "ok", payload.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str = "gloo",
    start_method: str = "fork",
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks of a fresh process group.

    Args:
        fn: a module-level function; its return value must survive ``torch.save``.
        world: number of ranks.
        *args: further arguments of ``fn``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        start_method: ``"fork"`` starts in milliseconds (no fresh interpreter importing torch)
            but may not be used once this process has run a backward pass (autograd's worker
            threads do not survive a fork); ``"forkserver"`` then (its server imports torch and
            Dynamo once per session); CUDA needs ``"spawn"``.
        timeout_s: process-group timeout; the parent waits twice as long for the results.
        env: environment variables set in each child before it joins the group.

    Returns:
        The values of ``fn`` by rank.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or did not report.
    """
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "torch._dynamo", "mcore_kernels"])
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world, port, backend, timeout_s, env or {}, fn, args, results),
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout_s * 2)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty as exc:
        raise AssertionError(f"ranks did not report within {timeout_s * 2} s") from exc
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    return [values[rank] for rank in range(world)]
