"""Triton kernels of the symmetric-memory path: one-shot and two-shot, with a signal barrier.

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

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_PROGRAMS",
    "SIGNAL_PAD_SLOTS",
    "launch_one_shot",
    "launch_two_shot",
    "one_shot_kernel",
    "two_shot_kernel",
]

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
