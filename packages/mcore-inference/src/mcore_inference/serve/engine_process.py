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
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import gc
import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mcore_inference.config import InferenceConfig
from mcore_inference.request import GenerationResult
from mcore_inference.serve.engine_loop import LoopFrontend, LoopStats, RequestHandle, engine_stats

__all__ = ["EngineInfo", "EngineProcess", "EngineProcessError", "EngineSpec", "child_main"]

_PR_SET_PDEATHSIG = 1
_PIPE_BYTES = 1 << 20
"""Capacity asked for the message pipe: the engine blocks only when the server is this far
behind (the server takes every waiting message at each wake-up)."""


class EngineProcessError(RuntimeError):
    """The engine process could not start (the checkpoint did not load, or it died)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSpec:
    """What the child process loads and how it builds its engine."""

    model: str
    """Hugging Face checkpoint directory."""
    device: str
    """Device of the model and the KV cache (``cuda``, ``cuda:1``, ``cpu``)."""
    dtype: str | None
    """Parameter dtype; None keeps the checkpoint's."""
    engine: InferenceConfig
    """The engine's configuration."""
    admission_window_ms: float = 0.0
    """Milliseconds that requests arriving while others run are held, to join the batch
    together (0 admits each at once)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineInfo:
    """Sizes of a built engine and its model (for the startup line and request checks)."""

    parameters: int
    """Parameter count of the model."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Hidden size."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads."""
    vocab_size: int
    """Vocabulary size."""
    dtype: str
    """Parameter dtype (``bfloat16``)."""
    device: str
    """Device of the parameters."""
    kv_blocks: int
    """KV-cache blocks that can be handed out."""
    max_batch_size: int
    """The engine's ``max_batch_size``."""
    pid: int
    """Process that runs the engine."""

    @classmethod
    def of(cls, engine: Any, pid: int) -> EngineInfo:
        """Describe an engine.

        Args:
            engine: An :class:`~mcore_inference.InferenceEngine`.
            pid: The process that runs it.

        Returns:
            Its sizes.
        """
        model = engine.model
        config = model.config
        parameter = next(model.parameters())
        return cls(
            parameters=sum(p.numel() for p in model.parameters()),
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=config.num_kv_heads,
            vocab_size=config.vocab_size,
            dtype=str(parameter.dtype).removeprefix("torch."),
            device=str(parameter.device),
            kv_blocks=engine.allocator.capacity,
            max_batch_size=engine.config.max_batch_size,
            pid=pid,
        )


