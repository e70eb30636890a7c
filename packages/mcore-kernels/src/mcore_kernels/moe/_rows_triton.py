"""Triton kernels of :mod:`mcore_kernels.moe.rows`."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["capacity_rows_kernel", "dropless_rows_kernel", "padded_slots_kernel"]


@triton.jit
def capacity_rows_kernel(
    order_ptr,
    experts_ptr,
    counts_ptr,
    ends_ptr,
    kept_ptr,
    kept_ends_ptr,
    compact_ptr,
    inverse_ptr,
    offsets_ptr,
    total,
    num_experts,
    capacity,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Sorted positions ``i`` of one block: assignment ``a = order[i]`` of expert ``e`` is the
    ``i - (ends[e] - counts[e])``-th of its expert; kept below ``capacity``, in row
    ``kept_ends[e] - kept[e]`` plus that rank. Writes ``inverse[a]`` (-1 when dropped),
    ``compact[row] = a`` and -1 in ``compact[i]`` past the last kept row: every element once,
    no atomics. Program 0 also writes the int32 ``offsets`` (``kept_ends``)."""
    _int32_offsets(kept_ends_ptr, offsets_ptr, num_experts, E_PAD)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    assignment = tl.load(order_ptr + i, mask=ok, other=0)
    expert = tl.load(experts_ptr + assignment, mask=ok, other=0)
    start = tl.load(ends_ptr + expert, mask=ok, other=0) - tl.load(
        counts_ptr + expert, mask=ok, other=0
    )
    kept_start = tl.load(kept_ends_ptr + expert, mask=ok, other=0) - tl.load(
        kept_ptr + expert, mask=ok, other=0
    )
    rank = i - start
    row = tl.where(rank < capacity, kept_start + rank, -1)
    tl.store(inverse_ptr + assignment, row, mask=ok)
    tl.store(compact_ptr + row, assignment, mask=ok & (row >= 0))
    kept_total = tl.load(kept_ends_ptr + num_experts - 1)
    tl.store(compact_ptr + i, tl.full((BLOCK,), -1, tl.int64), mask=ok & (i >= kept_total))


@triton.jit
def _int32_offsets(ends_ptr, offsets_ptr, num_experts, E_PAD: tl.constexpr):
    """Program 0 copies the int64 ``ends`` into the int32 ``offsets``."""
    if tl.program_id(0) == 0:
        ids = tl.arange(0, E_PAD)
        ends = tl.load(ends_ptr + ids, mask=ids < num_experts, other=0)
        tl.store(offsets_ptr + ids, ends.to(tl.int32), mask=ids < num_experts)


@triton.jit
def dropless_rows_kernel(
    order_ptr,
    counts_ptr,
    inverse_ptr,
    offsets_ptr,
    total,
    num_experts,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """``inverse[order[i]] = i`` for one block of sorted positions; program 0 also writes the
    int32 end row of every expert (``offsets``, the running sum of ``counts``)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    assignment = tl.load(order_ptr + i, mask=ok, other=0)
    tl.store(inverse_ptr + assignment, i, mask=ok)
    if tl.program_id(0) == 0:
        ids = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + ids, mask=ids < num_experts, other=0)
        ends = tl.cumsum(counts, axis=0)
        tl.store(offsets_ptr + ids, ends.to(tl.int32), mask=ids < num_experts)


@triton.jit
def padded_slots_kernel(
    order_ptr,
    keys_ptr,
    counts_ptr,
    ends_ptr,
    fillers_ptr,
    kept_ptr,
    total,
    num_keys,
    capacity,
    BLOCK: tl.constexpr,
):
    """Sorted positions ``i`` of one block: assignment ``a = order[i]`` of key ``k`` is the
    ``i - (ends[k] - counts[k])``-th of its key; kept below ``capacity`` (and for a key below
    ``num_keys``) in slot ``k * capacity`` plus that rank. Writes ``kept[a]`` (-1 when
    dropped) and ``fillers[slot] = a``: every element once, no atomics."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    assignment = tl.load(order_ptr + i, mask=ok, other=0)
    key = tl.load(keys_ptr + assignment, mask=ok, other=0)
    start = tl.load(ends_ptr + key, mask=ok, other=0) - tl.load(counts_ptr + key, mask=ok, other=0)
    rank = i - start
    slot = tl.where((rank < capacity) & (key < num_keys), key * capacity + rank, -1)
    tl.store(kept_ptr + assignment, slot, mask=ok)
    tl.store(fillers_ptr + slot, assignment, mask=ok & (slot >= 0))
