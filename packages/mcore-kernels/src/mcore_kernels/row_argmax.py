"""Index of the largest value of each row (greedy decoding's ``logits.argmax(-1)``) in one launch.

At decode a handful of rows of ~150k logits are reduced per step. ``torch.argmax`` runs such a
row in few thread blocks, so the reduction takes several microseconds on the critical path of
every step. Here ``chunks`` programs per row each reduce a slice of it, write their best
(value, index) as one 64-bit key to a workspace, and the last program of the row (counted with
an atomic ticket) reduces the keys: one launch, all multiprocessors.

Result: the same index as ``torch.argmax(x, dim=-1)``: the first index of the largest value,
NaN counting as larger than any number (the first NaN wins). A key packs an order-preserving
integer image of the float32 value in its high 32 bits and ``2**32 - 1 - index`` in its low
32 bits, so the largest key holds the largest value and, among equal values, the first index.

Dispatch: Triton on CUDA, ``torch.argmax`` on CPU; ``MCORE_KERNELS_BACKEND=torch|triton``
overrides (with ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors).
"""

from __future__ import annotations

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import CachedLauncher, jit, next_power_of_2, tl, triton
from mcore_kernels.errors import KernelBackendError, KernelDtypeError, KernelShapeError

__all__ = ["row_argmax", "row_argmax_triton"]

_BLOCK = 2048
"""Elements a program reduces per loop iteration."""
_MAX_CHUNKS = 128
"""Programs per row at most (the last one reduces this many keys)."""
_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
"""Ticket buffers replaced by larger ones, kept alive for the graphs that captured them."""


@jit
def _keys(x, offsets):
    """64-bit keys of float32 values ``x`` at ``offsets`` (see the module docstring)."""
    # -0.0 and 0.0 are equal values: both map to the key of 0.0.
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    # Negative floats: flip the magnitude bits so that the signed integers order like floats.
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)
    low = (4294967295 - offsets.to(tl.int64)) & 4294967295
    return (ordered.to(tl.int64) << 32) | low


@jit(do_not_specialize=("N", "stride_row", "CHUNK", "CHUNKS"))
def _row_argmax_kernel(
    x_ptr,
    out_ptr,
    ws_ptr,
    ticket_ptr,
    N,
    stride_row,
    CHUNK,
    CHUNKS,
    BLOCK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -(2**63), tl.int64)
    start = chunk * CHUNK
    for offset in range(0, CHUNK, BLOCK):
        columns = start + offset + lanes
        valid = (columns < N) & (offset + lanes < CHUNK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_row + columns, mask=valid, other=0.0)
        keys = _keys(x.to(tl.float32), columns)
        best = tl.maximum(best, tl.where(valid, keys, -(2**63)))
    key = tl.max(best, axis=0)
    if CHUNKS == 1:
        tl.store(out_ptr + row, 4294967295 - (key & 4294967295))
    else:
        tl.store(ws_ptr + row * CHUNKS + chunk, key)
        # Every program's key is written before its ticket (release) is taken.
        tl.debug_barrier()
        ticket = ticket_ptr + row
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
        if arrived == CHUNKS - 1:
            slots = tl.arange(0, CHUNKS_PAD)
            keys = tl.load(
                ws_ptr + row * CHUNKS + slots,
                mask=slots < CHUNKS,
                other=-(2**63),
                cache_modifier=".cg",
            )
            key = tl.max(keys, axis=0)
            tl.store(out_ptr + row, 4294967295 - (key & 4294967295))
            # Reset for the next launch (graph replays reuse the tickets).
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


_ROW_ARGMAX = CachedLauncher(_row_argmax_kernel)


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per row, that the kernel leaves zeroed."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        if tickets is not None:
            _RETIRED.append(tickets)
        tickets = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] == 0:
        raise KernelShapeError(f"x has shape {tuple(x.shape)}; expected [rows, columns >= 1]")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise KernelDtypeError(f"x is {x.dtype}; expected float32, float16 or bfloat16")


def row_argmax_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton path of :func:`row_argmax` (fixed shapes, graph-safe).

    Each row is reduced by ``ceil(columns / 2048)`` programs (at most 128), one compiled kernel
    per power of two of that count whatever the number of rows.

    Args:
        x: ``[rows, columns]`` floats, last dimension contiguous.

    Returns:
        int64 ``[rows]`` indices.

    Raises:
        KernelShapeError: If ``x`` is not a non-empty matrix with a contiguous last dimension.
        KernelDtypeError: If ``x`` is not float32, float16 or bfloat16.
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    _check(x)
    if x.stride(1) != 1:
        raise KernelShapeError(f"x strides {x.stride()}; expected a contiguous last dimension")
    rows, columns = x.shape
    chunks = min(_MAX_CHUNKS, -(-columns // _BLOCK))
    chunk = -(-columns // chunks)
    chunks = -(-columns // chunk)
    # One allocation for the result and the workspace (host time counts at decode).
    buffer = torch.empty(rows * (chunks + 1), dtype=torch.int64, device=x.device)
    out, ws = buffer[:rows], buffer[rows:]
    if rows == 0:
        return out
    block = min(_BLOCK, next_power_of_2(chunk))
    tickets = _tickets(x.device, rows) if chunks > 1 else ws
    _ROW_ARGMAX(
        (chunks, rows),
        (x, out, ws, tickets, columns, x.stride(0), chunk, chunks),
        {"BLOCK": block, "CHUNKS_PAD": next_power_of_2(chunks)},
        4,
        x.get_device(),
    )
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a matrix: the first index of each row's largest value.

    Args:
        x: ``[rows, columns]`` float32, float16 or bfloat16 values.

    Returns:
        int64 ``[rows]``: the same indices as ``torch.argmax(x, dim=-1)`` (NaN counts as the
        largest value).

    Raises:
        KernelShapeError: If ``x`` is not a non-empty matrix.
        KernelDtypeError: If ``x`` is not float32, float16 or bfloat16.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names an unknown backend or one that
            cannot run on ``x``.
    """
    _check(x)
    if use_triton(x) and x.stride(1) == 1:
        return row_argmax_triton(x)
    return x.argmax(dim=-1)
