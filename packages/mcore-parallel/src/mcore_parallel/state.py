"""Process groups of every parallelism, bundled in an explicit :class:`ParallelState`.

Ranks are laid out in the order tp-cp-ep-dp-pp with the tensor-parallel ranks contiguous, as in
Megatron-Core: the dense groups (tp, cp, dp, pp) come from a ``pp x dp x cp x tp`` grid of global
ranks, and the expert groups carve ``ep`` out of ``dp * cp`` from a ``pp x expert_dp x ep x tp``
grid of the same ranks, with ``expert_dp = dp * cp / ep``. With an expert tensor-parallel size
``etp`` other than ``tp`` (Megatron's ETP), the expert grid is ``pp x expert_dp x ep x etp`` with
``expert_dp = tp * cp * dp / (ep * etp)``: experts' FFNs are split over ``etp`` ranks, and the
dense tensor-parallel group is unchanged.

Libraries take a :class:`ParallelState` as an argument. :func:`get_default` and
:func:`set_default` exist only so that scripts can avoid passing it around.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore_parallel.errors import ParallelConfigError, ParallelStateError, ParallelTypeError

__all__ = ["ParallelState", "initialize", "get_default", "set_default"]

_DIMENSIONS = ("tp", "cp", "ep", "etp", "dp", "pp", "expert_dp", "dp_cp", "mp")


def _check_int_at_least(name: str, value: object, minimum: int) -> int:
    """Returns ``value`` if it is an int (not a bool) >= ``minimum``, else raises."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ParallelConfigError(f"{name}={value!r} must be {expected}")
    return value


def _check_positive(name: str, value: object) -> int:
    return _check_int_at_least(name, value, 1)


