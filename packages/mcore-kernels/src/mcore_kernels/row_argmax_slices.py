"""Row argmax of a matrix whose column slices become ready one after another.

A large-batch LM head computed in vocabulary slices (one GEMM per slice) can have each slice
reduced while the next slice's GEMM runs, and while the slice's logits are still in L2.
:class:`SlicedRowArgmax` launches the programs of one column slice per :meth:`reduce` call:
each program reduces part of a row's slice to one 64-bit key (the order-preserving float image
and the inverted column index of :mod:`mcore_kernels.row_argmax`, with the column counted in
the whole matrix), writes it to a workspace slot of its own and takes a ticket of its row; the
program that takes a row's last ticket, over every slice's launch, reduces the row's keys into
the result. The launches may run on any streams and in any order.

Result: the same index as ``torch.argmax(x, dim=-1)`` over the whole matrix: the first index of
the largest value, NaN counting as larger than any number (the first NaN wins), ``-0.0`` equal
to ``0.0``.

Dispatch: Triton on CUDA; on CPU (or with ``MCORE_KERNELS_BACKEND=torch``) each call records
the slice's first largest value and its index, and the call that completes a round (every
slice reduced once) merges them (the same tie rule). With ``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors.
"""

from __future__ import annotations

import itertools

import torch

from mcore_kernels._backend import use_triton
from mcore_kernels._triton_utils import CachedLauncher, jit, next_power_of_2, tl
from mcore_kernels.errors import KernelDtypeError, KernelShapeError
from mcore_kernels.row_argmax import _keys

__all__ = ["SlicedRowArgmax"]

_LANES = 2048
"""Elements a program compares per loop iteration."""
_MAX_SLOTS = 1024
"""Programs per row over every slice at most (the last one reduces this many keys)."""


