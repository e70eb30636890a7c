"""The engine in a child process of its own, so that it never waits for the HTTP server's GIL.

Why: an engine step on a GPU is mostly Python (scheduling, CUDA-graph launches, bookkeeping),
and so is serving its tokens (waking each handler, detokenizing, JSON, socket writes). On one
interpreter the two take turns on the GIL, so every step waits for the HTTP work of the step
before it and the engine runs at a fraction of its speed. In a process of its own the engine
runs at its direct speed; the HTTP process keeps up or, when it falls behind, finds several
tokens per request at its next wake-up and sends them in one chunk.

The HTTP process (:class:`EngineProcess`, on its event loop) sends the child commands over a
pipe (add a request, abort one, stop); the child sends back one message per engine step with
the new tokens of every request it advanced, the final results, and the engine's statistics.
The event loop reads that pipe without a thread (``add_reader``), taking every message waiting
before the handlers run.

The child never outlives the server: it stops when the server asks it to, when its command pipe
closes (the server died) and, on Linux, when the server process dies
(``PR_SET_PDEATHSIG``); it ignores SIGINT and SIGTERM, which the server handles (a terminal's
Ctrl-C reaches the whole process group and must not kill the engine under in-flight requests).

With ``tp > 1`` (``serve --tp N``) the engine is ``N`` such processes, all children of the
server: rank 0 is the child described above, the other ranks follow it step by step
(:mod:`mcore_inference.serve.engine_ranks`). The server watches every rank's message pipe: a
rank that fails or exits fails the open requests with a message naming it, and the server ends
the other ranks (which could otherwise wait for it in a collective for ever).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from mcore_inference.serve.engine_loop import LoopFrontend, LoopStats, RequestHandle
from mcore_inference.serve.engine_ranks import RankPlacement
from mcore_inference.serve.engine_spec import EngineInfo, EngineProcessError, EngineSpec
from mcore_inference.serve.engine_worker import _Update, child_main

__all__ = ["EngineInfo", "EngineProcess", "EngineProcessError", "EngineSpec", "child_main"]

_BLAME_WAIT_S = 0.25
"""How long a failure of rank 0 waits for another rank to be seen dead (the likely cause)."""
_PIPE_BYTES = 1 << 20
"""Capacity asked for the message pipe: the engine blocks only when the server is this far
behind (the server takes every waiting message at each wake-up)."""


def _widen(descriptor: int) -> None:
    """Give a pipe room for many steps' messages (Linux; the default holds 64 KiB)."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(descriptor, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)