def _groups_along(grid: torch.Tensor, axes: Sequence[int]) -> list[list[int]]:
    """Lists the rank groups that vary along ``axes`` of ``grid`` and are fixed elsewhere."""
    others = [axis for axis in range(grid.dim()) if axis not in axes]
    size = 1
    for axis in axes:
        size *= grid.shape[axis]
    ordered = grid.permute(*others, *axes).reshape(-1, size)
    return [sorted(row.tolist()) for row in ordered]


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class ParallelState:
    """Process groups, sizes and ranks of one parallel layout.

    Build it with :func:`initialize`. For each dimension ``x`` in tp (tensor), cp (context),
    ep (expert), dp (data), pp (pipeline), expert_dp (data parallel of expert weights), dp_cp
    (data x context, over which dense gradients are reduced) and mp (model parallel, tp x pp)
    it exposes ``<x>_group``, ``<x>_size``, ``<x>_rank`` and ``<x>_ranks`` (the global ranks of
    this rank's group, ascending).

    Args:
        groups: For each dimension name, this rank's process group.
        ranks: For each dimension name, the global ranks of this rank's group.
        embedding_group: Group of the first and last pipeline stage of this rank's pipeline, or
            None on the middle stages.
        embedding_ranks: Global ranks of that group (also on middle stages).
        device: Device of this rank's computation.
        owns_default_group: Whether :meth:`destroy` also tears down the default process group.
    """

    def __init__(
        self,
        *,
        groups: dict[str, dist.ProcessGroup],
        ranks: dict[str, list[int]],
        embedding_group: dist.ProcessGroup | None,
        embedding_ranks: list[int],
        device: torch.device,
        owns_default_group: bool,
    ) -> None:
        self._groups = dict(groups)
        self._ranks = {name: list(r) for name, r in ranks.items()}
        self._embedding_group = embedding_group
        self.embedding_ranks: list[int] = list(embedding_ranks)
        """Global ranks of the first and last pipeline stage of this rank's pipeline."""
        self.device: torch.device = device
        """Device of this rank's computation: ``cuda:LOCAL_RANK`` under NCCL, else ``cpu``."""
        self.world_size: int = dist.get_world_size()
        """Number of ranks in the default process group."""
        self.rank: int = dist.get_rank()
        """Global rank of this process."""
        self._owns_default_group = owns_default_group
        self._destroyed = False

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{name}={len(self._ranks[name])}" for name in ("tp", "cp", "ep", "dp", "pp")
        )
        return f"ParallelState(rank={self.rank}/{self.world_size}, {sizes}, device={self.device})"

    def _group(self, name: str) -> dist.ProcessGroup:
        if self._destroyed:
            raise ParallelStateError(
                f"{name}_group requested after destroy(); call initialize() again"
            )
        return self._groups[name]

    def _rank_in(self, name: str) -> int:
        return self._ranks[name].index(self.rank)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """Tensor-parallel group (contiguous global ranks)."""
        return self._group("tp")

    @property
    def tp_size(self) -> int:
        """Number of tensor-parallel ranks."""
        return len(self._ranks["tp"])

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self._rank_in("tp")

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group."""
        return list(self._ranks["tp"])

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """Context-parallel group (ranks sharing a sequence split)."""
        return self._group("cp")

    @property
    def cp_size(self) -> int:
        """Number of context-parallel ranks."""
        return len(self._ranks["cp"])

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group."""
        return self._rank_in("cp")

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's context-parallel group."""
        return list(self._ranks["cp"])

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """Expert-parallel group (ranks holding different experts)."""
        return self._group("ep")

    @property
    def ep_size(self) -> int:
        """Number of expert-parallel ranks."""
        return len(self._ranks["ep"])

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group."""
        return self._rank_in("ep")

    @property
    def ep_ranks(self) -> list[int]:
        """Global ranks of this rank's expert-parallel group."""
        return list(self._ranks["ep"])

    @property
    def etp_group(self) -> dist.ProcessGroup:
        """Expert tensor-parallel group (ranks splitting each expert's FFN); ``tp`` by default."""
        return self._group("etp")

    @property
    def etp_size(self) -> int:
        """Number of expert tensor-parallel ranks."""
        return len(self._ranks["etp"])

    @property
    def etp_rank(self) -> int:
        """This rank's index in its expert tensor-parallel group."""
        return self._rank_in("etp")

    @property
    def etp_ranks(self) -> list[int]:
        """Global ranks of this rank's expert tensor-parallel group."""
        return list(self._ranks["etp"])

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Data-parallel group of dense weights (excluding context parallelism)."""
        return self._group("dp")

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""
        return len(self._ranks["dp"])

    @property
    def dp_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self._rank_in("dp")

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return list(self._ranks["dp"])

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """Pipeline-parallel group (the stages of this rank's pipeline)."""
        return self._group("pp")

    @property
    def pp_size(self) -> int:
        """Number of pipeline stages."""
        return len(self._ranks["pp"])

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self._rank_in("pp")

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of the stages of this rank's pipeline, first stage first."""
        return list(self._ranks["pp"])

    @property
    def expert_dp_group(self) -> dist.ProcessGroup:
        """Data-parallel group of expert weights (``dp * cp / ep`` ranks)."""
        return self._group("expert_dp")

    @property
    def expert_dp_size(self) -> int:
        """Number of ranks holding the same experts."""
        return len(self._ranks["expert_dp"])

    @property
    def expert_dp_rank(self) -> int:
        """This rank's index in its expert-data-parallel group."""
        return self._rank_in("expert_dp")

    @property
    def expert_dp_ranks(self) -> list[int]:
        """Global ranks of this rank's expert-data-parallel group."""
        return list(self._ranks["expert_dp"])

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """Data x context-parallel group, over which dense gradients are reduced."""
        return self._group("dp_cp")

    @property
    def dp_cp_size(self) -> int:
        """Number of ranks in the data x context-parallel group."""
        return len(self._ranks["dp_cp"])

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in its data x context-parallel group."""
        return self._rank_in("dp_cp")

    @property
    def dp_cp_ranks(self) -> list[int]:
        """Global ranks of this rank's data x context-parallel group."""
        return list(self._ranks["dp_cp"])

    @property
    def mp_group(self) -> dist.ProcessGroup:
        """Model-parallel group: the tp x pp ranks that together hold one model replica."""
        return self._group("mp")

    @property
    def mp_size(self) -> int:
        """Number of ranks in the model-parallel group."""
        return len(self._ranks["mp"])

    @property
    def mp_rank(self) -> int:
        """This rank's index in its model-parallel group."""
        return self._rank_in("mp")

    @property
    def mp_ranks(self) -> list[int]:
        """Global ranks of this rank's model-parallel group."""
        return list(self._ranks["mp"])

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """Group of the first and last pipeline stage (tied embeddings); None on middle stages."""
        if self._destroyed:
            raise ParallelStateError("embedding_group requested after destroy()")
        return self._embedding_group

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage."""
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around from the first stage)."""
        return self._ranks["pp"][(self.pp_rank - 1) % self.pp_size]

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around from the last stage)."""
        return self._ranks["pp"][(self.pp_rank + 1) % self.pp_size]

    @property
    def is_destroyed(self) -> bool:
        """Whether :meth:`destroy` has been called."""
        return self._destroyed

    def destroy(self) -> None:
        """Destroys the process groups of this state (idempotent).

        The default process group is destroyed too when :func:`initialize` created it. Groups
        of a destroyed state raise :class:`~mcore_parallel.errors.ParallelStateError`.
        """
        if self._destroyed:
            return
        self._destroyed = True
        global _default
        if _default is self:
            _default = None
        if not dist.is_initialized():
            return
        for group in {id(g): g for g in self._all_created_groups()}.values():
            dist.destroy_process_group(group)
        if self._owns_default_group:
            dist.destroy_process_group()

    def _all_created_groups(self) -> list[dist.ProcessGroup]:
        groups = list(self._groups.values())
        if self._embedding_group is not None:
            groups.append(self._embedding_group)
        return groups


def _validate_layout(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> int:
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise ParallelConfigError(
            f"world_size={world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_size}"
        )
    dp = world_size // model_size
    if etp == tp and (dp * cp) % ep != 0:
        raise ParallelConfigError(
            f"ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp} (world_size={world_size}, "
            f"tp={tp}, pp={pp}, cp={cp})"
        )
    if (tp * cp * dp) % (ep * etp) != 0:
        raise ParallelConfigError(
            f"ep*etp = {ep}*{etp} must divide tp*cp*dp = {tp}*{cp}*{dp} = {tp * cp * dp} "
            f"(world_size={world_size}, pp={pp})"
        )
    return dp


def _init_default_group(backend: str | None) -> None:
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise ParallelStateError(
            f"torch.distributed is not initialised and the environment lacks {missing}; "
            "launch with torchrun or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    backend = backend or _default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))


def _device_for_backend() -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def _new_group(members: list[int], rank: int) -> dist.ProcessGroup | None:
    """Creates a group (a collective call on every rank); returns it only to its members."""
    group = dist.new_group(members)
    return group if rank in members and isinstance(group, dist.ProcessGroup) else None


def initialize(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    backend: str | None = None,
    *,
    etp: int | None = None,
) -> ParallelState:
    """Creates the process groups of a tp x cp x dp x pp layout (plus expert groups).

    Every rank of the default group must call it with the same arguments. If torch.distributed
    is not initialised yet it is initialised from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) with ``backend``.

    Args:
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        cp: Context-parallel size.
        ep: Expert-parallel size; must divide ``dp * cp``.
        backend: Backend used when torch.distributed must be initialised here; default
            ``"nccl"`` when CUDA is available, else ``"gloo"``. Ignored otherwise.
        etp: Expert tensor-parallel size (default ``tp``); ``ep * etp`` must divide
            ``tp * cp * dp``.

    Returns:
        This rank's :class:`ParallelState`; ``dp = world_size / (tp * pp * cp)``.

    Raises:
        ParallelConfigError: If a size is not a positive integer, the world size is not
            divisible by ``tp * pp * cp``, or ``ep`` does not divide ``dp * cp``.
        ParallelStateError: If torch.distributed is not initialised and the environment does
            not say how to initialise it.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        _check_positive(name, value)
    etp = tp if etp is None else _check_positive("etp", etp)
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        _init_default_group(backend)
    world_size = dist.get_world_size()
    try:
        dp = _validate_layout(world_size, tp, pp, cp, ep, etp)
    except ParallelConfigError:
        if owns_default_group:
            dist.destroy_process_group()
        raise
    rank = dist.get_rank()
    dense = torch.arange(world_size).reshape(pp, dp, cp, tp)
    expert = torch.arange(world_size).reshape(pp, tp * cp * dp // (ep * etp), ep, etp)
    layouts: dict[str, list[list[int]]] = {
        "tp": _groups_along(dense, [3]),
        "cp": _groups_along(dense, [2]),
        "dp": _groups_along(dense, [1]),
        "pp": _groups_along(dense, [0]),
        "dp_cp": _groups_along(dense, [1, 2]),
        "mp": _groups_along(dense, [0, 3]),
        "ep": _groups_along(expert, [2]),
        "etp": _groups_along(expert, [3]),
        "expert_dp": _groups_along(expert, [1]),
    }
    groups: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    # Every rank creates every group in the same order, as new_group requires.
    for name in _DIMENSIONS:
        for members in layouts[name]:
            group = _new_group(members, rank)
            if group is not None:
                groups[name], ranks[name] = group, members
    embedding_group = None
    embedding_ranks: list[int] = []
    for pipeline in layouts["pp"]:
        members = sorted({pipeline[0], pipeline[-1]})
        group = _new_group(members, rank)
        if rank in pipeline:
            embedding_ranks, embedding_group = members, group
    return ParallelState(
        groups=groups,
        ranks=ranks,
        embedding_group=embedding_group,
        embedding_ranks=embedding_ranks,
        device=_device_for_backend(),
        owns_default_group=owns_default_group,
    )


_default: ParallelState | None = None


def get_default() -> ParallelState:
    """Returns the state registered with :func:`set_default` (for scripts only).

    Returns:
        The default :class:`ParallelState`.

    Raises:
        ParallelStateError: If no default was set or it was destroyed.
    """
    if _default is None:
        raise ParallelStateError(
            "no default ParallelState; call set_default(initialize(...)) first"
        )
    return _default


def set_default(state: ParallelState | None) -> None:
    """Registers ``state`` as the module-level default (for scripts only; None clears it).

    Args:
        state: The state to return from :func:`get_default`, or None.

    Raises:
        ParallelStateError: If ``state`` is a destroyed state.
        ParallelTypeError: If ``state`` is neither a ParallelState nor None.
    """
    global _default
    if state is not None and not isinstance(state, ParallelState):
        raise ParallelTypeError(
            f"state must be a ParallelState or None, got {type(state).__name__}"
        )
    if state is not None and state.is_destroyed:
        raise ParallelStateError("set_default() got a destroyed ParallelState")
    _default = state
