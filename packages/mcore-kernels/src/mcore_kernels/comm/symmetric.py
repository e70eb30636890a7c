"""The symmetric-memory path: Triton kernels, workspaces (allocated once per group), launch.

A workspace holds, on every rank of a group, three buffers allocated through
``torch.distributed._symmetric_memory`` and exchanged once by ``rendezvous``: a staging buffer
for the partial sums, an output buffer for the two-shot gather and a signal pad. The kernels
receive device tables of the peers' addresses of these buffers. Workspaces are cached by
(group, device, dtype, hidden) and never freed, because CUDA graphs captured earlier keep their
addresses; a call with more tokens than a workspace holds builds a larger one (outside capture).

The kernels. One-shot and two-shot, with a signal barrier.

Every rank holds three symmetric buffers of the same shape, reachable from every peer through
pointers: a staging buffer for the partial sums, an output buffer (two-shot only) and a signal
pad of int32 counters. A kernel receives device tables of the peers' base addresses
(``int64[world]``) and turns an entry into a typed pointer, so the same body runs on GPUs
(addresses mapped over NVLink) and under ``TRITON_INTERPRET=1`` (addresses of CPU tensors that
emulate the peers in one process).

The barrier is a counting semaphore per (program, source rank) slot: a program adds 1 to its
slot in every peer's pad (release, system scope) and waits until each slot of its own pad holds
at least 1, then takes 1 back. Program ``p`` only ever meets program ``p`` of the peers, and a
signal sent early for the next barrier stays in the slot, so nothing is lost or reordered. No
multicast object and no multimem instruction is used.

Sums run in float32 over ranks in the fixed order 0, 1, ..., world - 1 and are rounded once to
the input dtype, so every rank computes bitwise identical rows; then ``h = sum + residual`` is
rounded to the input dtype and normalised in float32, as :func:`mcore_kernels.rms_norm` does.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from mcore_kernels.errors import KernelShapeError, KernelValueError

__all__ = [
    "MAX_PROGRAMS",
    "SIGNAL_PAD_SLOTS",
    "launch_one_shot",
    "launch_two_shot",
    "one_shot_kernel",
    "two_shot_kernel",
    "ONE_SHOT_MAX_TOKEN_RANKS",
    "choose_strategy",
    "MIN_CAPACITY_ROWS",
    "SymmetricWorkspace",
    "get_workspace",
    "symmetric_rs_add_rmsnorm_ag",
]

# --- Triton kernels and their launchers -----------------------------------------------------

MAX_PROGRAMS = 128
"""Most programs a launch uses: fewer than the multiprocessors of a GPU, one program each."""

SIGNAL_PAD_SLOTS = MAX_PROGRAMS * 8
"""int32 counters in each rank's signal pad: one per (program, source rank) pair."""


