"""Collectives of a save or load, over a dedicated gloo group or as no-ops in one process.

Checkpoint collectives run on their own gloo group so that an asynchronous save, whose
collectives run in a background thread, never interleaves with the training's collectives on
the default (often NCCL) group, and so that object collectives need no CUDA device.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

__all__ = ["Communicator"]

# One gloo group per default process group; rebuilt when the default group is re-created.
_GROUP_LOCK = threading.Lock()
_GROUP_CACHE: list[tuple[Any, Any]] = []


def _checkpoint_group() -> Any:
    default = dist.group.WORLD
    with _GROUP_LOCK:
        for owner, group in _GROUP_CACHE:
            if owner is default:
                return group
        # new_group is collective: every rank reaches this line in its first save or load.
        group = dist.new_group(backend="gloo")
        _GROUP_CACHE[:] = [(default, group)]
        return group


class Communicator:
    """This process's view of the ranks taking part in one save or load.

    Args:
        group: Process group to use, or None for the checkpoint group of the default process
            group. Ignored when torch.distributed is not initialised (single process).
    """

    def __init__(self, group: Any = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.group = group if group is not None else _checkpoint_group()
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        else:
            self.group = None
            self.rank = 0
            self.world_size = 1

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank writes the shared files (metadata, markers)."""
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Returns the coordinator's ``value`` on every rank.

        Args:
            value: The value to send (used on the coordinator only).

        Returns:
            The coordinator's value.
        """
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Gathers one picklable value from every rank.

        Args:
            value: This rank's value.

        Returns:
            The values indexed by rank.
        """
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out
