"""The ranks of a tensor-parallel engine (``serve --tp N``) and the channel that keeps them in step.

The server starts ``N`` engine processes, all children of the server process. Rank ``r`` runs
on ``cuda:r`` (NCCL) or on the CPU (gloo); the ranks meet through a file store in a directory
the server made, build a ``ParallelState`` with ``tp=N`` and load their slices of the
checkpoint. Rank 0 talks to the server exactly as the single engine process does; the other
ranks (the followers) only listen to rank 0.

An engine replica of several ranks must be given the same requests in the same order and run
the same steps (``InferenceEngine`` agrees on new requests and broadcasts the sampled tokens
itself). So at each iteration of its loop, before it adds requests or steps, rank 0 sends the
followers one :class:`ControlChannel` message over a gloo group of its own: the requests it
aborted since the last message and the requests it now adds. Every follower applies the same
aborts and adds and then steps exactly when rank 0 does (when its engine has unfinished work,
which is the same on every rank). While the server is idle rank 0 sends an empty message every
:data:`HEARTBEAT_S` seconds, so the followers, blocked in the receive without using the CPU,
never reach the group's timeout however long the server idles.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = [
    "HEARTBEAT_S",
    "ControlChannel",
    "ControlMessage",
    "RankPlacement",
    "apply_message",
    "follow",
    "join_ranks",
    "leave_ranks",
    "rank_device",
]

HEARTBEAT_S = 60.0
"""Seconds between the empty messages rank 0 sends its followers while it has nothing to do."""
_CONTROL_TIMEOUT = timedelta(minutes=30)
"""Timeout of the control group's collectives: far above :data:`HEARTBEAT_S`, so only a rank
0 that stopped sending (it hung or died, and the server then ends every rank) reaches it."""
_STOP = -1
"""Header value of the message that tells the followers to stop."""


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
    """Join the other ranks: the default group, the ``tp`` layout and the control group.

    Args:
        placement: This rank and the store.
        device: This rank's device (NCCL on CUDA, gloo on the CPU).

    Returns:
        The ``ParallelState`` (``tp = world_size``) and the control channel.
    """
    from mcore_parallel import initialize

    if sys.platform.startswith("linux"):
        # Every rank runs on this host: the control group's sockets need only the loopback
        # device, which exists even where the host name resolves to no reachable address.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
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
    group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return state, ControlChannel(group, placement.rank)


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
    """Rank 0's messages to the followers over a gloo group (one broadcast when empty).

    A message is an int64 header (the pickled payload's length; 0: empty, -1: stop) and,
    when not empty, the payload as a uint8 tensor: the steps of a decode-only stretch cost one
    broadcast of eight bytes each.

    Args:
        group: The gloo group of every rank.
        rank: This process's rank (0 sends, the others receive).
    """

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.rank = rank
        self._header = torch.zeros(1, dtype=torch.int64)

    def send(self, message: ControlMessage | None) -> None:
        """Send a message to every follower (rank 0; None tells them to stop).

        Args:
            message: What the followers apply next, or None.
        """
        payload = b""
        if message is None:
            self._header[0] = _STOP
        else:
            if message.aborts or message.adds:
                payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            self._header[0] = len(payload)
        dist.broadcast(self._header, src=0, group=self.group)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.group)

    def receive(self) -> ControlMessage | None:
        """Wait for rank 0's next message (a follower).

        Returns:
            The message (empty for a heartbeat or a plain step), or None to stop.
        """
        dist.broadcast(self._header, src=0, group=self.group)
        size = int(self._header[0])
        if size == _STOP:
            return None
        if size == 0:
            return _EMPTY_MESSAGE
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        message: ControlMessage = pickle.loads(data.numpy().tobytes())
        return message


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
