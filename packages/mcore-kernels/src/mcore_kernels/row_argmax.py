"""Index of the largest value of each row (greedy decoding's ``logits.argmax(-1)``) in one launch.

At decode a handful to hundreds of rows of ~150k logits are reduced per step. ``torch.argmax``
runs a row in few thread blocks (one H200, 152k-token vocabulary: 21 us at 64 rows, 95 at 512,
where reading the logits takes 5 and 36). Here ``chunks`` programs per row each reduce a slice
of it: every lane of a program keeps its best value and that value's index with one float
comparison per element (replacing its best only by a strictly larger value or a first NaN, so
among equal values it keeps its first), and the program turns its final best into one 64-bit
key; the programs of a row write their keys to a workspace and the last one to arrive (counted
with an atomic ticket) reduces them: one launch, all multiprocessors (3.2 / 9.9 / 34 / 63 us at
1 / 64 / 256 / 512 rows on that GPU; building a key per element instead took 3.5 / 18 / 68 /
133).

Result: the same index as ``torch.argmax(x, dim=-1)``: the first index of the largest value,
NaN counting as larger than any number (the first NaN wins), ``-0.0`` equal to ``0.0``. A key
packs an order-preserving integer image of the float32 value in its high 32 bits and
``2**32 - 1 - index`` in its low 32 bits, so the largest key holds the largest value and, among
equal values, the first index.

Dispatch: Triton on CUDA, the torch reference (``torch.argmax``) on CPU;
``MCORE_KERNELS_BACKEND=torch|triton`` overrides (with ``TRITON_INTERPRET=1`` the Triton path runs
on CPU tensors). While ``torch.compile`` traces a call it becomes the ``torch.library`` op
``torch.ops.mcore_kernels.row_argmax``, which runs the same dispatch when the graph runs.
"""

from __future__ import annotations

import torch

from mcore_kernels import _compile
from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import (
    CachedLauncher,
    TicketPool,
    device_limits,
    jit,
    tl,
    triton,
)
from mcore_kernels.errors import KernelBackendError, KernelDtypeError, KernelShapeError
from mcore_kernels.reference import greedy_feed_reference, row_argmax_reference

__all__ = ["greedy_feed", "row_argmax", "row_argmax_triton"]

_LANES = 2048
"""Elements a program compares per loop iteration (its lanes)."""
_MAX_CHUNKS = 128
"""Programs per row at most (the last one reduces this many keys)."""
_MIN_CHUNKS = 16
"""Programs per row at least (many rows: more programs than multiprocessors keep the loads
in flight; one H200, 512 rows of 152k: 62.6 us with 16 per row against 66.2 with 3)."""
_MANY_ROWS_CHUNKS = (8, 256)
"""``(chunks, min rows)``: launches of at least ``min rows`` rows use ``chunks`` programs per row
instead of :data:`_MIN_CHUNKS` (0: off). One H200, 512 x 151936 bf16 in graph replays: 62.4
against 69.9 us and 62.7 against 63.8 us on two hosts (4 a row 61.5, 12 63.1); 256 rows 35.5
against 35.7 us."""
_PROGRAMS_PER_MULTIPROCESSOR = 8
"""Programs launched per multiprocessor at least (few rows: more programs per row)."""
_TICKETS = TicketPool(1024)
"""Zeroed counters of the ticket reduction (this op's own: see ``TicketPool``)."""


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


@jit
def _store_index(out_ptr, samples_ptr, tokens_ptr, positions_ptr, row, index, FEED: tl.constexpr):
    """Store a row's index; with ``FEED`` also as float64 into ``samples``, into ``tokens``, and
    advance ``positions`` by one (the next decode step's inputs)."""
    index = index.to(tl.int64)
    tl.store(out_ptr + row, index)
    if FEED:
        tl.store(samples_ptr + row, index.to(tl.float64))
        tl.store(tokens_ptr + row, index)
        tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)


