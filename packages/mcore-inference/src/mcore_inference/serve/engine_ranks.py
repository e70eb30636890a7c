"""The ranks of a tensor-parallel engine (``serve --tp N``) and the channel that keeps them in step.

The server starts ``N`` engine processes, all children of the server process. Rank ``r`` runs
on ``cuda:r`` (NCCL) or on the CPU (gloo); the ranks meet through a file store in a directory
the server made, build a ``ParallelState`` with ``tp=N`` and load their slices of the
checkpoint. Rank 0 talks to the server exactly as the single engine process does; the other
ranks (the followers) only listen to rank 0.

An engine replica of several ranks must be given the same requests in the same order and run
the same steps (``InferenceEngine`` agrees on new requests and broadcasts the sampled tokens
itself). So at each iteration of its loop, before it adds requests or steps, rank 0 sends each
follower one :class:`ControlChannel` message: the requests it aborted since the last message
and the requests it now adds (an empty message for a plain step). Every follower applies the
same aborts and adds and then steps exactly when rank 0 does (when its engine has unfinished
work, which is the same on every rank).

The channel is one pipe from rank 0 to each follower, made by the server before it starts the
ranks, rather than a collective over a process group: a collective's send waits for the
receiver to reach it (a round trip on rank 0's critical path at every step: 0.6 ms per step
measured against 2 us for a pipe write, two gloo processes on a busy 2-core machine), while a
pipe write returns at once. A follower with nothing to do blocks in the pipe's read: no CPU
and no timeout however long the server idles. A follower whose rank 0 died reads the end of
the pipe and stops; a rank 0 whose follower died gets a broken pipe.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = [
    "ControlChannel",
    "ControlMessage",
    "RankPlacement",
    "apply_message",
    "follow",
    "join_ranks",
    "leave_ranks",
    "rank_device",
]

_STOP = b"S"
"""The message that tells the followers to stop (a pickled message starts with 0x80)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ControlMessage:
    """What rank 0 did since its previous message, in the order the followers apply it."""

    aborts: tuple[int, ...] = ()
    """Engine request ids rank 0 aborted (applied first; ``abort`` is local on every rank)."""
    adds: tuple[tuple[list[int], Any], ...] = ()
    """``(prompt, SamplingParams)`` of the requests added next, in one ``add_requests`` call
    (the engine checks that every rank was given the same ones)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RankPlacement:
    """Where one engine rank runs and how it finds the others."""

    rank: int
    """This rank (0 answers the server)."""
    world_size: int
    """Number of ranks (the tensor-parallel size)."""
    store: str
    """File of the ranks' ``torch.distributed`` store (in a directory the server removes)."""
    control_fds: tuple[int, ...]
    """Inherited ends of the control pipes: rank 0 the write end of one pipe per follower (in
    rank order), a follower the read end of its own."""


def rank_device(device: str, rank: int, world_size: int) -> str:
    """The device of one rank: ``cuda:rank`` when the engine runs on CUDA, else ``device``.

    Args:
        device: The server's device (``cuda`` or ``cpu``; ``cuda:k`` only with one rank).
        rank: The rank.
        world_size: Number of ranks.

    Returns:
        The rank's device string.
    """
    if world_size > 1 and device.startswith("cuda"):
        return f"cuda:{rank}"
    return device


def join_ranks(placement: RankPlacement, device: str) -> tuple[ParallelState, ControlChannel]:
    """Join the other ranks: the default group, the ``tp`` layout, and the control channel.

    Args:
        placement: This rank, the store and the control pipes.
        device: This rank's device (NCCL on CUDA, gloo on the CPU).

    Returns:
        The ``ParallelState`` (``tp = world_size``) and the control channel.
    """
    from mcore_parallel import initialize

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
        os.environ["LOCAL_RANK"] = str(torch.device(device).index or 0)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{placement.store}",
        rank=placement.rank,
        world_size=placement.world_size,
    )
    state = initialize(tp=placement.world_size)
    return state, ControlChannel.of(placement)


def leave_ranks(state: ParallelState) -> None:
    """Destroy the process groups (best effort: a peer may be gone already).

    Args:
        state: The state :func:`join_ranks` returned.
    """
    with contextlib.suppress(Exception):
        state.destroy()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


class ControlChannel:
    """Rank 0's messages to the followers, one pipe per follower.

    A message is the pickled :class:`ControlMessage` when it holds aborts or adds, an empty
    byte string for a plain step, and ``b"S"`` for stop.

    Args:
        rank: This process's rank (0 sends, the others receive).
        connections: Rank 0: the write end of each follower's pipe; a follower: the read end
            of its own.
    """

    def __init__(self, rank: int, connections: list[Connection]) -> None:
        self.rank = rank
        self.connections = connections

    @classmethod
    def of(cls, placement: RankPlacement) -> ControlChannel:
        """The channel over the pipe ends a rank inherited from the server.

        Args:
            placement: The rank and its ``control_fds``.

        Returns:
            The channel.
        """
        sending = placement.rank == 0
        return cls(
            placement.rank,
            [
                Connection(fd, readable=not sending, writable=sending)
                for fd in placement.control_fds
            ],
        )

    def send(self, message: ControlMessage | None) -> None:
        """Send a message to every follower (rank 0; None tells them to stop).

        Args:
            message: What the followers apply next, or None.

        Raises:
            BrokenPipeError: If a follower is gone.
        """
        if message is None:
            payload = _STOP
        elif message.aborts or message.adds:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            payload = b""
        for connection in self.connections:
            connection.send_bytes(payload)

    def receive(self) -> ControlMessage | None:
        """Wait for rank 0's next message (a follower).

        Returns:
            The message (empty for a plain step), or None to stop.

        Raises:
            EOFError: If rank 0 is gone.
        """
        payload = self.connections[0].recv_bytes()
        if not payload:
            return _EMPTY_MESSAGE
        if payload == _STOP:
            return None
        message: ControlMessage = pickle.loads(payload)
        return message

    def close(self) -> None:
        """Close this rank's pipe ends."""
        for connection in self.connections:
            connection.close()


_EMPTY_MESSAGE = ControlMessage()


def apply_message(engine: Any, message: ControlMessage) -> None:
    """Apply rank 0's aborts and adds to this rank's engine, in rank 0's order.

    Args:
        engine: This rank's :class:`~mcore_inference.InferenceEngine`.
        message: The message.

    """
    for request_id in message.aborts:
        engine.abort(request_id)
    if message.adds:
        engine.add_requests(
            [prompt for prompt, _ in message.adds], [params for _, params in message.adds]
        )


def follow(engine: Any, control: ControlChannel, output: Connection) -> None:
    """A follower's loop: apply each message of rank 0, then step when rank 0 does.

    After a step that followed a message with work in it, and whenever its engine runs out of
    work, the follower tells the server how many KV blocks it holds (``/metrics`` shows every
    rank's), so a request aborted on rank 0 can be seen freed on every rank.

    Args:
        engine: This rank's engine.
        control: The control channel (receiving end).
        output: Pipe to the server (``("blocks", rank, used)`` messages).
    """
    from mcore_inference.serve.engine_loop import engine_stats

    steps = 0
    busy = False
    while True:
        message = control.receive()
        if message is None:
            return
        apply_message(engine, message)
        report = bool(message.aborts or message.adds)
        if engine.has_unfinished():
            engine.step_updates(check_weights=steps == 0)
            steps += 1
            busy = True
        if busy and not engine.has_unfinished():
            busy, report = False, True
        if report:
            output.send(("blocks", control.rank, engine_stats(engine, 0, steps).kv_blocks_used))
