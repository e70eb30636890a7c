"""The one engine loop of the server: a thread that owns the :class:`InferenceEngine`.

Every engine call happens on that thread. HTTP handlers on the asyncio event loop hand it
commands (add these requests, abort that one) through a queue; after each engine step the thread
posts the step's updates (``InferenceEngine.step_updates``: the new tokens of each request, its
result once finished) back to the event loop in one call, which appends them to the requests'
handles. A handler that falls behind finds several new tokens at its next wake-up and sends
them together: nothing queues up per token.

Back-pressure: the open requests beyond ``max_batch_size`` (those that cannot hold a batch slot,
whether the engine already has them or they are still in the command queue) are counted; a
submission that would push the count past ``max_waiting_requests`` is refused with :class:`QueueFullError` instead of growing the queue without bound.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mcore_inference.config import SamplingParams
from mcore_inference.engine import InferenceEngine
from mcore_inference.request import FinishReason, GenerationResult, RequestStatus, TokenUpdate

__all__ = [
    "EngineLoop",
    "EngineLoopStoppedError",
    "LoopFrontend",
    "LoopStats",
    "QueueFullError",
    "RequestHandle",
    "engine_stats",
]

_THROUGHPUT_WINDOW_S = 10
"""Whole seconds over which :meth:`LoopFrontend.generation_tokens_per_second` averages."""
_MAX_CATCH_UP_S = 0.05
"""Longest wait of the engine thread for the event loop to take the previous batch."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting for a batch slot; the client should retry later."""


class EngineLoopStoppedError(RuntimeError):
    """The engine loop is not running (not started, shutting down, or failed)."""