@jit(do_not_specialize=("N", "stride_row", "CHUNK", "CHUNKS"))
def _row_argmax_kernel(
    x_ptr,
    out_ptr,
    ws_ptr,
    ticket_ptr,
    samples_ptr,
    tokens_ptr,
    positions_ptr,
    N,
    stride_row,
    CHUNK,
    CHUNKS,
    LANES: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    FEED: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    lanes = tl.arange(0, LANES)
    source = x_ptr + row.to(tl.int64) * stride_row
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, N)
    # The first tile seeds each lane (masked lanes: -inf at an index past every column, so a
    # real -inf of a lower index wins the tie).
    index = start + lanes
    best = tl.load(source + index, mask=index < end, other=float("-inf")).to(tl.float32)
    best_index = index
    for offset in range(start + LANES, end, LANES):
        columns = offset + lanes
        x = tl.load(source + columns, mask=columns < end, other=float("-inf")).to(tl.float32)
        take = (x > best) | ((x != x) & (best == best))
        best = tl.where(take, x, best)
        best_index = tl.where(take, columns, best_index)
    nan_lane = best != best
    any_nan = tl.max(nan_lane.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan_lane, float("-inf"), best), axis=0)
    winners = tl.where(any_nan, nan_lane, best == top)
    first = tl.min(tl.where(winners, best_index, 2147483647), axis=0)
    value = tl.where(any_nan, float("nan"), top)
    key = tl.max(_keys(tl.full([1], 0.0, tl.float32) + value, tl.full([1], 0, tl.int32) + first))
    if CHUNKS == 1:
        _store_index(out_ptr, samples_ptr, tokens_ptr, positions_ptr, row, first, FEED)
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
            best_key = tl.max(keys, axis=0)
            _store_index(
                out_ptr, samples_ptr, tokens_ptr, positions_ptr, row,
                4294967295 - (best_key & 4294967295), FEED,
            )  # fmt: skip
            # Reset for the next launch (graph replays reuse the tickets).
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


_ROW_ARGMAX = CachedLauncher(_row_argmax_kernel)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] == 0:
        raise KernelShapeError(f"x has shape {tuple(x.shape)}; expected [rows, columns >= 1]")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise KernelDtypeError(f"x is {x.dtype}; expected float32, float16 or bfloat16")


