"""The engine process's side: build the engine, then run it for the server (or follow rank 0).

Started by :class:`~mcore_inference.serve.engine_process.EngineProcess` through
:mod:`mcore_inference.serve.engine_child`. The server side of the pipes and the reasons for the
design are in :mod:`mcore_inference.serve.engine_process`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import queue
import signal
import sys
import threading
import time
from array import array
from multiprocessing.connection import Connection
from typing import Any

from mcore_inference.request import GenerationResult
from mcore_inference.serve.engine_loop import engine_stats
from mcore_inference.serve.engine_ranks import (
    ControlChannel,
    ControlMessage,
    RankPlacement,
    follow,
    join_ranks,
    leave_ranks,
    rank_device,
)
from mcore_inference.serve.engine_spec import EngineInfo, EngineSpec

__all__ = ["child_main"]

_PR_SET_PDEATHSIG = 1

# Messages. Server -> child: (EngineSpec, RankPlacement | None) first, then to rank 0
# ("add", key, prompt, params) | ("abort", key) | None (stop). Child -> server:
# ("ready", EngineInfo) | ("step", keys, tokens, updates, stats) | ("failed", message), and from
# the other ranks ("blocks", rank, kv_blocks_used). A step's requests that got exactly one
# token, without log-probs, and go on (nearly all of them, at every step) come packed: ``keys``
# and ``tokens`` are the bytes of two int64 arrays (one request per entry), so a step's message
# costs no per-request pickling; every other request is an update (key, new_tokens,
# new_logprobs, final result or None).
_Update = tuple[int, list[int], list[float] | None, GenerationResult | None]


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (best effort elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


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


def _exit_when_closed(connection: Connection) -> None:
    """A follower rank's watch on its command pipe: the server closing it (or dying) ends it."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            connection.recv()
    os._exit(0)


def child_main(commands_end: Connection, output: Connection, parent: int) -> None:
    """Entry point of an engine process: build the engine, then serve until told to stop.

    Args:
        commands_end: Read end of the command pipe (the first message is the
            :class:`EngineSpec` and the :class:`~mcore_inference.serve.engine_ranks.RankPlacement`,
            None for a single process).
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
        spec: EngineSpec
        placement: RankPlacement | None
        spec, placement = commands_end.recv()
    except (EOFError, OSError):
        return
    state: Any = None
    control: ControlChannel | None = None
    rank = placement.rank if placement is not None else 0
    where = f"rank {rank} of tp={spec.tp}: " if placement is not None else ""
    try:
        device = spec.device
        if placement is not None:
            device = rank_device(spec.device, rank, placement.world_size)
            state, control = join_ranks(placement, device)
        model = GPTModel.from_hf(spec.model, state=state, dtype=spec.dtype, device=device).eval()
        engine = InferenceEngine(model, spec.engine, state=state)
        engine.capture_graphs()
    except Exception as exc:
        output.send(
            ("failed", f"{where}loading {spec.model!r} failed: {type(exc).__name__}: {exc}")
        )
        return
    # The model, engine and graphs live as long as the process: out of the collector's
    # generations, the full collections that per-step garbage triggers do not walk them.
    gc.collect()
    gc.freeze()
    output.send(("ready", EngineInfo.of(engine, os.getpid())))
    if control is not None and rank > 0:
        watch = threading.Thread(
            target=_exit_when_closed, args=(commands_end,), name="mcore-engine-watch"
        )
        watch.daemon = True
        watch.start()
        try:
            with engine:
                follow(engine, control, output)
        except EOFError:  # rank 0 is gone: the server reports why
            with contextlib.suppress(OSError):
                output.send(("failed", f"{where}rank 0 exited while this rank followed it"))
            return
        except Exception as exc:  # this rank's engine broke
            with contextlib.suppress(OSError):
                output.send(("failed", f"{where}{type(exc).__name__}: {exc}"))
            return
        leave_ranks(state)
        return
    commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
    reader = threading.Thread(
        target=_read_commands, args=(commands_end, commands), name="mcore-engine-commands"
    )
    reader.daemon = True
    reader.start()
    with engine:
        stopped = _serve(engine, commands, output, spec.admission_window_ms / 1e3, control)
    if state is not None and stopped:
        leave_ranks(state)


def _serve(
    engine: Any,
    commands: queue.SimpleQueue[Any],
    output: Connection,
    window: float = 0.0,
    control: ControlChannel | None = None,
) -> bool:
    """The child's engine loop: commands, one step, one message with its updates.

    Requests that arrive while others run are held for up to ``window`` seconds (counted from
    the first one held) and then admitted together, so that a burst of arrivals costs one
    prefill step rather than one per engine step it is spread over.

    With ``control`` (rank 0 of several), every iteration that adds requests, aborts some or
    steps first sends the other ranks what it is about to do, so that they add, abort and step
    in the same order.

    Returns:
        True when the server asked it to stop, False when the server is gone or the engine
        failed (the failure was reported).
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
            adds: dict[int, tuple[list[int], Any]] = {}  # server key -> request admitted now
            aborts: list[int] = []
            while command is not _EMPTY:
                if command is None:  # asked to stop, or the server is gone
                    if control is not None:
                        control.send(None)
                    return True
                changed = True
                if command[0] == "add":
                    _, key, prompt, params = command
                    if window > 0 and busy:
                        if not held:
                            held_since = time.monotonic()
                        held[key] = (prompt, params)
                    elif control is None:  # one rank: admitted at once, as it arrives
                        admit(key, prompt, params)
                    else:  # several: added after the others were told, all in one call
                        adds[key] = (prompt, params)
                elif held.pop(command[1], None) is None and adds.pop(command[1], None) is None:
                    request_id = ids.pop(command[1], -1)
                    if request_id >= 0:
                        del keys[request_id]
                        engine.abort(request_id)
                        aborts.append(request_id)
                command = _poll(commands)
            if held and (not engine.has_unfinished() or time.monotonic() - held_since >= window):
                if control is None:
                    for key, (prompt, params) in held.items():
                        admit(key, prompt, params)
                else:
                    adds.update(held)
                held.clear()
            if control is not None and (adds or aborts or engine.has_unfinished()):
                control.send(ControlMessage(aborts=tuple(aborts), adds=tuple(adds.values())))
            if adds:
                new_ids = engine.add_requests(
                    [prompt for prompt, _ in adds.values()], [params for _, params in adds.values()]
                )
                for key, request_id in zip(adds, new_ids):
                    ids[key], keys[request_id] = request_id, key
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
        return False  # the server is gone (broken pipe)
    except Exception as exc:  # the engine broke: say why, the server fails the open requests
        with contextlib.suppress(OSError):
            output.send(("failed", f"engine loop failed: {type(exc).__name__}: {exc}"))
        return False


_EMPTY = ("empty",)


def _poll(commands: queue.SimpleQueue[Any]) -> Any:
    """The next queued command (None: stop), or ``_EMPTY``."""
    try:
        return commands.get_nowait()
    except queue.Empty:
        return _EMPTY