@dataclass(kw_only=True, slots=True, eq=False)
class RequestHandle:
    """The server-side end of one engine request (owned by the event loop).

    The engine thread never touches these fields directly: it posts updates that the event
    loop appends here before setting :attr:`notify`.
    """

    prompt: list[int]
    """Prompt token ids."""
    params: SamplingParams
    """Sampling parameters."""
    notify: asyncio.Event
    """Set whenever new tokens or the result arrive (shared by the choices of an HTTP request)."""
    tokens: list[int] = field(default_factory=list)
    """Generated tokens so far."""
    logprobs: list[float] = field(default_factory=list)
    """Their log-probabilities (when asked)."""
    result: GenerationResult | None = None
    """The final result once the request finished or failed."""
    finished: bool = False
    """True once the result arrived or the request was aborted by the server."""
    submitted_at: float = field(default_factory=time.perf_counter)
    """When the handler submitted it (``time.perf_counter``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LoopStats:
    """What the engine thread last published (read by ``/metrics`` and back-pressure)."""

    num_waiting: int = 0
    """Requests queued for a batch slot (in the engine or the command queue)."""
    num_running: int = 0
    """Requests holding a batch slot and KV blocks."""
    kv_blocks_used: int = 0
    """KV-cache blocks held by requests."""
    kv_blocks_total: int = 0
    """KV-cache blocks that can be handed out."""
    generation_tokens_total: int = 0
    """Tokens generated since start."""
    steps_total: int = 0
    """Engine steps run since start."""


def engine_stats(engine: InferenceEngine, generated: int, steps: int) -> LoopStats:
    """The statistics of an engine as the loops publish them.

    Args:
        engine: The engine (called on its own thread).
        generated: Tokens generated since start.
        steps: Engine steps since start.

    Returns:
        The statistics.
    """
    capacity = engine.allocator.capacity
    return LoopStats(
        num_waiting=engine.num_waiting,
        num_running=engine.num_active,
        kv_blocks_used=capacity - engine.allocator.num_free,
        kv_blocks_total=capacity,
        generation_tokens_total=generated,
        steps_total=steps,
    )


_Command = tuple[str, RequestHandle]


class LoopFrontend:
    """The event-loop side shared by :class:`EngineLoop` (engine on a thread) and
    :class:`~mcore_inference.serve.engine_process.EngineProcess` (engine in a child process):
    handles, back-pressure, published statistics and the token rate.

    Args:
        max_batch_size: The engine's ``max_batch_size`` (requests beyond it wait).
        max_waiting_requests: Most requests that may wait for a batch slot.
        kv_blocks_total: KV-cache blocks of the engine.
    """

    def __init__(
        self, *, max_batch_size: int, max_waiting_requests: int, kv_blocks_total: int
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_waiting_requests = max_waiting_requests
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._failure: str | None = None
        self._live = 0  # requests submitted and not finished (event-loop side)
        self._stats = LoopStats(kv_blocks_total=kv_blocks_total)
        # Tokens generated per whole second of ``time.monotonic``, the last few seconds.
        self._window: deque[list[int]] = deque()
        self._window_lock = threading.Lock()
        self._started_at = int(time.monotonic())

    @property
    def running(self) -> bool:
        """True while the engine serves requests."""
        raise NotImplementedError

    def start(self) -> None:
        """Begin serving; call it from the event loop that will submit requests."""
        raise NotImplementedError

    def stop(self, timeout: float | None = None) -> None:
        """Stop serving: abort what is left and release the engine (idempotent).

        Args:
            timeout: Seconds to wait for the engine; None waits as long as it takes.
        """
        raise NotImplementedError

    @property
    def failure(self) -> str | None:
        """Why the engine stopped by itself (an engine error), or None."""
        return self._failure

    @property
    def stats(self) -> LoopStats:
        """The latest published statistics."""
        return self._stats

    def rank_kv_blocks_used(self) -> list[int]:
        """KV-cache blocks held on each engine rank (one rank unless tensor-parallel).

        Returns:
            One count per rank, rank 0 first.
        """
        return [self._stats.kv_blocks_used]

    @property
    def num_waiting(self) -> int:
        """Submitted requests without a batch slot yet (as of the latest engine iteration)."""
        return max(0, self._live - self._stats.num_running)

    def submit(
        self, requests: Sequence[tuple[list[int], SamplingParams]], notify: asyncio.Event
    ) -> list[RequestHandle]:
        """Queue requests (all or none) for the engine.

        Args:
            requests: ``(prompt token ids, sampling parameters)`` pairs.
            notify: Event set whenever one of them gets a new snapshot.

        Returns:
            One handle per request, in order.

        Raises:
            EngineLoopStoppedError: If the loop is not running.
            QueueFullError: If they would make more than ``max_waiting_requests`` wait.
        """
        if not self.running:
            raise EngineLoopStoppedError(self._failure or "the engine loop is not running")
        # Counted against the batch size, not against the last published statistics: requests
        # the engine has not picked up yet still get a free slot on its next iteration, so a
        # burst of submissions faster than one engine step is not refused for them.
        slots = self.max_batch_size
        waiting = max(0, self._live - slots)
        if max(0, self._live + len(requests) - slots) > self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are waiting for a batch slot and this one adds "
                f"{len(requests)}; the limit is max_waiting_requests={self.max_waiting_requests}"
            )
        handles = [RequestHandle(prompt=p, params=s, notify=notify) for p, s in requests]
        self._live += len(handles)
        self._send_adds(handles)
        return handles

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request and free its KV blocks (no-op once it finished).

        Args:
            handle: A handle from :meth:`submit`.
        """
        if handle.finished:
            return
        handle.finished = True
        self._live -= 1
        self._send_abort(handle)

    def _send_adds(self, handles: list[RequestHandle]) -> None:
        raise NotImplementedError

    def _send_abort(self, handle: RequestHandle) -> None:
        raise NotImplementedError

    def _apply(
        self,
        handle: RequestHandle,
        new_tokens: list[int],
        new_logprobs: list[float] | None,
        result: GenerationResult | None,
    ) -> None:
        """Append what the engine reported for a handle (on the event loop)."""
        if handle.finished:
            return
        handle.tokens += new_tokens
        if new_logprobs:
            handle.logprobs += new_logprobs
        if result is not None:
            handle.result = result
            handle.finished = True
            self._live -= 1
        handle.notify.set()

    def _count_tokens(self, new_tokens: int) -> None:
        """Add a step's tokens to the throughput window (any thread)."""
        if not new_tokens:
            return
        second = int(time.monotonic())
        with self._window_lock:
            if self._window and self._window[-1][0] == second:
                self._window[-1][1] += new_tokens
            else:
                self._window.append([second, new_tokens])
                if len(self._window) > _THROUGHPUT_WINDOW_S + 1:
                    self._window.popleft()

    def generation_tokens_per_second(self) -> float:
        """Tokens generated per second over the last ten whole seconds (or since start).

        Returns:
            The rate; 0 when idle for ten seconds.
        """
        now = int(time.monotonic())
        span = max(1, min(_THROUGHPUT_WINDOW_S, now - self._started_at))
        with self._window_lock:
            tokens = sum(count for second, count in self._window if now - span <= second < now)
        return tokens / span

    @staticmethod
    def _failed_result(prompt: list[int], request_id: int, message: str) -> GenerationResult:
        return GenerationResult(
            request_id=request_id,
            prompt=prompt,
            tokens=[],
            logprobs=None,
            finish_reason=FinishReason.ERROR,
            status=RequestStatus.FAILED,
            error=message,
        )