def _chunks(rows: int, columns: int, multiprocessors: int) -> int:
    """Programs per row: 16 (:data:`_MANY_ROWS_CHUNKS` for many rows), or more for 8 per
    multiprocessor; each over at least one tile."""
    chunks, min_rows = _MANY_ROWS_CHUNKS
    least = chunks if chunks and rows >= min_rows else _MIN_CHUNKS
    wanted = max(least, -(-_PROGRAMS_PER_MULTIPROCESSOR * multiprocessors // max(rows, 1)))
    return max(1, min(_MAX_CHUNKS, wanted, -(-columns // _LANES)))


def row_argmax_triton(
    x: torch.Tensor,
    *,
    chunks: int | None = None,
    feed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton path of :func:`row_argmax` (fixed shapes, graph-safe).

    Args:
        x: ``[rows, columns]`` floats, last dimension contiguous.
        chunks: Programs per row (None: 16, or more to launch 8 per multiprocessor; at most
            128 and one per 2048 columns).
        feed: ``(samples, tokens, positions)`` of :func:`greedy_feed` (checked there), or None.

    Returns:
        int64 ``[rows]`` indices.

    Raises:
        KernelShapeError: If ``x`` is not a non-empty matrix with a contiguous last dimension,
            or ``chunks`` is below 1.
        KernelDtypeError: If ``x`` is not float32, float16 or bfloat16.
        KernelBackendError: If Triton is not installed.
    """
    if triton is None:
        raise KernelBackendError("backend='triton' requested but triton is not installed")
    _check(x)
    if x.stride(1) != 1:
        raise KernelShapeError(f"x strides {x.stride()}; expected a contiguous last dimension")
    if chunks is not None and chunks < 1:
        raise KernelShapeError(f"chunks={chunks}; expected >= 1")
    rows, columns = x.shape
    if chunks is None:
        chunks = _chunks(rows, columns, device_limits(x.device)[0] if x.is_cuda else 4)
    chunks = min(chunks, _MAX_CHUNKS, -(-columns // _LANES))
    chunk = -(-columns // chunks)
    chunk = -(-chunk // _LANES) * _LANES
    chunks = -(-columns // chunk)
    # One allocation for the result and the workspace (host time counts at decode). The
    # workspace starts 16-byte aligned whatever the row count: Triton specialises a kernel on
    # its pointers' alignment, and a new specialisation is a compile in the request path.
    start = rows + (rows & 1)
    buffer = torch.empty(start + rows * chunks, dtype=torch.int64, device=x.device)
    out, ws = buffer[:rows], buffer[start:]
    if rows == 0:
        return out
    tickets = _TICKETS.get(x.device, rows) if chunks > 1 else ws
    samples, tokens, positions = feed if feed is not None else (ws, ws, ws)
    _ROW_ARGMAX(
        (chunks, rows),
        (x, out, ws, tickets, samples, tokens, positions, columns, x.stride(0), chunk, chunks),
        # A fixed key padding (only the row's last program reads it): one binary for every
        # row count, where the power of two above ``chunks`` made one per band of rows.
        {"LANES": _LANES, "CHUNKS_PAD": _MAX_CHUNKS, "FEED": feed is not None},
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
    if _compile.compiling():
        return _row_argmax_op(x)
    return _row_argmax_run(x)


def _row_argmax_run(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and x.stride(1) == 1:
        return row_argmax_triton(x)
    return row_argmax_reference(x)


@_compile.custom_op("row_argmax", "(Tensor x) -> Tensor")
def _row_argmax_op(x: torch.Tensor) -> torch.Tensor:
    return _row_argmax_run(x)


@_row_argmax_op.register_fake
def _row_argmax_fake(x):
    return x.new_empty(x.shape[0], dtype=torch.int64)


def greedy_feed(
    x: torch.Tensor, samples: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """:func:`row_argmax` that also writes the next decode step's inputs, in the same launch.

    A multi-step decode run of greedy rows (:mod:`mcore_inference.multi_step`) stores each
    step's tokens as float64 samples and feeds them to the next step one position further:
    three more small launches a step after the argmax. Here the program that finishes a row
    writes them all.

    Args:
        x: ``[rows, columns]`` float32, float16 or bfloat16 values.
        samples: float64 ``[rows]``: receives the indices.
        tokens: int64 ``[rows]``: receives the indices.
        positions: int64 ``[rows]``: each incremented by one.

    Returns:
        int64 ``[rows]``: the indices of :func:`row_argmax`.

    Raises:
        KernelShapeError: If ``x`` is not a non-empty matrix, or an output is not ``[rows]``.
        KernelDtypeError: If ``x`` is not float32, float16 or bfloat16, or an output has
            another dtype than the above.
        KernelBackendError: If ``MCORE_KERNELS_BACKEND`` names a backend that cannot run here.
    """
    _check(x)
    rows = x.shape[0]
    for name, tensor, dtype in (
        ("samples", samples, torch.float64),
        ("tokens", tokens, torch.int64),
        ("positions", positions, torch.int64),
    ):
        if tuple(tensor.shape) != (rows,) or (rows > 1 and tensor.stride(0) != 1):
            raise KernelShapeError(
                f"{name} has shape {tuple(tensor.shape)} strides {tensor.stride()}; expected "
                f"a contiguous [{rows}]"
            )
        if tensor.dtype != dtype:
            raise KernelDtypeError(f"{name} {tensor.dtype}; expected {dtype}")
    if _compile.compiling():
        return _greedy_feed_op(x, samples, tokens, positions)
    return _greedy_feed_run(x, samples, tokens, positions)


def _greedy_feed_run(
    x: torch.Tensor, samples: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    if use_triton(x) and x.stride(1) == 1:
        return row_argmax_triton(x, feed=(samples, tokens, positions))
    return greedy_feed_reference(x, samples, tokens, positions)


@_compile.custom_op(
    "greedy_feed",
    "(Tensor x, Tensor(a!) samples, Tensor(b!) tokens, Tensor(c!) positions) -> Tensor",
    mutates_args=("samples", "tokens", "positions"),
)
def _greedy_feed_op(
    x: torch.Tensor, samples: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    return _greedy_feed_run(x, samples, tokens, positions)


@_greedy_feed_op.register_fake
def _greedy_feed_fake(x, samples, tokens, positions):
    return x.new_empty(x.shape[0], dtype=torch.int64)
