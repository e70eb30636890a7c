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
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_parallel.errors import ParallelConfigError, ParallelStateError, ParallelTypeError

__all__ = ["DIMENSIONS", "GlobalRank", "ParallelState", "initialize", "get_default", "set_default"]

DIMENSIONS = ("tp", "cp", "ep", "etp", "dp", "pp", "expert_dp", "dp_cp", "mp")
"""Names of the parallel dimensions a :class:`ParallelState` has a group for, in creation order."""

_ATTRIBUTE_ACCESSORS = {"group": "group", "size": "size", "rank": "rank_in", "ranks": "ranks"}


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


class GlobalRank(int):
    """This process's global rank, an ``int`` that can also be called with a dimension name.

    ``state.rank`` compares, formats, hashes and computes as the global rank it always was;
    ``state.rank("tp")`` returns the index in the tensor-parallel group, the same as
    ``state.rank_in("tp")``. Pickling gives a plain ``int``.

    Args:
        value: The global rank.
        rank_in: The state's :meth:`ParallelState.rank_in`.
    """

    _rank_in: Callable[[str], int]

    def __new__(cls, value: int, rank_in: Callable[[str], int]) -> GlobalRank:
        rank = super().__new__(cls, value)
        rank._rank_in = rank_in
        return rank

    def __call__(self, name: str) -> int:
        """Returns this rank's index in its group of dimension ``name``.

        Args:
            name: One of :data:`DIMENSIONS`.

        Returns:
            The index.

        Raises:
            ParallelConfigError: If ``name`` is not a dimension.
        """
        return self._rank_in(name)

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        return int, (int(self),)