class EngineLoop(LoopFrontend):
    """Runs an engine on a thread of its own and serves requests from an asyncio event loop.

    Args:
        engine: The engine; from :meth:`start` on only the loop's thread calls it.
        max_waiting_requests: Most requests that may wait for a batch slot.
    """

    def __init__(self, engine: InferenceEngine, *, max_waiting_requests: int) -> None:
        super().__init__(
            max_batch_size=engine.config.max_batch_size,
            max_waiting_requests=max_waiting_requests,
            kv_blocks_total=engine.allocator.capacity,
        )
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._generated = 0
        self._caught_up = threading.Event()
        self._caught_up.set()

    # ------------------------------------------------------------------ event-loop side

    @property
    def running(self) -> bool:
        """True while the thread serves requests."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
            and self._failure is None
        )

    def start(self) -> None:
        """Start the engine thread; call it from the event loop that will submit requests.

        Raises:
            RuntimeError: If it was started before.
        """
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="mcore-engine-loop", daemon=True)
        self._thread.start()

    def _send_adds(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            self._commands.put(("add", handle))

    def _send_abort(self, handle: RequestHandle) -> None:
        self._commands.put(("abort", handle))

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, stop the thread and close the engine (idempotent).

        Args:
            timeout: Seconds to wait for the thread; None waits as long as it takes.
        """
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()

    def _deliver(self, updates: list[tuple[RequestHandle, TokenUpdate]]) -> None:
        for handle, update in updates:
            self._apply(handle, update.new_tokens, update.new_logprobs, update.result)
        # Runs after the handlers just woken have taken their step (they are ahead in the
        # ready queue): the event loop has caught up with this batch.
        assert self._event_loop is not None
        self._event_loop.call_soon(self._caught_up.set)

    # --------------------------------------------------------------------- engine side

    def _run(self) -> None:
        engine = self.engine
        by_id: dict[int, RequestHandle] = {}
        ids: dict[RequestHandle, int] = {}
        try:
            while self._apply_commands(engine, by_id, ids, block=not engine.has_unfinished()):
                if not engine.has_unfinished():
                    continue
                started = time.perf_counter()
                step = engine.step_updates()
                step_seconds = time.perf_counter() - started
                updates = []
                for update in step:
                    handle = by_id.get(update.request_id)
                    if handle is None:  # aborted by the server: nobody is waiting for it
                        continue
                    if update.result is not None:
                        del by_id[update.request_id], ids[handle]
                    updates.append((handle, update))
                self._publish(engine, step)
                if updates:
                    self._post(updates, catch_up=step_seconds)
        except Exception as exc:  # the engine broke: fail every open request and say why
            self._failure = f"engine loop failed: {type(exc).__name__}: {exc}"
        finally:
            message = self._failure or "the server is shutting down"
            if ids:
                self._post(
                    [
                        (
                            h,
                            TokenUpdate(
                                request_id=i,
                                new_tokens=[],
                                new_logprobs=None,
                                result=self._failed_result(h.prompt, i, message),
                            ),
                        )
                        for h, i in ids.items()
                    ]
                )
                if self._failure is None:
                    for request_id in ids.values():
                        engine.abort(request_id)
                    self._publish(engine, ())

    def _apply_commands(
        self,
        engine: InferenceEngine,
        by_id: dict[int, RequestHandle],
        ids: dict[RequestHandle, int],
        *,
        block: bool,
    ) -> bool:
        """Run the queued commands (waiting for one if ``block``); False once asked to stop."""
        command = self._commands.get() if block else self._next_command()
        changed = False
        while command is not None:
            kind, handle = command
            changed = True
            if kind == "add":
                # NOTE: ``finished`` is written by the event loop; a stale False only means the
                # abort command that follows will undo this add.
                if not handle.finished:
                    request_id = engine.add_request(handle.prompt, handle.params)
                    by_id[request_id], ids[handle] = handle, request_id
            else:
                request_id = ids.pop(handle, -1)
                if request_id >= 0:
                    del by_id[request_id]
                    engine.abort(request_id)
            command = self._next_command()
        if changed:
            self._publish(engine, ())
        return not self._stopping

    def _next_command(self) -> _Command | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _publish(self, engine: InferenceEngine, step: Sequence[TokenUpdate]) -> None:
        new_tokens = sum(len(update.new_tokens) for update in step)
        self._generated += new_tokens
        self._count_tokens(new_tokens)
        self._stats = engine_stats(
            engine, self._generated, self._stats.steps_total + (1 if step else 0)
        )

    def _post(
        self, updates: list[tuple[RequestHandle, TokenUpdate]], *, catch_up: float = 0.0
    ) -> None:
        assert self._event_loop is not None
        # NOTE: a CPU-bound engine thread keeps the GIL for whole switch intervals while the
        # event loop, which gives it up at every socket call, falls further and further behind
        # (tokens reach clients in bursts, seconds late). So before posting batch N + 1 the
        # thread waits, for at most as long as its last step took, until the event loop has
        # taken batch N: the event loop gets at least half of the time, and when it keeps up
        # (the usual case on a GPU, where a step mostly waits on the device without the GIL)
        # its work overlaps the next step and nothing waits.
        self._caught_up.wait(min(catch_up, _MAX_CATCH_UP_S))
        self._caught_up.clear()
        try:
            self._event_loop.call_soon_threadsafe(self._deliver, updates)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._caught_up.set()

    def __repr__(self) -> str:
        return f"EngineLoop(running={self.running}, stats={self._stats})"