class _Rank:
    """The server's end of one engine process: the process and its two pipes."""

    def __init__(self, rank: int, process: Any, commands: Connection, output: Connection) -> None:
        self.rank = rank
        self.process = process
        self.commands = commands
        self.output = output
        self.kv_blocks_used = 0

    def exit_status(self, wait_s: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return int(self.process.wait(wait_s))
        return None


def _spawn(rank: int, control_fds: tuple[int, ...] = ()) -> _Rank:
    """Start one engine process with its command and message pipes (and the ends of the control
    pipes it inherits)."""
    command_read, command_write = os.pipe()
    output_read, output_write = os.pipe()
    _widen(output_write)
    command = [
        sys.executable,
        "-m",
        "mcore_inference.serve.engine_child",
        str(command_read),
        str(output_write),
        str(os.getpid()),
    ]
    process = subprocess.Popen(
        command, pass_fds=(command_read, output_write, *control_fds), stdin=subprocess.DEVNULL
    )
    # Only the child holds these ends now: its death closes the output pipe (EOF here).
    os.close(command_read)
    os.close(output_write)
    return _Rank(
        rank,
        process,
        Connection(command_write, readable=False),
        Connection(output_read, writable=False),
    )


class EngineProcess(LoopFrontend):
    """Runs the engine in a child process (``spec.tp`` of them) and serves requests from an
    asyncio event loop.

    :meth:`launch` starts the processes and waits until their engine is built; :meth:`start`
    (on the event loop) begins reading their messages; :meth:`stop` stops them. Rank 0 runs
    the requests; the other ranks follow it (:mod:`mcore_inference.serve.engine_ranks`).

    Args:
        spec: What the children load.
        max_waiting_requests: Most requests that may wait for a batch slot.
    """

    def __init__(self, spec: EngineSpec, *, max_waiting_requests: int) -> None:
        super().__init__(
            max_batch_size=spec.engine.max_batch_size,
            max_waiting_requests=max_waiting_requests,
            kv_blocks_total=0,
        )
        self.spec = spec
        self.info: EngineInfo | None = None
        self._ranks: list[_Rank] = []
        self._process: Any = None
        self._commands: Connection | None = None
        self._output: Connection | None = None
        self._store: str | None = None
        self._handles: dict[int, RequestHandle] = {}
        self._keys: dict[RequestHandle, int] = {}
        self._next_key = itertools.count()
        self._reading = False
        self._send_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """Rank 0's process id (None before :meth:`launch`)."""
        return None if self._process is None else self._process.pid

    @property
    def pids(self) -> list[int]:
        """The process id of every rank, rank 0 first (empty before :meth:`launch`)."""
        return [rank.process.pid for rank in self._ranks]

    @property
    def running(self) -> bool:
        """True while the children serve requests."""
        return (
            self._reading
            and self._process is not None
            and self._process.poll() is None
            and not self._stopping
            and self._failure is None
        )

    def rank_kv_blocks_used(self) -> list[int]:
        """KV blocks held on each rank (rank 0's from its latest step, the others' as they
        last reported them).

        Returns:
            One count per rank.
        """
        return [self._stats.kv_blocks_used] + [rank.kv_blocks_used for rank in self._ranks[1:]]

    def launch(self, timeout: float = 600.0) -> EngineInfo:
        """Start the child processes and wait until their engine is built.

        Args:
            timeout: Seconds to wait for the engine.

        Returns:
            The engine's sizes (with every rank's process and device).

        Raises:
            EngineProcessError: If a child failed to load the model, died or took longer
                than ``timeout`` (every child is then ended).
            RuntimeError: If it was launched before.
        """
        if self._process is not None:
            raise RuntimeError("the engine process was already launched")
        tp = self.spec.tp
        # One control pipe from rank 0 to each other rank (engine_ranks.ControlChannel).
        pipes = [os.pipe() for _ in range(tp - 1)]
        control_fds = [tuple(w for _, w in pipes)] + [(r,) for r, _ in pipes]
        if tp > 1:
            self._store = tempfile.mkdtemp(prefix="mcore-serve-ranks-")
        try:
            self._ranks = [_spawn(rank, control_fds[rank]) for rank in range(tp)]
        finally:
            for ends in pipes:  # the ranks hold them now
                for end in ends:
                    os.close(end)
        first = self._ranks[0]
        self._process, self._commands, self._output = first.process, first.commands, first.output
        for rank in self._ranks:
            placement = None
            if self._store is not None:
                store = os.path.join(self._store, "store")
                placement = RankPlacement(
                    rank=rank.rank, world_size=tp, store=store, control_fds=control_fds[rank.rank]
                )
            with contextlib.suppress(OSError):
                rank.commands.send((self.spec, placement))
        infos = self._wait_until_ready(timeout)
        info = dataclasses.replace(
            infos[0],
            pids=tuple(info.pid for info in infos),
            devices=tuple(info.device for info in infos),
        )
        self.info = info
        self._stats = LoopStats(kv_blocks_total=info.kv_blocks)
        return info

    def _wait_until_ready(self, timeout: float) -> list[EngineInfo]:
        """Every rank's ready message, in rank order; the first failure ends them all."""
        infos: dict[int, EngineInfo] = {}
        pending = {rank.output: rank for rank in self._ranks}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                self._end_all()
                raise EngineProcessError(f"the engine process did not start within {timeout} s")
            for output in ready:
                assert isinstance(output, Connection)
                rank = pending.pop(output)
                try:
                    message = output.recv()
                except EOFError:
                    status = rank.exit_status(10)
                    self._end_all()
                    which = f" (rank {rank.rank})" if len(self._ranks) > 1 else ""
                    raise EngineProcessError(
                        f"the engine process{which} exited with status {status} while loading "
                        f"{self.spec.model!r}"
                    ) from None
                if message[0] != "ready":
                    rank.exit_status(10)
                    self._end_all()
                    raise EngineProcessError(message[1])
                infos[rank.rank] = message[1]
        return [infos[rank] for rank in range(len(self._ranks))]

    def start(self) -> None:
        """Begin reading the children's messages; call it from the event loop that will submit.

        Raises:
            RuntimeError: If it was not launched or was started before.
        """
        if self._output is None or self.info is None:
            raise RuntimeError("launch() the engine process before starting it")
        if self._reading:
            raise RuntimeError("the engine process was already started")
        self._event_loop = loop = asyncio.get_running_loop()
        loop.add_reader(self._output.fileno(), self._on_readable)
        for rank in self._ranks[1:]:
            loop.add_reader(rank.output.fileno(), self._on_follower_readable, rank)
        self._reading = True

    def _send(self, message: Any) -> None:
        assert self._commands is not None
        # A child that is gone is reported by the output pipe's EOF. The lock keeps the stop
        # message (sent from the shutdown's worker thread) whole next to the event loop's.
        with self._send_lock, contextlib.suppress(OSError):
            self._commands.send(message)

    def _send_adds(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            key = next(self._next_key)
            self._handles[key], self._keys[handle] = handle, key
            self._send(("add", key, handle.prompt, handle.params))

    def _send_abort(self, handle: RequestHandle) -> None:
        key = self._keys.pop(handle, None)
        if key is not None:
            del self._handles[key]
            self._send(("abort", key))

    def _on_readable(self) -> None:
        """Take every message waiting in rank 0's pipe, then wake the handlers once."""
        output = self._output
        assert output is not None
        try:
            while output.poll():
                message = output.recv()
                if message[0] == "step":
                    self._on_step(*message[1:])
                elif message[0] == "failed":
                    self._fail(self._blame(message[1]))
        except (EOFError, OSError):
            self._on_exit()

    def _on_follower_readable(self, rank: _Rank) -> None:
        """Messages of a rank other than 0: its KV blocks, a failure, or its exit."""
        try:
            while rank.output.poll():
                message = rank.output.recv()
                if message[0] == "blocks":
                    rank.kv_blocks_used = message[2]
                elif message[0] == "failed":
                    self._fail(message[1])
        except (EOFError, OSError):
            assert self._event_loop is not None
            self._event_loop.remove_reader(rank.output.fileno())
            if not self._stopping and self._failure is None:
                status = rank.exit_status(1)
                self._fail(
                    f"engine rank {rank.rank} of tp={len(self._ranks)} (process "
                    f"{rank.process.pid}) exited unexpectedly (status {status})"
                )

    def _on_step(
        self, single_keys: bytes, single_tokens: bytes, updates: list[_Update], stats: LoopStats
    ) -> None:
        handles = self._handles
        new_tokens = len(single_keys) // 8
        for key, token in zip(
            memoryview(single_keys).cast("q"), memoryview(single_tokens).cast("q")
        ):
            handle = handles.get(key)
            if handle is not None and not handle.finished:
                handle.tokens.append(token)
                handle.notify.set()
        for key, tokens, logprobs, result in updates:
            new_tokens += len(tokens)
            handle = handles.get(key)
            if handle is None:
                continue
            if result is not None:
                del handles[key], self._keys[handle]
            self._apply(handle, tokens, logprobs, result)
        self._count_tokens(new_tokens)
        self._stats = stats

    def _blame(self, message: str) -> str:
        """Rank 0's failure, naming the other rank that died first when one did (rank 0 then
        fails in a collective with it: the dead rank is the cause worth reporting)."""
        if len(self._ranks) < 2:
            return message
        deadline = time.monotonic() + _BLAME_WAIT_S
        while True:
            for rank in self._ranks[1:]:
                if rank.process.poll() is not None:
                    return (
                        f"engine rank {rank.rank} of tp={len(self._ranks)} (process "
                        f"{rank.process.pid}) exited unexpectedly (status "
                        f"{rank.process.returncode}); rank 0 then failed: {message}"
                    )
            if time.monotonic() >= deadline:
                return message
            time.sleep(0.01)

    def _fail(self, message: str) -> None:
        """The engine failed: fail the open requests (with the first failure's message); with
        several ranks end them all (the others could wait for a failed one in a collective for
        ever)."""
        if self._failure is None:
            self._failure = message
        self._fail_open(self._failure)
        if len(self._ranks) > 1:
            for rank in self._ranks:
                if rank.process.poll() is None:
                    rank.process.kill()

    def _on_exit(self) -> None:
        assert self._event_loop is not None and self._output is not None
        self._event_loop.remove_reader(self._output.fileno())
        self._reading = False
        if not self._stopping and self._failure is None:
            status = self._ranks[0].exit_status(1)
            which = " (rank 0)" if len(self._ranks) > 1 else ""
            self._fail(
                self._blame(f"the engine process{which} exited unexpectedly (status {status})")
            )
        self._fail_open(self._failure or "the server is shutting down")

    def _fail_open(self, message: str) -> None:
        for key, handle in list(self._handles.items()):
            self._apply(handle, [], None, self._failed_result(handle.prompt, key, message))
        self._handles.clear()
        self._keys.clear()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the children (they abort what is left and release the GPU) and wait for them.

        Idempotent; a child still alive after ``timeout`` is killed. Requests still open
        fail with "the server is shutting down".

        Args:
            timeout: Seconds to wait for the children; None waits as long as it takes.
        """
        self._stopping = True
        if self._process is None:
            return
        if self._commands is not None and not self._commands.closed:
            self._send(None)
            with self._send_lock:
                self._commands.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank in self._ranks:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.process.wait(left)
        self._end_all()
        loop = self._event_loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._fail_open, "the server is shutting down")

    def _end_all(self) -> None:
        """Kill the children still running, wait for them, close the pipes of the other ranks
        and remove the ranks' store."""
        for rank in self._ranks:
            if rank.process.poll() is None:
                rank.process.kill()
                rank.process.wait(10)
        for rank in self._ranks:
            with self._send_lock:
                rank.commands.close()
        if self._store is not None:
            shutil.rmtree(self._store, ignore_errors=True)

    def __repr__(self) -> str:
        return f"EngineProcess(pids={self.pids}, running={self.running}, stats={self._stats})"
