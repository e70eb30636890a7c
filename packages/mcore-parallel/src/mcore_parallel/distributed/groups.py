"""The process groups a data-parallel wrapper reduces over, read from a ParallelState."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mcore_parallel.distributed.buffers import CommGroup
from mcore_parallel.errors import ParallelStateError, ParallelTypeError
from mcore_parallel.state import ParallelState

__all__ = ["DataParallelGroups"]


@dataclass(frozen=True)
class DataParallelGroups:
    """Groups of one data-parallel layout, each with this rank's size and index in it.

    Attributes:
        dense: Group over which dense gradients are reduced (data x context parallel).
        expert: Group over which expert gradients are reduced (expert data parallel); None
            without a :class:`~mcore_parallel.state.ParallelState`.
        tp: Tensor-parallel group (None without a state).
        ep: Expert-parallel group (None without a state).
        etp: Expert tensor-parallel group (None without a state).
        pp: Pipeline-parallel group (None without a state).
    """

    dense: CommGroup
    expert: CommGroup | None = None
    tp: CommGroup | None = None
    ep: CommGroup | None = None
    etp: CommGroup | None = None
    pp: CommGroup | None = None

    @classmethod
    def of(cls, state: Any) -> DataParallelGroups:
        """Reads the groups of ``state``.

        Args:
            state: A :class:`~mcore_parallel.state.ParallelState`; a ``ProcessGroup``, which is
                then the data-parallel group (for a model trained on a subset of the world);
                or None, which makes the whole world the data-parallel group.

        Returns:
            The groups.

        Raises:
            ParallelStateError: If ``state`` is None and torch.distributed is not initialised.
            ParallelTypeError: If ``state`` is of another type.
        """
        if state is None:
            if not dist.is_initialized():
                raise ParallelStateError(
                    "state=None needs torch.distributed initialised (the world is the dp group)"
                )
            return cls(CommGroup(None, dist.get_world_size(), dist.get_rank()))
        if isinstance(state, dist.ProcessGroup):
            return cls(CommGroup(state, state.size(), state.rank()))
        if not isinstance(state, ParallelState):
            raise ParallelTypeError(
                "state must be a ParallelState, a ProcessGroup (the data-parallel group) or "
                f"None, got {type(state).__name__}"
            )

        def view(name: str) -> CommGroup:
            return CommGroup(state.group(name), state.size(name), state.rank_in(name))

        # Context-parallel ranks see other tokens of the same sequences: dense gradients are
        # reduced over data x context.
        return cls(
            dense=view("dp_cp"),
            expert=view("expert_dp"),
            tp=view("tp"),
            ep=view("ep"),
            etp=view("etp"),
            pp=view("pp"),
        )
