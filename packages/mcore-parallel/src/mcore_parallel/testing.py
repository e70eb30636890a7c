"""Run a function on N real torch.distributed ranks, each in its own spawned process.

:func:`run_distributed` is how every multi-rank test of the monorepo runs on a CPU (gloo) or on
GPUs (NCCL). Ranks never inherit the caller's memory (no plain ``fork``): they are forked from a
clean ``forkserver`` process that has imported torch once, which saves every rank the seconds
of a fresh ``import torch``; where forkserver is unavailable they are started with ``spawn``.
Either way the function and its arguments must be picklable: a module-level function of a test
module works, because the children inherit the parent's ``sys.path``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.errors import (
    DistributedRunError,
    DistributedTimeoutError,
    ParallelConfigError,
)

__all__ = ["run_distributed", "free_port"]

# How long the parent waits for a dead rank's last message before reporting its exit code.
_DRAIN_SECONDS = 2.0


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago.

    Returns:
        The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serialize(value: Any) -> bytes:
    # torch.save instead of the queue's own pickling: tensors then travel as bytes rather than
    # shared-memory handles that die with the child process.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _deserialize(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    store_port: int,
    store_prefix: str,
    env_port: int,
    backend: str,
    timeout: float,
    results: Any,
    call: bytes,
    environ: dict[str, str],
) -> None:
    # The forkserver's environment dates from its start; ranks see the caller's current one.
    os.environ.clear()
    os.environ.update(environ)
    # Unpickled only now: importing fn's module (and what it imports, e.g. Triton kernels that
    # read TRITON_INTERPRET when decorated) must see the caller's environment.
    fn, args = pickle.loads(call)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(env_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Ranks share the machine's cores; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        # A per-run key prefix: a foreign process that reaches this port by mistake (after
        # its own free-port race) cannot mix its keys with this run's.
        store = dist.PrefixStore(
            store_prefix,
            dist.TCPStore(
                "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout)
            ),
        )
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(*args)
        payload = _serialize(value)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        results.close()
        results.join_thread()
        # Skip interpreter teardown: collectives of the failed group may still be blocked.
        os._exit(1)
    results.put(("ok", rank, payload))
    results.close()
    results.join_thread()


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # NOTE: the server is started once per process with these modules already imported; CUDA
    # is never initialised in it, so forking from it stays safe for NCCL ranks.
    context.set_forkserver_preload(["torch", "torch.distributed", "mcore_parallel.testing"])
    return context


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
) -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` freshly spawned ranks of one process group.

    Each rank initialises torch.distributed through a rendezvous store served by the calling
    process on a port the OS assigns (so concurrent runs cannot collide), with ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` set (under NCCL rank ``r`` uses ``cuda:r``), calls
    ``fn(*args)``, destroys the process group and sends back the return value.
    ``MASTER_ADDR``/``MASTER_PORT`` name another free local port, for a function that tears
    the group down and initialises from the environment itself. Ranks see the caller's
    ``os.environ`` and ``sys.path`` as of this call. Tensors in return values come back on
    the CPU.

    Args:
        fn: A picklable (module-level) function; it may call
            :func:`mcore_parallel.state.initialize` to build its groups.
        world_size: Number of ranks to spawn.
        *args: Picklable positional arguments passed to ``fn`` on every rank.
        backend: torch.distributed backend, ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        timeout: Seconds after which the run is aborted; also the collectives' timeout.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        ParallelConfigError: If ``world_size`` or ``timeout`` is not positive.
        DistributedRunError: If a rank raised (the message names the first failing rank and
            holds its traceback) or died without reporting.
        DistributedTimeoutError: If the ranks did not all finish within ``timeout`` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ParallelConfigError(f"world_size={world_size!r} must be a positive integer")
    if not timeout > 0:
        raise ParallelConfigError(f"timeout={timeout!r} must be a positive number of seconds")
    context = _context()
    results = context.Queue()
    # Port 0: the OS picks a free port while binding, with no window for another run to take it.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    worker_args = (
        store.port,
        f"run-{secrets.token_hex(8)}",
        free_port(),
        backend,
        timeout,
        results,
        pickle.dumps((fn, args)),
        dict(os.environ),
    )
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, *worker_args),
            name=f"mcore-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, world_size, timeout)
    finally:
        _stop(processes)
        results.close()
        results.join_thread()


def _collect(processes: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(values) < world_size:
        now = time.monotonic()
        if now > deadline:
            pending = sorted(set(range(world_size)) - set(values))
            raise DistributedTimeoutError(
                f"ranks {pending} of world_size={world_size} did not finish within "
                f"timeout={timeout}s"
            )
        try:
            status, rank, payload = results.get(timeout=0.1)
        except queue.Empty:
            for rank, process in enumerate(processes):
                if rank in values or process.exitcode is None:
                    continue
                first_seen = dead_since.setdefault(rank, now)
                if now - first_seen > _DRAIN_SECONDS:
                    raise DistributedRunError(
                        f"rank {rank} of world_size={world_size} exited with code "
                        f"{process.exitcode} without reporting a result"
                    ) from None
            continue
        if status == "error":
            raise DistributedRunError(f"rank {rank} of world_size={world_size} failed:\n{payload}")
        values[rank] = _deserialize(payload)
    return [values[rank] for rank in range(world_size)]