# Messages. Server -> child: ("add", key, prompt, params) | ("abort", key) | None (stop).
# Child -> server: ("ready", EngineInfo) | ("step", keys, tokens, updates, stats) |
# ("failed", message). A step's requests that got exactly one token, without log-probs, and go
# on (nearly all of them, at every step) come packed: ``keys`` and ``tokens`` are the bytes of
# two int64 arrays (one request per entry), so a step's message costs no per-request pickling;
# every other request is an update (key, new_tokens, new_logprobs, final result or None).
_Update = tuple[int, list[int], list[float] | None, GenerationResult | None]


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (best effort elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _widen(descriptor: int) -> None:
    """Give a pipe room for many steps' messages (Linux; the default holds 64 KiB)."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(descriptor, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)


def _read_commands(connection: Connection, commands: queue.SimpleQueue[Any]) -> None:
    """Forward the server's commands to the engine thread; a closed pipe means stop."""
    try:
        while True:
            command = connection.recv()
            commands.put(command)
            if command is None:
                return
    except (EOFError, OSError):
        commands.put(None)


def child_main(commands_end: Connection, output: Connection, parent: int) -> None:
    """Entry point of the engine process: build the engine, then serve until told to stop.

    Args:
        commands_end: Read end of the command pipe (the first message is the
            :class:`EngineSpec`).
        output: Write end of the message pipe.
        parent: Process id of the server (the process exits at once if it is gone).
    """
    _die_with_parent()
    if os.getppid() != parent:
        return  # the server died before the death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mcore_inference.engine import InferenceEngine
    from mcore_models import GPTModel

    try:
        spec: EngineSpec = commands_end.recv()
    except (EOFError, OSError):
        return
    try:
        model = GPTModel.from_hf(spec.model, dtype=spec.dtype, device=spec.device).eval()
        engine = InferenceEngine(model, spec.engine)
        engine.capture_graphs()
    except Exception as exc:
        output.send(("failed", f"loading {spec.model!r} failed: {type(exc).__name__}: {exc}"))
        return
    # The model, engine and graphs live as long as the process: out of the collector's
    # generations, the full collections that per-step garbage triggers do not walk them.
    gc.collect()
    gc.freeze()
    output.send(("ready", EngineInfo.of(engine, os.getpid())))
    commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
    reader = threading.Thread(
        target=_read_commands, args=(commands_end, commands), name="mcore-engine-commands"
    )
    reader.daemon = True
    reader.start()
    with engine:
        _serve(engine, commands, output, spec.admission_window_ms / 1e3)


def _serve(
    engine: Any, commands: queue.SimpleQueue[Any], output: Connection, window: float = 0.0
) -> None:
    """The child's engine loop: commands, one step, one message with its updates.

    Requests that arrive while others run are held for up to ``window`` seconds (counted from
    the first one held) and then admitted together, so that a burst of arrivals costs one
    prefill step rather than one per engine step it is spread over.
    """
    ids: dict[int, int] = {}  # server key -> engine request id
    keys: dict[int, int] = {}  # engine request id -> server key
    held: dict[int, tuple[list[int], Any]] = {}  # server key -> request not admitted yet
    held_since = 0.0
    generated = steps = 0

    def admit(key: int, prompt: list[int], params: Any) -> None:
        request_id = engine.add_request(prompt, params)
        ids[key], keys[request_id] = request_id, key

    try:
        while True:
            busy = engine.has_unfinished()
            command = _poll(commands) if busy or held else commands.get()
            changed = False
            while command is not _EMPTY:
                if command is None:
                    return  # asked to stop, or the server is gone
                changed = True
                if command[0] == "add":
                    _, key, prompt, params = command
                    if window > 0 and busy:
                        if not held:
                            held_since = time.monotonic()
                        held[key] = (prompt, params)
                    else:
                        admit(key, prompt, params)
                elif held.pop(command[1], None) is None:
                    request_id = ids.pop(command[1], -1)
                    if request_id >= 0:
                        del keys[request_id]
                        engine.abort(request_id)
                command = _poll(commands)
            if held and (not engine.has_unfinished() or time.monotonic() - held_since >= window):
                for key, (prompt, params) in held.items():
                    admit(key, prompt, params)
                held.clear()
            if not engine.has_unfinished():
                if changed:
                    output.send(("step", b"", b"", [], engine_stats(engine, generated, steps)))
                continue
            # The weights are this process's own and never change: checked at the first step only.
            step = engine.step_updates(check_weights=steps == 0)
            steps += 1
            single_keys, single_tokens = array("q"), array("q")
            updates: list[_Update] = []
            for update in step:
                new_tokens = update.new_tokens
                generated += len(new_tokens)
                key = keys.get(update.request_id)
                if key is None:  # aborted by the server: nobody waits for it
                    continue
                if update.result is not None:
                    del keys[update.request_id], ids[key]
                elif len(new_tokens) == 1 and update.new_logprobs is None:
                    single_keys.append(key)
                    single_tokens.append(new_tokens[0])
                    continue
                updates.append((key, new_tokens, update.new_logprobs, update.result))
            stats = engine_stats(engine, generated, steps)
            output.send(("step", single_keys.tobytes(), single_tokens.tobytes(), updates, stats))
    except OSError:
        return  # the server is gone (broken pipe)
    except Exception as exc:  # the engine broke: say why, the server fails the open requests
        with contextlib.suppress(OSError):
            output.send(("failed", f"engine loop failed: {type(exc).__name__}: {exc}"))


_EMPTY = ("empty",)


def _poll(commands: queue.SimpleQueue[Any]) -> Any:
    """The next queued command (None: stop), or ``_EMPTY``."""
    try:
        return commands.get_nowait()
    except queue.Empty:
        return _EMPTY


class EngineProcess(LoopFrontend):
    """Runs the engine in a child process and serves requests from an asyncio event loop.

    :meth:`launch` starts the process and waits until its engine is built; :meth:`start`
    (on the event loop) begins reading its messages; :meth:`stop` stops it.

    Args:
        spec: What the child loads.
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
        self._process: Any = None
        self._commands: Connection | None = None
        self._output: Connection | None = None
        self._handles: dict[int, RequestHandle] = {}
        self._keys: dict[RequestHandle, int] = {}
        self._next_key = itertools.count()
        self._reading = False
        self._send_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The child's process id (None before :meth:`launch`)."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        """True while the child serves requests."""
        return (
            self._reading
            and self._process is not None
            and self._process.poll() is None
            and not self._stopping
            and self._failure is None
        )

    def launch(self, timeout: float = 600.0) -> EngineInfo:
        """Start the child process and wait until it has built its engine.

        Args:
            timeout: Seconds to wait for the engine.

        Returns:
            The engine's sizes.

        Raises:
            EngineProcessError: If the child failed to load the model, died or took longer
                than ``timeout``.
            RuntimeError: If it was launched before.
        """
        if self._process is not None:
            raise RuntimeError("the engine process was already launched")
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
            command, pass_fds=(command_read, output_write), stdin=subprocess.DEVNULL
        )
        # Only the child holds these ends now: its death closes the output pipe (EOF here).
        os.close(command_read)
        os.close(output_write)
        self._process = process
        self._commands = Connection(command_write, readable=False)
        self._output = output = Connection(output_read, writable=False)
        self._send(self.spec)
        if not output.poll(timeout):
            self._kill()
            raise EngineProcessError(f"the engine process did not start within {timeout} s")
        try:
            message = output.recv()
        except EOFError:
            raise EngineProcessError(
                f"the engine process exited with status {process.wait(10)} while loading "
                f"{self.spec.model!r}"
            ) from None
        if message[0] != "ready":
            process.wait(10)
            raise EngineProcessError(message[1])
        info: EngineInfo = message[1]
        self.info = info
        self._stats = LoopStats(kv_blocks_total=info.kv_blocks)
        return info

    def start(self) -> None:
        """Begin reading the child's messages; call it from the event loop that will submit.

        Raises:
            RuntimeError: If it was not launched or was started before.
        """
        if self._output is None or self.info is None:
            raise RuntimeError("launch() the engine process before starting it")
        if self._reading:
            raise RuntimeError("the engine process was already started")
        self._event_loop = asyncio.get_running_loop()
        self._event_loop.add_reader(self._output.fileno(), self._on_readable)
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
        """Take every message waiting in the pipe, then wake the handlers once."""
        output = self._output
        assert output is not None
        try:
            while output.poll():
                message = output.recv()
                if message[0] == "step":
                    self._on_step(*message[1:])
                elif message[0] == "failed":
                    self._failure = message[1]
                    self._fail_open(message[1])
        except (EOFError, OSError):
            self._on_exit()

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

    def _on_exit(self) -> None:
        assert self._event_loop is not None and self._output is not None
        self._event_loop.remove_reader(self._output.fileno())
        self._reading = False
        if not self._stopping and self._failure is None:
            code = None
            if self._process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self._process.wait(1)
            self._failure = f"the engine process exited unexpectedly (status {code})"
        self._fail_open(self._failure or "the server is shutting down")

    def _fail_open(self, message: str) -> None:
        for key, handle in list(self._handles.items()):
            self._apply(handle, [], None, self._failed_result(handle.prompt, key, message))
        self._handles.clear()
        self._keys.clear()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the child (it aborts what is left and releases the GPU) and wait for it.

        Idempotent; a child still alive after ``timeout`` is killed. Requests still open
        fail with "the server is shutting down".

        Args:
            timeout: Seconds to wait for the child; None waits as long as it takes.
        """
        self._stopping = True
        if self._process is None:
            return
        if self._commands is not None and not self._commands.closed:
            self._send(None)
            with self._send_lock:
                self._commands.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout)
        self._kill()
        loop = self._event_loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._fail_open, "the server is shutting down")

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(10)

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, running={self.running}, stats={self._stats})"