class ParallelState:
    """Process groups, sizes and ranks of one parallel layout.

    Build it with :func:`initialize`. One accessor serves every dimension of :data:`DIMENSIONS`:
    tp (tensor), cp (context), ep (expert), etp (expert tensor), dp (data), pp (pipeline),
    expert_dp (data parallel of expert weights), dp_cp (data x context, over which dense
    gradients are reduced) and mp (model parallel, tp x pp)::

        state.group("tp"); state.size("cp"); state.rank_in("ep"); state.ranks("dp")

    :attr:`rank` is this process's global rank (an int, as always); the index inside a
    dimension's group is :meth:`rank_in`, and ``state.rank(name)`` answers the same (the global
    rank is a callable int, :class:`GlobalRank`), so both spellings work. The attribute spellings ``state.<dim>_group``, ``<dim>_size``,
    ``<dim>_rank`` (the index in the group) and ``<dim>_ranks`` resolve to the same
    accessors, e.g. ``state.tp_size == state.size("tp")``. Unknown names raise
    :class:`~mcore_parallel.errors.ParallelConfigError` listing the valid ones.

    Args:
        groups: For each dimension name, this rank's process group.
        ranks: For each dimension name, the global ranks of this rank's group.
        embedding_group: Group of the first and last pipeline stage of this rank's pipeline, or
            None on the middle stages.
        embedding_ranks: Global ranks of that group (also on middle stages).
        device: Device of this rank's computation.
        owns_default_group: Whether :meth:`destroy` also tears down the default process group.
    """

    if TYPE_CHECKING:
        # The attribute spellings resolved by __getattr__, declared for type checkers.
        tp_group: dist.ProcessGroup
        tp_size: int
        tp_rank: int
        tp_ranks: list[int]
        cp_group: dist.ProcessGroup
        cp_size: int
        cp_rank: int
        cp_ranks: list[int]
        ep_group: dist.ProcessGroup
        ep_size: int
        ep_rank: int
        ep_ranks: list[int]
        etp_group: dist.ProcessGroup
        etp_size: int
        etp_rank: int
        etp_ranks: list[int]
        dp_group: dist.ProcessGroup
        dp_size: int
        dp_rank: int
        dp_ranks: list[int]
        pp_group: dist.ProcessGroup
        pp_size: int
        pp_rank: int
        pp_ranks: list[int]
        expert_dp_group: dist.ProcessGroup
        expert_dp_size: int
        expert_dp_rank: int
        expert_dp_ranks: list[int]
        dp_cp_group: dist.ProcessGroup
        dp_cp_size: int
        dp_cp_rank: int
        dp_cp_ranks: list[int]
        mp_group: dist.ProcessGroup
        mp_size: int
        mp_rank: int
        mp_ranks: list[int]

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
        self.rank: GlobalRank = GlobalRank(dist.get_rank(), self.rank_in)
        """Global rank of this process: an int; ``state.rank(name)`` is ``rank_in(name)``."""
        self._owns_default_group = owns_default_group
        self._destroyed = False

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{name}={len(self._ranks[name])}" for name in ("tp", "cp", "ep", "dp", "pp")
        )
        return f"ParallelState(rank={self.rank}/{self.world_size}, {sizes}, device={self.device})"

    def _check_name(self, name: object) -> str:
        if not isinstance(name, str) or name not in DIMENSIONS:
            raise ParallelConfigError(
                f"name={name!r} is not a parallel dimension; expected one of {list(DIMENSIONS)}"
            )
        return name

    def group(self, name: str) -> dist.ProcessGroup:
        """Returns this rank's process group of one parallel dimension.

        Args:
            name: One of :data:`DIMENSIONS` (``"tp"``, ``"cp"``, ``"ep"``, ``"etp"``, ``"dp"``,
                ``"pp"``, ``"expert_dp"``, ``"dp_cp"``, ``"mp"``).

        Returns:
            The group.

        Raises:
            ParallelConfigError: If ``name`` is not a dimension.
            ParallelStateError: If the state was destroyed.
        """
        name = self._check_name(name)
        if self._destroyed:
            raise ParallelStateError(
                f"group({name!r}) requested after destroy(); call initialize() again"
            )
        return self._groups[name]

    def size(self, name: str) -> int:
        """Returns the number of ranks of this rank's group of one dimension.

        Args:
            name: One of :data:`DIMENSIONS`.

        Returns:
            The group size.

        Raises:
            ParallelConfigError: If ``name`` is not a dimension.
        """
        return len(self._ranks[self._check_name(name)])

    def rank_in(self, name: str) -> int:
        """Returns this rank's index in its group of one dimension.

        Named ``rank_in`` because :attr:`rank` is (and stays) this process's global rank.

        Args:
            name: One of :data:`DIMENSIONS`.

        Returns:
            The index, in ``[0, size(name))``.

        Raises:
            ParallelConfigError: If ``name`` is not a dimension.
        """
        return self._ranks[self._check_name(name)].index(self.rank)

    def ranks(self, name: str) -> list[int]:
        """Returns the global ranks of this rank's group of one dimension, ascending.

        Args:
            name: One of :data:`DIMENSIONS`.

        Returns:
            A new list of global ranks.

        Raises:
            ParallelConfigError: If ``name`` is not a dimension.
        """
        return list(self._ranks[self._check_name(name)])

    def __getattr__(self, attribute: str) -> Any:
        # Only called when normal lookup fails: maps the spellings ``<dim>_group``,
        # ``<dim>_size``, ``<dim>_rank`` and ``<dim>_ranks`` onto the accessors.
        dim, _, field = attribute.rpartition("_")
        accessor = _ATTRIBUTE_ACCESSORS.get(field)
        if accessor is None or dim not in DIMENSIONS or "_ranks" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attribute!r}")
        return getattr(self, accessor)(dim)

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """Group of the first and last pipeline stage (tied embeddings); None on middle stages."""
        if self._destroyed:
            raise ParallelStateError("embedding_group requested after destroy()")
        return self._embedding_group

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage."""
        return self.rank_in("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage."""
        return self.rank_in("pp") == self.size("pp") - 1

    @property
    def pp_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around from the first stage)."""
        return self._ranks["pp"][(self.rank_in("pp") - 1) % self.size("pp")]

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around from the last stage)."""
        return self._ranks["pp"][(self.rank_in("pp") + 1) % self.size("pp")]

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
    for name in DIMENSIONS:
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
