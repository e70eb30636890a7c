"""The symmetric-memory path: workspaces (allocated once per group) and the launch.

A workspace holds, on every rank of a group, three buffers allocated through
``torch.distributed._symmetric_memory`` and exchanged once by ``rendezvous``: a staging buffer
for the partial sums, an output buffer for the two-shot gather and a signal pad. The kernels
receive device tables of the peers' addresses of these buffers. Workspaces are cached by
(group, device, dtype, hidden) and never freed, because CUDA graphs captured earlier keep their
addresses; a call with more tokens than a workspace holds builds a larger one (outside capture).
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_kernels.comm.symmetric_kernels import (
    SIGNAL_PAD_SLOTS,
    launch_one_shot,
    launch_two_shot,
)
from mcore_kernels.errors import KernelShapeError, KernelValueError

__all__ = [
    "ONE_SHOT_MAX_TOKEN_RANKS",
    "choose_strategy",
    "MIN_CAPACITY_ROWS",
    "SymmetricWorkspace",
    "get_workspace",
    "symmetric_rs_add_rmsnorm_ag",
]

ONE_SHOT_MAX_TOKEN_RANKS = 256
"""In groups of more than two ranks, one-shot runs while ``tokens * world`` is at most this
(measured on 4 x H200, see :func:`choose_strategy`)."""


def choose_strategy(tokens: int, world: int) -> str:
    """Pick the kernel for a call: ``"one_shot"`` or ``"two_shot"``.

    Per rank, one-shot moves ``(world - 1) * tokens`` rows over NVLink (it reads every peer's
    partial rows), two-shot about ``3 * (world - 1) / world * tokens`` (it reads a slice of the
    peers' partials and writes the normalised rows and the new residual rows into every peer).
    With two ranks one-shot moves less at any size, and it was the faster kernel at every size
    measured on 2 x H200 (docs/benchmarks/comm.md). On 4 x H200 two-shot was faster from 128
    tokens on at hidden 4096 and 8192 and one-shot up to 32, hence the threshold of
    ``tokens * world <= 256`` for one-shot in groups of more than two ranks.

    Args:
        tokens: rows of the call.
        world: ranks in the group.

    Returns:
        The strategy name.
    """
    if world <= 2 or tokens * world <= ONE_SHOT_MAX_TOKEN_RANKS:
        return "one_shot"
    return "two_shot"


MIN_CAPACITY_ROWS = 512
"""Rows a new workspace holds at least (more when a call needs more)."""


@dataclass(kw_only=True, slots=True)
class SymmetricWorkspace:
    """One rank's symmetric buffers of a group and the tables of the peers' addresses."""

    rank: int
    """This rank's index in the group."""
    world: int
    """The group size."""
    capacity_rows: int
    """Tokens the staging buffer (and each half of the output buffer) holds."""
    buffers: tuple[torch.Tensor, ...]
    """The local symmetric tensors (staging, output, signal pad), kept alive here."""
    handles: tuple[object, ...]
    """The rendezvous handles, kept alive here."""
    staging_table: torch.Tensor
    """``int64[world]`` addresses of every rank's ``[capacity_rows, hidden]`` staging buffer."""
    output_table: torch.Tensor
    """``int64[world]`` addresses of every rank's ``[2, capacity_rows, hidden]`` output buffer."""
    signal_table: torch.Tensor
    """``int64[world]`` addresses of every rank's int32 signal pad."""

    def __post_init__(self) -> None:
        """Check that the tables have one entry per rank.

        Raises:
            KernelShapeError: a table's length differs from ``world``.
            KernelValueError: ``rank`` is outside ``[0, world)``.
        """
        if not 0 <= self.rank < self.world:
            raise KernelValueError(f"rank={self.rank} must lie in [0, world={self.world})")
        for name in ("staging_table", "output_table", "signal_table"):
            table = getattr(self, name)
            if table.shape != (self.world,) or table.dtype != torch.int64:
                raise KernelShapeError(
                    f"{name} is {tuple(table.shape)} {table.dtype}; expected ({self.world},) "
                    "torch.int64"
                )


_workspaces: dict[tuple[str, int, torch.dtype, int], SymmetricWorkspace] = {}
_retired: list[tuple[str, SymmetricWorkspace]] = []
"""Workspaces replaced by larger ones, with their group name: CUDA graphs may still read them."""
_unusable_groups: dict[str, str] = {}


def _group_name(group: dist.ProcessGroup | None) -> str:
    resolved = group if group is not None else dist.group.WORLD
    assert resolved is not None
    return str(resolved.group_name)


def _allocate(
    group: dist.ProcessGroup | None,
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    capacity_rows: int,
) -> SymmetricWorkspace:
    import torch.distributed._symmetric_memory as symm_mem

    # The kernels never use NVLink multicast; keep torch from creating multicast objects at
    # rendezvous, which on shared hosts can take the GPUs out of service.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # torch types group names as a NewType that plain strings do not satisfy.
    name: Any = _group_name(group)
    # torch < 2.8 needs the group registered; newer versions deprecate the call.
    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enabled is not None and not enabled(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    staging = symm_mem.empty(capacity_rows, hidden, dtype=dtype, device=device)
    output = symm_mem.empty(2, capacity_rows, hidden, dtype=dtype, device=device)
    signal = symm_mem.empty(SIGNAL_PAD_SLOTS, dtype=torch.int32, device=device)
    signal.zero_()
    handles = tuple(symm_mem.rendezvous(t, name) for t in (staging, output, signal))

    def table(handle: object) -> torch.Tensor:
        pointers = [int(p) for p in handle.buffer_ptrs]  # type: ignore[attr-defined]
        return torch.tensor(pointers, dtype=torch.int64, device=device)

    return SymmetricWorkspace(
        rank=dist.get_rank(group),
        world=dist.get_world_size(group),
        capacity_rows=capacity_rows,
        buffers=(staging, output, signal),
        handles=handles,
        staging_table=table(handles[0]),
        output_table=table(handles[1]),
        signal_table=table(handles[2]),
    )


def get_workspace(
    group: dist.ProcessGroup | None, partial: torch.Tensor
) -> SymmetricWorkspace | str:
    """Return the workspace serving ``partial``'s shape on ``group``, building it if needed.

    Building is collective over ``group`` (every rank calls with the same shape): the ranks
    check that they share one host, allocate and rendezvous, and agree through an all-reduce
    whether every rank succeeded. A failure makes the group use the collective path for good.

    Args:
        group: the tensor-parallel process group (None: the default group).
        partial: this rank's ``[tokens, hidden]`` CUDA partial sum.

    Returns:
        The workspace, or a sentence saying why none can serve this call.
    """
    name = _group_name(group)
    if name in _unusable_groups:
        return _unusable_groups[name]
    tokens, hidden = partial.shape
    key = (name, partial.device.index or 0, partial.dtype, hidden)
    workspace = _workspaces.get(key)
    if workspace is not None and workspace.capacity_rows >= tokens:
        return workspace
    if torch.cuda.is_current_stream_capturing():
        return (
            f"no symmetric workspace holds {tokens} tokens and none can be built during CUDA "
            "graph capture; run the largest token count once before capturing"
        )
    capacity_rows = max(MIN_CAPACITY_ROWS, 1 << (tokens - 1).bit_length())
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        _unusable_groups[name] = f"the group spans several hosts ({sorted(set(map(str, hosts)))})"
        return _unusable_groups[name]
    error = ""
    try:
        built: SymmetricWorkspace | None = _allocate(
            group, partial.device, partial.dtype, hidden, capacity_rows
        )
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        built, error = None, f"{type(exc).__name__}: {exc}"
    succeeded = torch.tensor([0 if built is None else 1], device=partial.device)
    dist.all_reduce(succeeded, op=dist.ReduceOp.MIN, group=group)
    if built is None or int(succeeded.item()) == 0:
        _unusable_groups[name] = (
            f"symmetric memory rendezvous failed on a rank ({error or 'on a peer'})"
        )
        return _unusable_groups[name]
    # Zeroed signal pads on every rank before any peer may signal into them.
    torch.cuda.synchronize(partial.device)
    dist.barrier(group=group)
    if workspace is not None:
        _retired.append((name, workspace))
    _workspaces[key] = built
    return built


def release_workspaces(group: dist.ProcessGroup | None = None) -> int:
    """Drop the workspaces of a group (current and retired) so their memory can be freed.

    Local (no collective). Call it when nothing will replay a CUDA graph that captured the
    workspaces; the next fused call on the group builds a new workspace (collectively).

    Args:
        group: the tensor-parallel process group (None: the default group).

    Returns:
        The number of workspaces dropped.
    """
    name = _group_name(group)
    keys = [key for key in _workspaces if key[0] == name]
    for key in keys:
        del _workspaces[key]
    kept = [(owner, workspace) for owner, workspace in _retired if owner != name]
    count = len(keys) + len(_retired) - len(kept)
    _retired[:] = kept
    return count


def symmetric_rs_add_rmsnorm_ag(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace: SymmetricWorkspace,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    strategy: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused op through the symmetric-memory kernels on ``workspace``.

    Args:
        partial: this rank's ``[tokens, hidden]`` partial sum (validated, on CUDA).
        residual: ``[tokens, hidden]`` residual, the same on every rank.
        weight: ``[hidden]`` scale.
        eps: added to the mean square.
        workspace: from :func:`get_workspace` for this group and shape.
        out: optional ``(normed_out, residual_out)``; contiguous tensors are written in place.
        strategy: ``"auto"`` (by token count), ``"one_shot"`` or ``"two_shot"``.

    Returns:
        ``(normed, new_residual)``, both ``[tokens, hidden]`` in the input dtype.

    Raises:
        KernelValueError: unknown ``strategy``.
        KernelShapeError: more tokens than the workspace holds.
    """
    if strategy not in ("auto", "one_shot", "two_shot"):
        raise KernelValueError(
            f"strategy={strategy!r} is not one of ('auto', 'one_shot', 'two_shot')"
        )
    if partial.shape[0] > workspace.capacity_rows:
        raise KernelShapeError(
            f"partial has {partial.shape[0]} tokens; the workspace holds {workspace.capacity_rows}"
        )
    tokens = partial.shape[0]
    partial = partial.contiguous()
    residual = residual.contiguous()
    direct = out is not None and all(t.is_contiguous() for t in out)
    if out is not None and direct:
        normed, new_residual = out
    else:
        normed, new_residual = torch.empty_like(partial), torch.empty_like(partial)
    if strategy == "auto":
        strategy = choose_strategy(tokens, workspace.world)
    if strategy == "one_shot":
        launch_one_shot(
            partial,
            residual,
            weight,
            eps,
            normed,
            new_residual,
            workspace.staging_table,
            workspace.signal_table,
            workspace.rank,
            workspace.world,
        )
    else:
        launch_two_shot(
            partial,
            residual,
            weight,
            eps,
            normed,
            new_residual,
            workspace.staging_table,
            workspace.output_table,
            workspace.signal_table,
            workspace.rank,
            workspace.world,
            workspace.capacity_rows,
        )
    if out is not None and not direct:
        out[0].copy_(normed)
        out[1].copy_(new_residual)
        return out[0], out[1]
    return normed, new_residual