@triton.jit
def _barrier(signal_table, pid, rank, WORLD: tl.constexpr):
    # NOTE: a variant with one inline-assembly ``fence.acq_rel.sys`` before the signals and one
    # after the waits (relaxed atomics in between) was measured on 4 x H200 and was not faster
    # (2 ranks: 10.5 us instead of 7.3 us per 1-token call; every thread runs the fence), so
    # the fences stay inside the release/acquire atomics.
    # Scalar atomics, one peer at a time: Triton executes them once per program, and a spin
    # loop over a scalar compiles where one carrying a tensor of counters does not.
    local_pad = tl.load(signal_table + rank).to(tl.pointer_type(tl.int32)) + pid * WORLD
    # Every thread's stores of this program must precede the releases below.
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != rank:
            remote_pad = tl.load(signal_table + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_add(remote_pad + pid * WORLD + rank, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_add(local_pad + peer, 0, sem="acquire", scope="sys") < 1:
                pass
            tl.atomic_add(local_pad + peer, -1, sem="relaxed", scope="sys")
    # Loads of peers' data by any thread of this program come after the acquires above.
    tl.debug_barrier()


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        # Round to nearest even in integer arithmetic, then truncate exactly: the Triton
        # interpreter truncates float32 to bfloat16, so a plain cast would differ from the GPU.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x.to(dtype)


@triton.jit
def _reduce_add_norm_row(
    row,
    staging_table,
    residual_ptr,
    weight,
    hidden,
    eps,
    cols,
    col_mask,
    WORLD: tl.constexpr,
):
    offsets = row * hidden + cols
    dtype = residual_ptr.dtype.element_ty
    total = tl.zeros(cols.shape, dtype=tl.float32)
    for source in tl.static_range(WORLD):
        buffer = tl.load(staging_table + source).to(tl.pointer_type(dtype))
        total += tl.load(buffer + offsets, mask=col_mask, other=0.0).to(tl.float32)
    reduced = _round_to(total, dtype).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=col_mask, other=0.0).to(tl.float32)
    h = _round_to(reduced + residual, dtype)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    normed = _round_to(hf * rstd * weight, dtype)
    return normed, h, offsets


@triton.jit
def one_shot_kernel(
    partial_ptr,
    residual_ptr,
    weight_ptr,
    normed_out_ptr,
    residual_out_ptr,
    staging_table,
    signal_table,
    rank,
    tokens,
    hidden,
    rows_per_program,
    eps,
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Every rank reduces, adds and normalises all tokens itself (small token counts).

    Program ``p`` stages rows ``p, p + programs, ...`` of ``partial`` into this rank's staging
    buffer, meets program ``p`` of every peer, reduces those rows from all staging buffers and
    writes both outputs locally, then meets the peers again so that no staging buffer is
    overwritten by the next call while a peer still reads it.

    Args:
        partial_ptr: this rank's contiguous ``[tokens, hidden]`` partial sum.
        residual_ptr: contiguous ``[tokens, hidden]`` residual (its dtype is the output dtype).
        weight_ptr: ``[hidden]`` RMSNorm scale.
        normed_out_ptr: contiguous ``[tokens, hidden]`` output of the normalised rows.
        residual_out_ptr: contiguous ``[tokens, hidden]`` output of ``sum + residual``.
        staging_table: ``int64[WORLD]`` addresses of the ranks' ``[capacity, hidden]`` staging
            buffers.
        signal_table: ``int64[WORLD]`` addresses of the ranks' int32 signal pads.
        rank: this rank's index in the group.
        tokens: rows to process.
        hidden: row length.
        rows_per_program: ``ceil(tokens / programs)``.
        eps: added to the mean square.
        WORLD: the group size.
        BLOCK_H: ``hidden`` rounded up to a power of two.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    dtype = partial_ptr.dtype.element_ty
    own_staging = tl.load(staging_table + rank).to(tl.pointer_type(dtype))
    for step in range(rows_per_program):
        row = pid + step * programs
        if row < tokens:
            offsets = row * hidden + cols
            values = tl.load(partial_ptr + offsets, mask=col_mask)
            tl.store(own_staging + offsets, values, mask=col_mask)
    _barrier(signal_table, pid, rank, WORLD)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    for step in range(rows_per_program):
        row = pid + step * programs
        if row < tokens:
            normed, h, offsets = _reduce_add_norm_row(
                row, staging_table, residual_ptr, weight, hidden, eps, cols, col_mask, WORLD
            )
            tl.store(normed_out_ptr + offsets, normed, mask=col_mask)
            tl.store(residual_out_ptr + offsets, h, mask=col_mask)
    _barrier(signal_table, pid, rank, WORLD)


@triton.jit
def two_shot_kernel(
    partial_ptr,
    residual_ptr,
    weight_ptr,
    normed_out_ptr,
    residual_out_ptr,
    staging_table,
    output_table,
    signal_table,
    rank,
    tokens,
    hidden,
    slice_rows,
    rows_per_program,
    capacity_rows,
    eps,
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    REDUCE: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Each rank reduces and normalises its slice of tokens and writes it into every peer.

    Rank ``r`` owns rows ``[r * slice_rows, (r + 1) * slice_rows)``. Program ``p`` handles
    local rows ``i = p, p + programs, ...`` of every slice: it stages those rows of ``partial``,
    meets the peers, reduces its own slice's rows, adds the residual, normalises and stores
    ``normed`` and ``h`` into every rank's output buffer (``[2, capacity_rows, hidden]``), meets
    the peers again and copies the gathered rows out. ``REDUCE`` and ``GATHER`` select the two
    halves; a GPU launch runs both, the single-process emulation runs them one after the other
    for all ranks.

    Args:
        partial_ptr: this rank's contiguous ``[tokens, hidden]`` partial sum.
        residual_ptr: contiguous ``[tokens, hidden]`` residual (its dtype is the output dtype).
        weight_ptr: ``[hidden]`` RMSNorm scale.
        normed_out_ptr: contiguous ``[tokens, hidden]`` output of the normalised rows.
        residual_out_ptr: contiguous ``[tokens, hidden]`` output of ``sum + residual``.
        staging_table: ``int64[WORLD]`` addresses of the ranks' ``[capacity, hidden]`` staging
            buffers.
        output_table: ``int64[WORLD]`` addresses of the ranks' ``[2, capacity_rows, hidden]``
            output buffers.
        signal_table: ``int64[WORLD]`` addresses of the ranks' int32 signal pads.
        rank: this rank's index in the group.
        tokens: rows to process.
        hidden: row length.
        slice_rows: ``ceil(tokens / WORLD)``, the rows each rank owns.
        rows_per_program: ``ceil(slice_rows / programs)``.
        capacity_rows: rows of each half of an output buffer.
        eps: added to the mean square.
        WORLD: the group size.
        BLOCK_H: ``hidden`` rounded up to a power of two.
        REDUCE: run the first half.
        GATHER: run the second half.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    dtype = partial_ptr.dtype.element_ty
    if REDUCE:
        own_staging = tl.load(staging_table + rank).to(tl.pointer_type(dtype))
        for step in range(rows_per_program):
            local = pid + step * programs
            for owner in tl.static_range(WORLD):
                row = owner * slice_rows + local
                if (row < tokens) & (local < slice_rows):
                    offsets = row * hidden + cols
                    values = tl.load(partial_ptr + offsets, mask=col_mask)
                    tl.store(own_staging + offsets, values, mask=col_mask)
        _barrier(signal_table, pid, rank, WORLD)
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        for step in range(rows_per_program):
            local = pid + step * programs
            row = rank * slice_rows + local
            if (row < tokens) & (local < slice_rows):
                normed, h, offsets = _reduce_add_norm_row(
                    row, staging_table, residual_ptr, weight, hidden, eps, cols, col_mask, WORLD
                )
                for target in tl.static_range(WORLD):
                    output = tl.load(output_table + target).to(tl.pointer_type(dtype))
                    tl.store(output + offsets, normed, mask=col_mask)
                    tl.store(output + capacity_rows * hidden + offsets, h, mask=col_mask)
    if GATHER:
        _barrier(signal_table, pid, rank, WORLD)
        own_output = tl.load(output_table + rank).to(tl.pointer_type(dtype))
        for step in range(rows_per_program):
            local = pid + step * programs
            for owner in tl.static_range(WORLD):
                row = owner * slice_rows + local
                if (row < tokens) & (local < slice_rows):
                    offsets = row * hidden + cols
                    normed = tl.load(own_output + offsets, mask=col_mask)
                    h = tl.load(own_output + capacity_rows * hidden + offsets, mask=col_mask)
                    tl.store(normed_out_ptr + offsets, normed, mask=col_mask)
                    tl.store(residual_out_ptr + offsets, h, mask=col_mask)


def _block_and_warps(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    # Enough threads that one program keeps many 16-byte loads of a long row in flight.
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return block, warps


def launch_one_shot(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    normed_out: torch.Tensor,
    residual_out: torch.Tensor,
    staging_table: torch.Tensor,
    signal_table: torch.Tensor,
    rank: int,
    world: int,
) -> None:
    """Launch :func:`one_shot_kernel` for this rank.

    Args:
        partial: contiguous ``[tokens, hidden]`` partial sum of this rank.
        residual: contiguous ``[tokens, hidden]`` residual.
        weight: ``[hidden]`` scale.
        eps: added to the mean square.
        normed_out: contiguous ``[tokens, hidden]`` output for the normalised rows.
        residual_out: contiguous ``[tokens, hidden]`` output for ``sum + residual``.
        staging_table: ``int64[world]`` addresses of every rank's staging buffer.
        signal_table: ``int64[world]`` addresses of every rank's signal pad.
        rank: this rank's index in the group.
        world: the group size.
    """
    tokens, hidden = partial.shape
    block, warps = _block_and_warps(hidden)
    programs = min(tokens, MAX_PROGRAMS)
    one_shot_kernel[(programs,)](
        partial,
        residual,
        weight,
        normed_out,
        residual_out,
        staging_table,
        signal_table,
        rank,
        tokens,
        hidden,
        -(-tokens // programs),
        eps,
        WORLD=world,
        BLOCK_H=block,
        num_warps=warps,
    )


def launch_two_shot(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    normed_out: torch.Tensor,
    residual_out: torch.Tensor,
    staging_table: torch.Tensor,
    output_table: torch.Tensor,
    signal_table: torch.Tensor,
    rank: int,
    world: int,
    capacity_rows: int,
    *,
    reduce: bool = True,
    gather: bool = True,
) -> None:
    """Launch :func:`two_shot_kernel` for this rank.

    Args:
        partial: contiguous ``[tokens, hidden]`` partial sum of this rank.
        residual: contiguous ``[tokens, hidden]`` residual.
        weight: ``[hidden]`` scale.
        eps: added to the mean square.
        normed_out: contiguous ``[tokens, hidden]`` output for the normalised rows.
        residual_out: contiguous ``[tokens, hidden]`` output for ``sum + residual``.
        staging_table: ``int64[world]`` addresses of every rank's staging buffer.
        output_table: ``int64[world]`` addresses of every rank's ``[2, capacity_rows, hidden]``
            output buffer.
        signal_table: ``int64[world]`` addresses of every rank's signal pad.
        rank: this rank's index in the group.
        world: the group size.
        capacity_rows: rows of each half of the output buffers.
        reduce: run the first half (stage, reduce, normalise, scatter to the peers).
        gather: run the second half (wait for the peers, copy the gathered rows out).
    """
    tokens, hidden = partial.shape
    slice_rows = -(-tokens // world)
    block, warps = _block_and_warps(hidden)
    programs = min(slice_rows, MAX_PROGRAMS)
    two_shot_kernel[(programs,)](
        partial,
        residual,
        weight,
        normed_out,
        residual_out,
        staging_table,
        output_table,
        signal_table,
        rank,
        tokens,
        hidden,
        slice_rows,
        -(-slice_rows // programs),
        capacity_rows,
        eps,
        WORLD=world,
        BLOCK_H=block,
        REDUCE=reduce,
        GATHER=gather,
        num_warps=warps,
    )


# --- workspaces and the op ------------------------------------------------------------------


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