@jit(do_not_specialize=("stride_row", "column0", "column_end", "CHUNK", "slot0"))
def _slice_argmax_kernel(
    x_ptr,
    out_ptr,
    ws_ptr,
    ticket_ptr,
    stride_row,
    column0,
    column_end,
    CHUNK,
    slot0,
    SLOTS: tl.constexpr,
    LANES: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    lanes = tl.arange(0, LANES)
    source = x_ptr + row.to(tl.int64) * stride_row
    start = column0 + chunk * CHUNK
    end = tl.minimum(start + CHUNK, column_end)
    # Masked lanes: -inf at an index past every column, so a real -inf of a lower index wins.
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
    tl.store(ws_ptr + row * SLOTS + slot0 + chunk, key)
    # Every program's key is written before its ticket (release) is taken.
    tl.debug_barrier()
    ticket = ticket_ptr + row
    arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
    if arrived == SLOTS - 1:
        slots = tl.arange(0, SLOTS_PAD)
        keys = tl.load(
            ws_ptr + row * SLOTS + slots,
            mask=slots < SLOTS,
            other=-(2**63),
            cache_modifier=".cg",
        )
        best_key = tl.max(keys, axis=0)
        tl.store(out_ptr + row, 4294967295 - (best_key & 4294967295))
        # Reset for the next round of launches (graph replays reuse the tickets).
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


_SLICE_ARGMAX = CachedLauncher(_slice_argmax_kernel)


class SlicedRowArgmax:
    """Argmax of every row of a ``[rows, columns]`` matrix, reduced one column slice at a time.

    The slices are the column ranges ``[bounds[i], bounds[i + 1])``. Call :meth:`reduce` once
    for every slice (in any order, on any stream, once the slice's values are written) per
    round; after the last of them the result in :attr:`out` is complete (in the order of the
    streams that ran them). The result, workspace and tickets are allocated here once: the
    launches are fixed-shape and may be captured in a CUDA graph and replayed.

    Args:
        rows: Rows of the matrix (at least 1).
        bounds: Increasing column bounds, starting at 0 and ending at the column count.
        device: Where the matrices live.
        programs_per_slice: Programs per row for each slice (each over at least 2048
            columns; fewer when the slice is narrower). The programs of all slices of a row
            are at most 1024.

    Raises:
        KernelShapeError: If ``rows`` is below 1, the bounds are not increasing from 0, or
            ``programs_per_slice`` is below 1 or makes more than 1024 programs a row.
    """

    def __init__(
        self,
        rows: int,
        bounds: list[int] | tuple[int, ...],
        device: torch.device | str,
        *,
        programs_per_slice: int = 8,
    ) -> None:
        bounds = tuple(int(b) for b in bounds)
        if rows < 1:
            raise KernelShapeError(f"rows={rows}; expected >= 1")
        if len(bounds) < 2 or bounds[0] != 0 or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise KernelShapeError(f"bounds={bounds}; expected increasing from 0, two at least")
        if programs_per_slice < 1:
            raise KernelShapeError(f"programs_per_slice={programs_per_slice}; expected >= 1")
        self.rows = rows
        self.bounds = bounds
        self.device = torch.device(device)
        self._chunks: list[tuple[int, int, int]] = []
        """Per slice: ``(programs, columns per program, first workspace slot)``."""
        slot = 0
        for start, end in itertools.pairwise(bounds):
            width = end - start
            programs = max(1, min(programs_per_slice, -(-width // _LANES)))
            chunk = -(-width // programs)
            chunk = -(-chunk // _LANES) * _LANES
            programs = -(-width // chunk)
            self._chunks.append((programs, chunk, slot))
            slot += programs
        if slot > _MAX_SLOTS:
            raise KernelShapeError(
                f"programs_per_slice={programs_per_slice} makes {slot} programs a row over "
                f"{len(bounds) - 1} slices; expected at most {_MAX_SLOTS}"
            )
        self._slots = slot
        self.out = torch.zeros(rows, dtype=torch.int64, device=self.device)
        """int64 ``[rows]``: the argmax, complete after every slice's :meth:`reduce`."""
        self._keys = torch.zeros(rows, slot, dtype=torch.int64, device=self.device)
        self._tickets = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self._values = torch.zeros(rows, len(bounds) - 1, dtype=torch.float32, device=self.device)
        self._indices = torch.zeros(rows, len(bounds) - 1, dtype=torch.int64, device=self.device)
        self._pending: set[int] = set()
        """Torch path: slices still to reduce in this round."""

    @property
    def slices(self) -> int:
        """Number of column slices."""
        return len(self.bounds) - 1

    def reduce(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Reduce slice ``index`` of ``x`` (only its columns are read).

        Args:
            x: ``[rows, columns]`` float32, float16 or bfloat16, the last dimension
                contiguous; the same matrix (or one of the same shape) in every call of a
                round.
            index: The slice, ``0 <= index < slices``.

        Returns:
            :attr:`out`, the int64 ``[rows]`` result (complete once every slice is reduced).

        Raises:
            KernelShapeError: If ``x`` is not ``[rows, bounds[-1]]`` with a contiguous last
                dimension, or ``index`` is out of range.
            KernelDtypeError: If ``x`` is not float32, float16 or bfloat16.
        """
        if x.dim() != 2 or tuple(x.shape) != (self.rows, self.bounds[-1]) or x.stride(1) != 1:
            raise KernelShapeError(
                f"x has shape {tuple(x.shape)} and strides {x.stride()}; expected "
                f"[{self.rows}, {self.bounds[-1]}] with a contiguous last dimension"
            )
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise KernelDtypeError(f"x is {x.dtype}; expected float32, float16 or bfloat16")
        if not 0 <= index < self.slices:
            raise KernelShapeError(f"index={index}; expected 0 <= index < {self.slices}")
        start, end = self.bounds[index], self.bounds[index + 1]
        if not use_triton(x):
            return self._reduce_reference(x, index, start, end)
        programs, chunk, slot0 = self._chunks[index]
        _SLICE_ARGMAX(
            (programs, self.rows),
            (x, self.out, self._keys, self._tickets, x.stride(0), start, end, chunk, slot0),
            {
                "SLOTS": self._slots,
                "LANES": _LANES,
                "SLOTS_PAD": next_power_of_2(self._slots),
            },
            4,
            x.get_device(),
        )
        return self.out

    def _reduce_reference(self, x: torch.Tensor, index: int, start: int, end: int) -> torch.Tensor:
        """Torch path: the slice's first largest value (NaN largest) and its column; the
        call that completes the round merges them (earlier slices win ties)."""
        if not self._pending:
            self._pending.update(range(self.slices))
        self._pending.discard(index)
        part = x[:, start:end].float()
        local = part.argmax(dim=-1)
        self._values[:, index] = part.gather(1, local[:, None])[:, 0]
        self._indices[:, index] = local + start
        if not self._pending:
            values = self._values
            nan = values.isnan()
            # Keys that order like torch.argmax: NaN above everything, then the value; among
            # equal keys the first slice wins (argmax returns the first maximum).
            ranked = torch.where(nan, torch.full_like(values, float("inf")), values)
            any_nan = nan.any(dim=1, keepdim=True)
            ranked = torch.where(any_nan & ~nan, torch.full_like(values, float("-inf")), ranked)
            best = ranked.argmax(dim=-1, keepdim=True)
            self.out.copy_(self._indices.gather(1, best)[:, 0])
        return self.out
