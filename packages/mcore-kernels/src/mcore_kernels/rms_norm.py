"""Fused residual add + RMSNorm: launch table, Triton kernels, launchers, autograd, custom ops.

The whole op in one module, top to bottom: the launch configurations and how they are chosen per
shape, the Triton kernels, their launchers (with the cached fast paths of repeated calls), the
autograd function, the ``torch.library`` registration and the public API. Its torch reference is
:func:`mcore_kernels.reference.rms_norm_reference`.

Forward: each program normalises ``fwd_rows`` rows held in registers; rows wider than
``MAX_BLOCK`` take a looped variant that streams the row twice (mean square, then normalise).
Backward, two stages: a grid of at most ``programs_per_sm * multiprocessors`` programs walks the
row blocks in a fixed stride, recomputes each row's ``rstd`` from the row it holds in registers
(the forward stores it only for rows wider than ``MAX_BLOCK``), writes ``d(x)`` of every row and
one float32 partial weight gradient per program; a second kernel sums the partials in program
order and rounds once to the weight dtype (a call of one row block runs one straight-line
program that writes the weight gradient directly). The weight gradient is therefore
deterministic, and the warps of each kernel depend on the hidden size only, so a row's outputs
are bitwise the same whatever the number of rows in the call. Every load of a program is issued
before its first reduction, so small launches wait for one memory round trip, not two.

How a launch is chosen per shape: :data:`LAUNCH_CONFIGS` maps the row block width (the hidden
size rounded up to a power of two, at most :data:`MAX_BLOCK`) to the rows per forward program,
its warps and the register cap of the specialised forward, and to the rows per backward
iteration, its warps, programs per multiprocessor and software-pipelining depth. The numbers come from the sweep of
``benchmarks/tune_launch_configs.py`` (per width, the least geometric mean of GPU time over the
fastest time across the row counts) and are looked up once per (hidden size, device) and cached
with the constexprs they imply. The number of rows enters four things only: a row block never
holds more rows than the call (a one-row tile repeats the layout of a row of a larger tile), the
backward's grid (one program per row block up to the cap) and its pipelining (only when a
program walks several row blocks), and a call of one row exactly one block wide, which
``row_programs`` programs share: each loads and reduces the whole row with the entry's layout
(the same bits) and stores its share of the columns (a one-row call waits on one program's
chain of loads, reduction and stores, and on the stores of one SM).

Eager calls go straight to the Triton launchers (through :class:`_RMSNormFunction` when a
gradient is needed); only while ``torch.compile`` traces a call does it become the custom op
``torch.ops.mcore_kernels.rms_norm_fwd`` with the registered backward ``rms_norm_bwd``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from mcore_kernels import _compile
from mcore_kernels._backend import _triton_available, backend_forced, use_triton
from mcore_kernels._triton_utils import (
    _INTERPRETED,
    CachedLauncher,
    device_limits,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    next_power_of_2,
    on_device_of,
    round_to,
    tl,
)
from mcore_kernels._validation import check_rms_norm_args
from mcore_kernels.errors import KernelValueError
from mcore_kernels.pdl import pdl_enabled
from mcore_kernels.reference import rms_norm_parts, rms_norm_reference

__all__ = ["LAUNCH_CONFIGS", "MAX_BLOCK", "RMSNormLaunch", "rms_norm", "RMSNorm"]

# --- launch configurations ----------------------------------------------------------------------

MAX_BLOCK = 8192
"""Widest row held in registers; wider rows are processed in chunks of this many elements."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RMSNormLaunch:
    """Launch parameters of the add + RMSNorm kernels for one row block width."""

    fwd_rows: int
    """Rows normalised by one forward program."""
    fwd_warps: int
    """Warps of a forward program."""
    bwd_rows: int
    """Rows a backward program handles per loop iteration."""
    bwd_warps: int
    """Warps of a backward program."""
    bwd_programs_per_sm: int
    """Backward programs per multiprocessor (the grid is at most this times the SM count)."""
    bwd_stages: int
    """Software-pipelining depth of the backward's row loop, when its buffers fit in shared
    memory (else 1)."""
    row_programs: int = 1
    """Programs sharing a call of one row exactly one block wide (a decode step, a one-token
    call): each loads and reduces the whole row with this entry's layout (the bits of
    the same row in any call) and stores its share of the columns. 1: one program."""
    fwd_max_registers: int = 0
    """Registers a thread of the specialised forward (whole row blocks exactly one block wide)
    may use, passed to ptxas (``maxnreg``); 0: ptxas chooses. The machine code's schedule
    changes, never its arithmetic (the same bits)."""

    def __post_init__(self) -> None:
        for name in ("fwd_rows", "fwd_warps", "bwd_rows", "bwd_warps", "row_programs"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"{name}={value} must be a positive power of two")
        for name in ("bwd_programs_per_sm", "bwd_stages"):
            if getattr(self, name) < 1:
                raise KernelValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.fwd_max_registers and not 24 <= self.fwd_max_registers <= 255:
            raise KernelValueError(
                f"fwd_max_registers={self.fwd_max_registers} must be 0 or in [24, 255]"
            )


LAUNCH_CONFIGS: dict[int, RMSNormLaunch] = {
    256: RMSNormLaunch(
        fwd_rows=4, fwd_warps=4, bwd_rows=8, bwd_warps=4, bwd_programs_per_sm=4, bwd_stages=2
    ),
    1024: RMSNormLaunch(
        fwd_rows=2, fwd_warps=4, bwd_rows=4, bwd_warps=4, bwd_programs_per_sm=4, bwd_stages=2
    ),
    2048: RMSNormLaunch(
        fwd_rows=1,
        fwd_warps=8,
        bwd_rows=4,
        bwd_warps=8,
        bwd_programs_per_sm=1,
        bwd_stages=3,
        row_programs=4,
    ),
    # 16 forward warps (8 before session 11): the specialised kernel, one H200, GPU time in one
    # interleaved loop, 256 / 4096 / 16384 rows: 3.32 / 34.7 / 131.2 us against 3.38 / 35.3 /
    # 131.5 with 8 warps and 3.36 / 35.1 / 131.7 with 4.
    4096: RMSNormLaunch(
        fwd_rows=1,
        fwd_warps=16,
        bwd_rows=2,
        bwd_warps=8,
        bwd_programs_per_sm=1,
        bwd_stages=3,
        row_programs=4,
    ),
    # A cap of 64 registers (ptxas took 40): one H200, session 16 probe r1, 256 x 8192 5.11-5.12
    # against 5.17-5.18 us (1.028-1.033x torch.compile); session 13: 66.8 / 257.0 against 67.1
    # / 259.1 us at 4096 / 16384 x 8192.
    8192: RMSNormLaunch(
        fwd_rows=1,
        fwd_warps=16,
        bwd_rows=1,
        bwd_warps=8,
        bwd_programs_per_sm=1,
        bwd_stages=3,
        row_programs=4,
        fwd_max_registers=64,
    ),
}
"""Launch parameters by row block width: the entry of the smallest width ``>=`` the block is
used (rows wider than ``MAX_BLOCK`` use the 8192 entry with one row per iteration)."""

# Tiles of the partial weight-gradient sum: 128 partial rows x 32 columns per step (H100, 132 to
# 264 partials: 2.6-3.6 us against 3.4-5.0 us for 16 x 64; see docs/benchmarks/kernels.md).
_PARTIAL_SUM_ROWS = 128
_PARTIAL_SUM_COLS = 32


class _Plan(NamedTuple):
    """What a call of one hidden size on one device launches, computed once and cached."""

    block: int
    single: bool
    config: RMSNormLaunch
    cap: int
    exact: bool
    """The row is exactly one row block wide (no column mask)."""
    streaming_bytes: int
    """Calls whose ``x`` holds at most this many bytes load with the evict-first hint."""


def _l2_cache_bytes(device: torch.device) -> int:
    """L2 size of a CUDA device (0 for the CPU: the interpreter ignores eviction hints)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


def _device(index: int) -> torch.device:
    return torch.device("cpu") if index < 0 else torch.device("cuda", index)


@functools.lru_cache(maxsize=256)
def _launch(hidden: int, device_index: int) -> _Plan:
    """Return the launch plan of a hidden size on a device (``get_device()``: -1 is the CPU)."""
    block = min(next_power_of_2(hidden), MAX_BLOCK)
    config = LAUNCH_CONFIGS[min(w for w in LAUNCH_CONFIGS if w >= block)]
    if hidden > block:
        config = RMSNormLaunch(
            fwd_rows=1,
            fwd_warps=config.fwd_warps,
            bwd_rows=1,
            bwd_warps=config.bwd_warps,
            bwd_programs_per_sm=config.bwd_programs_per_sm,
            bwd_stages=1,
        )
    device = _device(device_index)
    multiprocessors, _ = device_limits(device)
    return _Plan(
        block,
        hidden <= block,
        config,
        multiprocessors * config.bwd_programs_per_sm,
        hidden == block,
        _l2_cache_bytes(device) // 2,
    )


# Constexprs of the forward by (row block width, single block, residual, rstd, rows per block,
# flags): a plain dict of small tuples (an ``lru_cache`` keyed by the plan hashes its
# dataclass on every call, 0.8 against 0.2 us).
_FORWARD_CONSTEXPRS: dict[tuple, dict[str, Any]] = {}


def _forward_constexprs(
    plan: _Plan,
    has_residual: bool,
    store_rstd: bool,
    block_rows: int,
    flags: tuple[bool, ...],
    exact: bool = False,
    pdl: bool = False,
    warps: int = 0,
) -> dict[str, Any]:
    key = (plan.block, plan.single, has_residual, store_rstd, block_rows, flags, exact, pdl, warps)
    found = _FORWARD_CONSTEXPRS.get(key)
    if found is None and exact:
        _, wide, evict = flags
        # The specialised kernel of whole row blocks exactly one block wide.
        found = _FORWARD_CONSTEXPRS[key] = {
            "HAS_RESIDUAL": has_residual,
            "BLOCK_M": block_rows,
            "BLOCK": plan.block,
            "WIDE": wide,
            "ROW_HINT": 1 if evict else 0,
            "WEIGHT_HINT": 2 if evict else 0,
            # One row per program: its sum of squares gathers the warps' sums in every warp
            # (warps: the launch's, 0 for tl.sum).
            "SUM_WARPS": warps if block_rows == 1 else 0,
        }
    elif found is None:
        even, wide, evict = flags
        found = _FORWARD_CONSTEXPRS[key] = {
            "HAS_RESIDUAL": has_residual,
            "STORE_RSTD": store_rstd,
            "BLOCK_M": block_rows,
            "BLOCK": plan.block,
            "SINGLE_BLOCK": plan.single,
            "EVEN": even,
            "WIDE": wide,
            # Eviction hints of _load: the rows evict first, the weight last (0: none).
            "ROW_HINT": 1 if evict else 0,
            "WEIGHT_HINT": 2 if evict else 0,
            "USE_PDL": pdl,
        }
    return found


def _backward_stages(config: RMSNormLaunch, block: int, streamed: int, device: torch.device) -> int:
    """Pipelining depth of the backward: each stage buffers one row block of every input."""
    _, shared = device_limits(device)
    stage_bytes = config.bwd_rows * block * streamed * 2  # an upper bound of a smaller block
    return config.bwd_stages if config.bwd_stages * stage_bytes <= shared - 16 * 1024 else 1


# --- Triton kernels ---------------------------------------------------------------------------


@jit
def _load(pointers, mask, EVEN: tl.constexpr, HINT: tl.constexpr):
    # Masked unless the block is known to be in bounds; HINT 0: no eviction hint, 1: evict
    # first, 2: evict last.
    policy: tl.constexpr = "evict_first" if HINT == 1 else ("evict_last" if HINT == 2 else "")
    if EVEN:
        value = tl.load(pointers, eviction_policy=policy)
    else:
        value = tl.load(pointers, mask=mask, other=0.0, eviction_policy=policy)
    return value


@jit
def _row_sum_of_squares(h, BLOCK: tl.constexpr, WARPS: tl.constexpr, VECTOR: tl.constexpr):
    # Sum of squares of one row ``h`` ([1, BLOCK] float32 in the layout of 16-byte loads on
    # WARPS warps: thread t of warp w holds VECTOR columns from (c * WARPS + w) * 32 * VECTOR +
    # t * VECTOR for each of the row's chunks c), as a [1] tensor. It adds in the order of
    # ``tl.sum(h * h, axis=1)`` under Triton 3.6 (each thread's elements in column order, the
    # lanes' butterfly, then the warps' sums in a butterfly with the warps half apart first),
    # so its bits are the same; it only moves the warps' sums differently. ``tl.sum`` stores
    # them to shared memory, lets eight lanes of warp 0 reduce them and broadcasts the result
    # through shared memory again (two barriers); here every lane of every warp gathers the
    # sums and reduces them itself (one barrier, about 0.03 us less at one row).
    CHUNKS: tl.constexpr = BLOCK // (WARPS * 32 * VECTOR)
    if CHUNKS == 1:
        warp_rows = tl.reshape(h * h, [WARPS, BLOCK // WARPS])
    else:
        by_chunk = tl.reshape(h * h, [CHUNKS, WARPS, 32 * VECTOR])
        warp_rows = tl.reshape(tl.permute(by_chunk, (1, 0, 2)), [WARPS, BLOCK // WARPS])
    warp_sums = tl.sum(warp_rows, axis=1)
    # The gather's result has the layout of its index (every lane holds one warp's sum), so
    # the last sum is a butterfly inside each warp.
    return tl.expand_dims(tl.sum(tl.gather(warp_sums, tl.arange(0, WARPS), 0), axis=0), 0)


@jit
def _sum_of_squares(h, x_dtype: tl.constexpr, SUM_WARPS: tl.constexpr):
    # Per row of ``h`` ([rows, BLOCK] float32): ``tl.sum(h * h, axis=1)``, or with the same
    # bits _row_sum_of_squares for one row of a 16-bit dtype (SUM_WARPS: the launch's warps,
    # 0: plain). A thread's loads are 16 bytes wide (8 elements), or narrower when the row
    # gives each thread fewer elements. The interpreter always takes ``tl.sum`` (its sums are
    # NumPy's).
    plain: tl.constexpr = _INTERPRETED or SUM_WARPS == 0 or x_dtype.primitive_bitwidth != 16
    if plain or h.shape[0] != 1 or h.shape[1] < 32 * SUM_WARPS:
        total = tl.sum(h * h, axis=1)
    else:
        BLOCK: tl.constexpr = h.shape[1]
        VECTOR: tl.constexpr = 8 if BLOCK >= 256 * SUM_WARPS else BLOCK // (32 * SUM_WARPS)
        total = _row_sum_of_squares(h, BLOCK, SUM_WARPS, VECTOR)
    return total


@jit
def _store(pointers, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(pointers, value)
    else:
        tl.store(pointers, value, mask=mask)


# The row count (an inference step's token count) is not specialised: its `== 1` and
# `% 16` classes would compile a kernel per class in the request path, and the row mask
# (or EVEN) does not use them.
@jit(do_not_specialize=["rows"])
def _rms_norm_fwd_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    rstd_ptr,
    rows,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    WIDE: tl.constexpr,
    ROW_HINT: tl.constexpr,
    WEIGHT_HINT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # Programmatic dependent launch: the next kernel may start; the previous one's outputs
        # are read (and ours written) only after gdc_wait (the weight is not such an output).
        gdc_launch_dependents()
    # 32-bit offsets unless the tensors hold 2**31 elements or more (fewer integer operations
    # on the path to each load).
    if WIDE:
        first = tl.program_id(0).to(tl.int64) * BLOCK_M
    else:
        first = tl.program_id(0) * BLOCK_M
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        row_ids = first + tl.arange(0, BLOCK_M)
        row_mask = row_ids < rows
        col_mask = cols < hidden
        mask = row_mask[:, None] & col_mask[None, :]
        # Every load is issued before the first reduction: loads placed after it would wait
        # for the reduction's barrier and add a memory round trip to each program. Small calls
        # stream their rows through L2 (evict first) and keep the weight (evict last).
        w = _load(weight_ptr + cols, col_mask, EVEN, WEIGHT_HINT)
        if USE_PDL:
            gdc_wait()
        x = _load(
            x_ptr + row_ids[:, None] * x_row_stride + cols[None, :],
            mask,
            EVEN,
            ROW_HINT,
        )
        w = w.to(tl.float32)
        if HAS_RESIDUAL:
            r = _load(
                residual_ptr + row_ids[:, None] * residual_row_stride + cols[None, :],
                mask,
                EVEN,
                ROW_HINT,
            )
            # Rounded to the input dtype before normalising, as Hugging Face models do.
            x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
            _store(hidden_out_ptr + row_ids[:, None] * hidden + cols[None, :], x, mask, EVEN)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / hidden + eps)
        y = round_to(h * rstd[:, None] * w[None, :], y_ptr.dtype.element_ty)
        _store(y_ptr + row_ids[:, None] * hidden + cols[None, :], y, mask, EVEN)
        if STORE_RSTD:
            tl.store(rstd_ptr + row_ids, rstd, mask=row_mask)
    else:
        if USE_PDL:
            gdc_wait()
        x_row = x_ptr + first * x_row_stride
        r_row = residual_ptr + first * residual_row_stride
        h_row = hidden_out_ptr + first * hidden
        y_row = y_ptr + first * hidden
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + offs, mask=mask, other=0.0)
                x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
                tl.store(h_row + offs, x, mask=mask)
            h = x.to(tl.float32)
            sum_sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            if HAS_RESIDUAL:
                h = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, round_to(h * rstd * w, y_ptr.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(rstd_ptr + first, rstd)


@jit
def _rms_norm_fwd_exact_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
    ROW_HINT: tl.constexpr,
    WEIGHT_HINT: tl.constexpr,
    SUM_WARPS: tl.constexpr,
):
    # The forward of contiguous rows exactly BLOCK wide in whole row blocks: no masks, no row
    # count, the row stride is the constexpr width. The arithmetic is the general kernel's
    # single-block path (same reduction layout for the same BLOCK_M, BLOCK and warps; the
    # mean divides by the same power of two), so its outputs are bitwise the same.
    if WIDE:
        first = tl.program_id(0).to(tl.int64) * BLOCK_M
    else:
        first = tl.program_id(0) * BLOCK_M
    cols = tl.arange(0, BLOCK)
    offs = (first + tl.arange(0, BLOCK_M))[:, None] * BLOCK + cols[None, :]
    w = _load(weight_ptr + cols, None, True, WEIGHT_HINT)
    x = _load(x_ptr + offs, None, True, ROW_HINT)
    w = w.to(tl.float32)
    if HAS_RESIDUAL:
        r = _load(residual_ptr + offs, None, True, ROW_HINT)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
        tl.store(hidden_out_ptr + offs, x)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(_sum_of_squares(h, x_ptr.dtype.element_ty, SUM_WARPS) / BLOCK + eps)
    tl.store(y_ptr + offs, round_to(h * rstd[:, None] * w[None, :], y_ptr.dtype.element_ty))


@jit
def _rms_norm_fwd_row_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    hidden_out_ptr,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    ROW_HINT: tl.constexpr,
    WEIGHT_HINT: tl.constexpr,
    SUM_WARPS: tl.constexpr,
):
    # One row exactly BLOCK wide on PROGRAMS programs of the specialised kernel's layout (same
    # warps, same arithmetic: its bits): what bounds a one-row call is one program's chain of
    # loads, reduction and stores, and the stores of one SM; every program loads and reduces
    # the whole row and stores its 1 / PROGRAMS of the columns (loading only that share of
    # the weight).
    # The row's offsets count from the program's row (0 here, the launch has PROGRAMS programs)
    # and the share from its rest: the same addresses and arithmetic, and, measured on one H200
    # (session 16, probe r1), 0.01 us less per call at 1 x 2048 than offsets without the row
    # (the machine code is scheduled differently).
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    columns = tl.arange(0, 1)[:, None] * BLOCK + cols[None, :]
    offs = (program // PROGRAMS) * BLOCK + columns
    mine = ((cols // (BLOCK // PROGRAMS)) == program % PROGRAMS)[None, :]
    w = _load(weight_ptr + columns, mine, False, WEIGHT_HINT)
    x = _load(x_ptr + offs, None, True, ROW_HINT)
    w = w.to(tl.float32)
    if HAS_RESIDUAL:
        r = _load(residual_ptr + offs, None, True, ROW_HINT)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
        tl.store(hidden_out_ptr + offs, x, mask=mine)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(_sum_of_squares(h, x_ptr.dtype.element_ty, SUM_WARPS) / BLOCK + eps)
    y = round_to(h * rstd[:, None] * w, y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=mine)


@jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@jit
def _row_grads(dy, h, dh, w, eps, hidden, HAS_DHIDDEN_OUT: tl.constexpr):
    # d(x) of a block of rows held in registers (float32) and the normalised rows (the
    # weight-gradient terms are dy * normed). The row is in registers: recomputing its rstd costs no memory traffic. Both
    # row sums come from one reduction (sum(dy * w * normed) = rstd * sum(dy * w * h)): a single
    # pass through shared memory and one barrier instead of two in a row.
    dyw = dy * w[None, :]
    sum_sq, sum_dyw_h = tl.reduce((h * h, dyw * h), axis=1, combine_fn=_add_pairs)
    rstd = 1.0 / tl.sqrt(sum_sq / hidden + eps)
    normed = h * rstd[:, None]
    correction = rstd * sum_dyw_h / hidden
    dx = rstd[:, None] * (dyw - normed * correction[:, None])
    if HAS_DHIDDEN_OUT:
        dx += dh
    return dx, normed


@jit
def _backward_rows(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    dx_ptr,
    w,
    row_ids,
    rows,
    hidden_row_stride,
    hidden,
    eps,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Writes d(x) of a block of rows and returns their weight-gradient terms dy * normed.
    cols = tl.arange(0, BLOCK)
    row_mask = row_ids < rows
    mask = row_mask[:, None] & (cols < hidden)[None, :]
    offs = row_ids[:, None] * hidden + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(
        hidden_ptr + row_ids[:, None] * hidden_row_stride + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    dh = dy
    if HAS_DHIDDEN_OUT:
        # Loaded before the reductions, as in the forward.
        dh = tl.load(dhidden_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dx, normed = _row_grads(dy, h, dh, w, eps, hidden, HAS_DHIDDEN_OUT)
    tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
    return dy * normed


@jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    weight_ptr,
    rstd_ptr,
    dx_ptr,
    dweight_ptr,
    rows,
    hidden_row_stride,
    hidden,
    eps,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FINAL: tl.constexpr,
):
    # Program p handles row blocks p, p + P, p + 2P ... and owns row p of the partials.
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    program64 = program.to(tl.int64)
    out_row = dweight_ptr + program64 * hidden
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        col_mask = cols < hidden
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if FINAL:
            # The whole call is one row block: straight-line code, no loop to set up.
            contribution = _backward_rows(
                dy_ptr,
                dhidden_out_ptr,
                hidden_ptr,
                dx_ptr,
                w,
                tl.arange(0, BLOCK_M).to(tl.int64),
                rows,
                hidden_row_stride,
                hidden,
                eps,
                HAS_DHIDDEN_OUT,
                BLOCK,
            )
            total = tl.sum(contribution, axis=0)
            tl.store(out_row + cols, round_to(total, dweight_ptr.dtype.element_ty), mask=col_mask)
        else:
            # Every program has at least one row block: the grid never exceeds their number.
            iterations = tl.cdiv(tl.cdiv(rows, BLOCK_M) - program, programs)
            dw = tl.zeros([BLOCK_M, BLOCK], dtype=tl.float32)
            # Pipelining keeps the next row blocks' loads in flight while this one is reduced.
            for i in tl.range(0, iterations, num_stages=NUM_STAGES):
                row_ids = (program64 + i * programs) * BLOCK_M + tl.arange(0, BLOCK_M)
                dw += _backward_rows(
                    dy_ptr,
                    dhidden_out_ptr,
                    hidden_ptr,
                    dx_ptr,
                    w,
                    row_ids,
                    rows,
                    hidden_row_stride,
                    hidden,
                    eps,
                    HAS_DHIDDEN_OUT,
                    BLOCK,
                )
            tl.store(out_row + cols, tl.sum(dw, axis=0), mask=col_mask)
    else:
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            tl.store(out_row + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < hidden)
        for i in range(0, tl.cdiv(rows - program, programs)):
            row64 = program64 + i * programs
            rstd = tl.load(rstd_ptr + row64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, hidden, BLOCK):
                offs = start + cols
                mask = offs < hidden
                dy = tl.load(dy_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + row64 * hidden_row_stride + offs, mask=mask, other=0.0)
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                acc += dy * w * h.to(tl.float32) * rstd
            correction = tl.sum(acc, axis=0) / hidden
            for start in range(0, hidden, BLOCK):
                offs = start + cols
                mask = offs < hidden
                dy = tl.load(dy_ptr + row64 * hidden + offs, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + row64 * hidden_row_stride + offs, mask=mask, other=0.0)
                w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                normed = h.to(tl.float32) * rstd
                dx = rstd * (dy * w - normed * correction)
                if HAS_DHIDDEN_OUT:
                    dh = tl.load(dhidden_out_ptr + row64 * hidden + offs, mask=mask, other=0.0)
                    dx += dh.to(tl.float32)
                dx_out = round_to(dx, dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + row64 * hidden + offs, dx_out, mask=mask)
                dw = tl.load(out_row + offs, mask=mask, other=0.0)
                tl.store(out_row + offs, dw + dy * normed, mask=mask)


@jit
def _rms_norm_bwd_exact_kernel(
    dy_ptr,
    dhidden_out_ptr,
    hidden_ptr,
    weight_ptr,
    dx_ptr,
    dweight_ptr,
    eps,
    HAS_DHIDDEN_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The backward of a call that is one row block of contiguous rows exactly BLOCK wide (one
    # program, which writes the weight gradient directly): no masks, no row count or strides.
    # The arithmetic is the general kernel's one-program path, so the bits are the same.
    cols = tl.arange(0, BLOCK)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK + cols[None, :]
    w = tl.load(weight_ptr + cols).to(tl.float32)
    dy = tl.load(dy_ptr + offs).to(tl.float32)
    h = tl.load(hidden_ptr + offs).to(tl.float32)
    dh = dy
    if HAS_DHIDDEN_OUT:
        dh = tl.load(dhidden_out_ptr + offs).to(tl.float32)
    dx, normed = _row_grads(dy, h, dh, w, eps, BLOCK, HAS_DHIDDEN_OUT)
    tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty))
    total = tl.sum(dy * normed, axis=0)
    tl.store(dweight_ptr + cols, round_to(total, dweight_ptr.dtype.element_ty))


@jit
def _sum_partials_kernel(
    partial_ptr, out_ptr, programs, hidden, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr
):
    # Blocks of BLOCK_P partial rows are added in program order: the sum is deterministic.
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    acc = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        part = start + tl.arange(0, BLOCK_P)
        mask = (part < programs)[:, None] & col_mask[None, :]
        offs = part.to(tl.int64)[:, None] * hidden + cols[None, :]
        acc += tl.load(partial_ptr + offs, mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, round_to(total, out_ptr.dtype.element_ty), mask=col_mask)


# --- launchers ----------------------------------------------------------------------------------

_SUM_CONSTEXPRS = {"BLOCK_P": _PARTIAL_SUM_ROWS, "BLOCK_H": _PARTIAL_SUM_COLS}
_FORWARD = CachedLauncher(_rms_norm_fwd_kernel)
_FORWARD_EXACT = CachedLauncher(_rms_norm_fwd_exact_kernel)
# The specialised forward compiled under a register cap, one launcher per cap.
_FORWARD_EXACT_CAPPED: dict[int, CachedLauncher] = {}


def _exact_launcher(max_registers: int) -> CachedLauncher:
    if not max_registers:
        return _FORWARD_EXACT
    launcher = _FORWARD_EXACT_CAPPED.get(max_registers)
    if launcher is None:
        launcher = _FORWARD_EXACT_CAPPED[max_registers] = CachedLauncher(
            _rms_norm_fwd_exact_kernel, maxnreg=max_registers
        )
    return launcher


_FORWARD_ROW = CachedLauncher(_rms_norm_fwd_row_kernel)
# Inside mcore_kernels.pdl.programmatic_dependent_launch (the engine's decode steps).
_FORWARD_PDL = CachedLauncher(_rms_norm_fwd_kernel, launch_pdl=True)
_BACKWARD = CachedLauncher(_rms_norm_bwd_kernel)
_BACKWARD_EXACT = CachedLauncher(_rms_norm_bwd_exact_kernel)
_SUM_PARTIALS = CachedLauncher(_sum_partials_kernel)


_ALIGNED = 15  # low address bits that must be zero for the 16-byte specialisation
# Elements from which the forward's offsets are 64-bit (a block's offsets stay below 2**31).
_WIDE_ELEMENTS = 2**31 - 2 * MAX_BLOCK
_I32_MAX = 2**31 - 1


def _int_class(value: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an int argument on: ``== 1``, ``% 16 == 0``, 32-bit range."""
    return value == 1, not value & 15, value <= _I32_MAX


# Calls seen before, by (rows, hidden, device, x dtype, weight dtype, residual?): the compiled
# forward launch and its grid, so that a repeated call only allocates and launches (the host
# work of a one-row call is what it costs). Only calls without a stored rstd and with the
# 16-byte aligned inputs the key was built for take it; the others take the full path.
_FAST_FORWARD: dict[tuple, tuple] = {}
# By (shape of hidden_states, device, dy, d(hidden), hidden and weight dtypes, d(hidden)
# given?): the backward's compiled launch with its grid, the row count, hidden size and device
# it was built for, and for calls of several programs the partial sum's compiled launch, its
# grid and a template of the float32 partials (one element expanded to programs x hidden:
# ``empty_like`` of it is a contiguous buffer, for about half the host time of ``new_empty``).
# Keyed by shape, so a training run of varying lengths adds entries: past the limit the table
# starts again (the calls it drops refill it through the general path).
_FAST_BACKWARD: dict[tuple, tuple] = {}
_FAST_BACKWARD_LIMIT = 4096
# Read only for CUDA tensors (a build without CUDA never reaches them).
_current_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device: Any = getattr(torch._C, "_cuda_getDevice", lambda: -1)


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    for_backward: bool,
    config: RMSNormLaunch | None = None,
    specialise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward: ``(y, x + residual or x, rstd or None)``.

    ``rstd`` is stored only ``for_backward`` of rows wider than ``MAX_BLOCK`` (the backward of
    narrower rows recomputes it). ``config`` overrides the table's launch parameters (the
    tuner's sweep). Calls of whole row blocks of rows exactly one block wide run the
    specialised kernel (no masks, no row count or strides: the bits of the general kernel);
    ``specialise=False`` runs the general kernel for them (the tests compare the two).
    """
    # Contiguous tensors go to the kernel as they are (rows of ``hidden`` elements): no
    # reshapes or views on the hot path; other layouts are copied once.
    hidden = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    rows = x.numel() // hidden
    # ``empty_like`` is the cheapest allocation from Python (about half of ``torch.empty`` with
    # keyword arguments on the H100 machine's host).
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    device_index = x.get_device()
    pdl = pdl_enabled(x.device)
    signature = (rows, hidden, device_index, x.dtype, weight.dtype, residual is not None, pdl)
    # Rows wider than MAX_BLOCK store rstd for the backward: not a launch of the fast path.
    fast = None
    if config is None and specialise and (not for_backward or hidden <= MAX_BLOCK):
        fast = _FAST_FORWARD.get(signature)
    if fast is not None:
        # A call like one launched before: its compiled kernel and grid, nothing recomputed.
        run, function, metadata, tail, programs, exact = fast
        r = residual if residual is not None else x
        xa, ra, wa, ya = x.data_ptr(), r.data_ptr(), weight.data_ptr(), y.data_ptr()
        if not (xa | ra | wa) & _ALIGNED:
            stream = _current_stream(device_index)
            if exact:
                run(programs, 1, 1, stream, function, metadata, None, None, None, xa, ra, wa, ya,
                    h.data_ptr(), eps, *tail)  # fmt: skip
            else:
                run(programs, 1, 1, stream, function, metadata, None, None, None, xa, ra, wa, ya,
                    h.data_ptr(), ya, rows, hidden, hidden, hidden, eps, *tail)  # fmt: skip
            return y, h, None
    plan = _launch(hidden, device_index)
    store_rstd = for_backward and not plan.single
    rstd = x.new_empty(rows, dtype=torch.float32) if store_rstd else None
    if rows == 0:
        return y, h, rstd
    has_residual = residual is not None
    tuned = config is None
    if config is None:
        config = plan.config
    # A row block never holds more rows than the call (same layout of a row, fewer idle rows
    # in the tile).
    block_rows = config.fwd_rows if rows >= config.fwd_rows else next_power_of_2(rows)
    elements = rows * hidden
    # PDL launches keep the general kernel (the specialised one has no grid-dependency wait).
    exact = specialise and not pdl and plan.exact and not rows % block_rows
    flags = (
        # No mask: whole row blocks of rows exactly one block wide.
        plan.exact and not rows % block_rows,
        # 64-bit offsets only where 32 bits could overflow.
        elements >= _WIDE_ELEMENTS,
        # Calls whose inputs fit in half the L2 cache stream them with the evict-first hint
        # (H200, one CUDA graph over L2-cold inputs: 256 x 2048 2.50 against 2.72 us, 4096 x
        # 2048 18.0 against 18.5 us); larger calls are 2-5 % slower with it and load plainly.
        elements * x.itemsize <= plan.streaming_bytes,
    )
    r = residual if residual is not None else x
    addresses = x.data_ptr(), r.data_ptr(), weight.data_ptr()
    aligned = not (addresses[0] | addresses[1] | addresses[2]) & _ALIGNED
    # The gathered sum of squares (the bits of tl.sum) follows the layout of 16-byte loads,
    # which Triton gives aligned inputs only: other calls keep tl.sum (0 warps).
    sum_warps = config.fwd_warps if aligned else 0
    constexprs = _forward_constexprs(
        plan,
        has_residual,
        store_rstd,
        block_rows,
        flags,
        exact=exact,
        pdl=pdl,
        warps=sum_warps,
    )
    stats = rstd if rstd is not None else y
    programs = -(-rows // block_rows)
    args: tuple
    if exact and rows == 1 and config.row_programs > 1:
        # One row: its columns' stores shared by row_programs programs (the same bits).
        launcher, args = _FORWARD_ROW, (x, r, weight, y, h, eps)
        constexprs = _row_constexprs(plan, config, has_residual, flags[2], sum_warps)
        programs = config.row_programs
    elif exact:
        # rstd is never stored here: rows of at most MAX_BLOCK recompute it in the backward.
        launcher = _exact_launcher(config.fwd_max_registers)
        args = (x, r, weight, y, h, eps)
    else:
        launcher = _FORWARD_PDL if pdl else _FORWARD
        args = (x, r, weight, y, h, stats, rows, hidden, hidden, hidden, eps)
    if tuned and aligned:
        # Fresh outputs are aligned: the specialisation follows from what is known here.
        y_address = y.data_ptr()
        stats_address = stats.data_ptr() if store_rstd else y_address
        tail = (eps,) if exact else (stats_address, rows, hidden, hidden, hidden, eps)
        key = (hidden, device_index, x.dtype, weight.dtype, has_residual, store_rstd, block_rows,
               flags, _int_class(rows), pdl)  # fmt: skip
        launcher.keyed(key, programs, args, (*addresses, y_address, h.data_ptr(), *tail),
                       constexprs, config.fwd_warps, device_index)  # fmt: skip
        entry = launcher.entry(key)
        if entry is not None and specialise and not store_rstd and type(eps) is float:
            _FAST_FORWARD[signature] = (*entry, programs, exact)
    else:
        launcher((programs,), args, constexprs, config.fwd_warps, device_index)
    return y, h, rstd


def _row_constexprs(
    plan: _Plan, config: RMSNormLaunch, has_residual: bool, evict: bool, sum_warps: int
) -> dict[str, Any]:
    """Constexprs of the one-row kernel (cached beside the forward's)."""
    key = ("row", plan.block, config.row_programs, has_residual, evict, sum_warps)
    found = _FORWARD_CONSTEXPRS.get(key)
    if found is None:
        found = _FORWARD_CONSTEXPRS[key] = {
            "HAS_RESIDUAL": has_residual,
            "BLOCK": plan.block,
            "PROGRAMS": config.row_programs,
            "ROW_HINT": 1 if evict else 0,
            "WEIGHT_HINT": 2 if evict else 0,
            "SUM_WARPS": sum_warps,
        }
    return found


def _backward(
    dy: torch.Tensor,
    dhidden_out: torch.Tensor | None,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor | None,
    eps: float,
    config: RMSNormLaunch | None = None,
    specialise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward: ``(d(hidden_states), d(weight))`` in the inputs' dtypes.

    ``rstd`` is the forward's stored statistic, needed only by rows wider than ``MAX_BLOCK``
    (narrower rows recompute it from ``hidden_states``). ``config`` overrides the table's launch
    parameters (the tuner's sweep). A call that is one row block of rows exactly one block wide
    runs the specialised one-program kernel (no masks, no row count or strides: the bits of the
    general kernel); ``specialise=False`` runs the general kernel for it (the tests compare).
    """
    hidden = hidden_states.shape[-1]
    h2 = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
    dy2 = dy if dy.is_contiguous() else dy.contiguous()
    dh2 = dy2
    if dhidden_out is not None:
        dh2 = dhidden_out if dhidden_out.is_contiguous() else dhidden_out.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if config is None and specialise and rstd is None:
        done = _backward_cached(dy2, dhidden_out if dhidden_out is None else dh2, h2, weight, eps)
        if done is not None:
            return done
    rows = h2.numel() // hidden
    dx = torch.empty_like(h2)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    device_index = h2.get_device()
    signature = (h2.shape, device_index, dy2.dtype, dh2.dtype, h2.dtype, weight.dtype)
    block, single, chosen, cap, exact_width, _ = _launch(hidden, device_index)
    if rstd is None:
        if not single:
            raise KernelValueError(f"rows of {hidden} > MAX_BLOCK={MAX_BLOCK} need the stored rstd")
        rstd = dy2
    tuned = config is None
    if config is None:
        config = chosen
    else:
        cap = device_limits(_device(device_index))[0] * config.bwd_programs_per_sm
    # A row block never holds more rows than the call: a one-token backward runs a one-row
    # tile (2.0 against 3.0 us at hidden 2048 on an H100), with the same layout of each row.
    block_rows = config.bwd_rows if rows >= config.bwd_rows else next_power_of_2(rows)
    blocks = -(-rows // block_rows)
    programs = min(blocks, cap)
    final = programs == 1 and single
    # A pipeline overlaps one row block's loads with the previous one's reduction: with one
    # block per program there is nothing to overlap, and its shared-memory round trip only
    # adds latency.
    stages = 1
    if single and blocks > programs:
        stages = _backward_stages(
            config, block, 3 if dhidden_out is not None else 2, _device(device_index)
        )
    dweight = torch.empty_like(weight)
    has_dhidden = dhidden_out is not None
    exact = final and exact_width and specialise and rows == block_rows
    partial = dweight if final else weight.new_empty((programs, hidden), dtype=torch.float32)
    args: tuple
    if exact:
        # One program of rows exactly one block wide: no masks, no row count or strides.
        launcher, args = _BACKWARD_EXACT, (dy2, dh2, h2, weight, dx, dweight, eps)
        constexprs = {"HAS_DHIDDEN_OUT": has_dhidden, "BLOCK_M": block_rows, "BLOCK": block}
    else:
        launcher, args = _BACKWARD, (dy2, dh2, h2, weight, rstd, dx, partial, rows, hidden,
                                     hidden, eps)  # fmt: skip
        constexprs = {
            "HAS_DHIDDEN_OUT": has_dhidden,
            "BLOCK_M": block_rows,
            "BLOCK": block,
            "SINGLE_BLOCK": single,
            "NUM_STAGES": stages,
            "FINAL": final,
        }
    inputs = dy2.data_ptr(), dh2.data_ptr(), h2.data_ptr(), weight.data_ptr(), rstd.data_ptr()
    fast = None
    if tuned and not (inputs[0] | inputs[1] | inputs[2] | inputs[3] | inputs[4]) & _ALIGNED:
        key = (hidden, device_index, dy2.dtype, dh2.dtype, h2.dtype, weight.dtype, rstd.dtype,
               has_dhidden, block_rows, stages, final, _int_class(rows))  # fmt: skip
        tail = (eps,) if exact else (rows, hidden, hidden, eps)
        addresses = (*inputs[: 4 if exact else 5], dx.data_ptr(), partial.data_ptr(), *tail)
        launcher.keyed(key, programs, args, addresses, constexprs, config.bwd_warps, device_index)
        entry = launcher.entry(key)
        if entry is not None and specialise and rstd is dy2 and type(eps) is float:
            fast = (*entry, programs, exact, rows, hidden, device_index)
    else:
        launcher((programs,), args, constexprs, config.bwd_warps, device_index)
    sums = None
    if not final:
        sum_key = (hidden, device_index, weight.dtype, _int_class(programs))
        columns = -(-hidden // _PARTIAL_SUM_COLS)
        _SUM_PARTIALS.keyed(
            sum_key,
            columns,
            (partial, dweight, programs, hidden),
            (partial.data_ptr(), dweight.data_ptr(), programs, hidden),
            _SUM_CONSTEXPRS,
            4,
            device_index,
        )
        sum_entry = _SUM_PARTIALS.entry(sum_key) if fast is not None else None
        # Not while a CUDA graph is captured: the template would hold a block of its pool.
        if sum_entry is None or (h2.is_cuda and torch.cuda.is_current_stream_capturing()):
            fast = None
        else:
            sums = (*sum_entry, columns, partial.new_empty(1).expand(programs, hidden))
    if fast is not None:
        # Later calls of this shape launch the same kernels with the same arguments (fresh
        # outputs are aligned like these): the same bits, from _backward_cached.
        if len(_FAST_BACKWARD) >= _FAST_BACKWARD_LIMIT:
            _FAST_BACKWARD.clear()
        _FAST_BACKWARD[(*signature, has_dhidden)] = (*fast, sums)
    return dx, dweight


def _backward_cached(
    dy: torch.Tensor,
    dhidden_out: torch.Tensor | None,
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The backward of a call like one launched before, from the fast table.

    Allocates the outputs (and the float32 partials of a call of several programs) and
    launches the compiled kernels, nothing else; returns None when the call is not in the
    table or its tensors are not the contiguous, 16-byte aligned ones on the current device
    that the entry was built for (the caller then takes :func:`_backward`).
    """
    dh = dy if dhidden_out is None else dhidden_out
    fast = _FAST_BACKWARD.get(
        (
            hidden_states.shape,
            hidden_states.get_device(),
            dy.dtype,
            dh.dtype,
            hidden_states.dtype,
            weight.dtype,
            dhidden_out is not None,
        )
    )
    if fast is None:
        return None
    run, function, metadata, tail, programs, exact, rows, hidden, device_index, sums = fast
    ya, ha, xa, wa = dy.data_ptr(), dh.data_ptr(), hidden_states.data_ptr(), weight.data_ptr()
    if (
        (ya | ha | xa | wa) & _ALIGNED
        or not (dy.is_contiguous() and dh.is_contiguous() and hidden_states.is_contiguous())
        or not weight.is_contiguous()
        or device_index != _current_device()
    ):
        return None
    dx = torch.empty_like(hidden_states)
    dweight = torch.empty_like(weight)
    stream = _current_stream(device_index)
    if exact:
        run(programs, 1, 1, stream, function, metadata, None, None, None, ya, ha, xa, wa,
            dx.data_ptr(), dweight.data_ptr(), eps, *tail)  # fmt: skip
    elif sums is None:
        run(programs, 1, 1, stream, function, metadata, None, None, None, ya, ha, xa, wa, ya,
            dx.data_ptr(), dweight.data_ptr(), rows, hidden, hidden, eps, *tail)  # fmt: skip
    else:
        # Several programs: one float32 partial row each, then their sum in program order.
        sum_run, sum_function, sum_metadata, sum_tail, columns, template = sums
        # Held until the launches are queued (a block freed earlier could go to another thread).
        partial = torch.empty_like(template)
        pa = partial.data_ptr()
        run(programs, 1, 1, stream, function, metadata, None, None, None, ya, ha, xa, wa, ya,
            dx.data_ptr(), pa, rows, hidden, hidden, eps, *tail)  # fmt: skip
        sum_run(columns, 1, 1, stream, sum_function, sum_metadata, None, None, None, pa,
                dweight.data_ptr(), programs, hidden, *sum_tail)  # fmt: skip
    return dx, dweight


# --- autograd -----------------------------------------------------------------------------------


def _rms_norm_backward(ctx, dy, dhidden_out=None):
    saved = ctx.saved_tensors
    hidden_states, weight = saved[0], saved[1]
    if dy is not None and len(saved) == 2:
        # A one-token call like one seen before: two allocations and the cached launch.
        done = _backward_cached(dy, dhidden_out, hidden_states, weight, ctx.eps)
        if done is not None:
            return done[0], done[1], done[0] if ctx.needs_input_grad[2] else None, None
    rstd = saved[2] if len(saved) == 3 else None
    if dy is None:
        if dhidden_out is None:
            return None, None, None, None
        dy = torch.zeros_like(hidden_states)
    if hidden_states.is_cuda and hidden_states.get_device() != _current_device():
        with on_device_of(hidden_states):
            dh, dweight = _backward(dy, dhidden_out, hidden_states, weight, rstd, ctx.eps)
    else:
        dh, dweight = _backward(dy, dhidden_out, hidden_states, weight, rstd, ctx.eps)
    # A residual of None never needs a gradient: the flag alone says whether to return it.
    return dh, dweight, dh if ctx.needs_input_grad[2] else None, None


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):  # type: ignore[override]
        y, hidden_states, rstd = _forward(x, weight, eps, residual, True)
        # rstd exists only for rows wider than MAX_BLOCK (narrower rows recompute it).
        if rstd is None:
            ctx.save_for_backward(hidden_states, weight)
        else:
            ctx.save_for_backward(hidden_states, weight, rstd)
        ctx.eps = eps
        # Without this, an unused output's gradient arrives as a materialised zero tensor.
        ctx.set_materialize_grads(False)
        return y if residual is None else (y, hidden_states)

    backward = staticmethod(_rms_norm_backward)  # type: ignore[assignment]


# The autograd engine runs a Python node through its backward class's ``apply``, which in
# torch looks the user's function up on every call (one more Python frame and a few attribute
# reads, about 5 us of a one-row backward's 85-100 us host time on the H200 machine, round-1
# probe of session 9): the node calls the backward directly instead.
if isinstance(getattr(_RMSNormFunction, "_backward_cls", None), type):
    _RMSNormFunction._backward_cls.apply = _rms_norm_backward  # type: ignore[attr-defined]


# ``Function.apply`` without the Python wrapper some torch releases put around the C++ entry
# point (it only matters under torch.func transforms, which take the wrapped path).
try:
    _APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _RMSNormFunction)
except (AttributeError, KeyError, TypeError):  # pragma: no cover - another torch layout
    _APPLY = _RMSNormFunction.apply
_functorch_active = torch._C._are_functorch_transforms_active


# --- torch.compile: the custom ops ---------------------------------------------------------------


def _triton_dispatch(tensor: torch.Tensor) -> bool:
    return tensor.dtype != torch.float64 and use_triton(tensor)


@_compile.custom_op(
    "rms_norm_fwd",
    "(Tensor x, Tensor weight, Tensor? residual, float eps) -> (Tensor, Tensor, Tensor)",
)
def _rms_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stored: torch.Tensor | None
    if _triton_dispatch(x):
        with on_device_of(x):
            y, hidden_states, stored = _forward(x, weight, eps, residual, True)
    else:
        y, hidden_states, rstd = rms_norm_parts(x, weight, eps, residual)
        stored = rstd.reshape(-1) if x.shape[-1] > MAX_BLOCK else None
    # Outputs of a custom op may not alias its inputs: without a residual the normalised input
    # is ``x`` itself, which the autograd setup saves directly, and an empty tensor stands in
    # (as for rstd, which only rows wider than MAX_BLOCK keep).
    hidden_out = hidden_states.contiguous() if residual is not None else x.new_empty(0)
    return y.contiguous(), hidden_out, stored if stored is not None else x.new_empty(0)


@_compile.custom_op(
    "rms_norm_bwd",
    "(Tensor dy, Tensor? dhidden, Tensor hidden, Tensor weight, Tensor rstd, float eps) "
    "-> (Tensor, Tensor)",
)
def _rms_norm_bwd_op(
    dy: torch.Tensor,
    dhidden: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_dispatch(hidden):
        with on_device_of(hidden):
            dx, dweight = _backward(
                dy, dhidden, hidden, weight, rstd if hidden.shape[-1] > MAX_BLOCK else None, eps
            )
        return dx.contiguous(), dweight
    # The torch dispatch differentiates the one reference instead of a second formula.
    with _compile.autograd_inside_op():
        leaves = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        y = rms_norm_reference(leaves[0], leaves[1], eps)
        dx, dweight = torch.autograd.grad(y, leaves, dy)
    if dhidden is not None:
        dx = dx + dhidden
    return dx.contiguous(), dweight


@_rms_norm_fwd_op.register_fake
def _rms_norm_fwd_fake(x, weight, residual, eps):
    rows = math.prod(x.shape[:-1]) if x.shape[-1] > MAX_BLOCK else 0
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    hidden = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), hidden, x.new_empty(rows, dtype=stats_dtype)


@_rms_norm_bwd_op.register_fake
def _rms_norm_bwd_fake(dy, dhidden, hidden, weight, rstd, eps):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps = inputs
    _, hidden, rstd = output
    ctx.has_residual = residual is not None
    ctx.eps = eps
    ctx.save_for_backward(hidden if residual is not None else x, weight, rstd)


def _op_backward(ctx, dy, dhidden, _drstd):
    hidden, weight, rstd = ctx.saved_tensors
    dhidden = dhidden if ctx.has_residual else None
    dx, dweight = _rms_norm_bwd_op(dy, dhidden, hidden, weight, rstd, ctx.eps)
    return dx, dweight, dx if ctx.has_residual else None, None


_rms_norm_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


# --- public API ---------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, differentiable in ``x``, ``weight`` and ``residual``.

    ``h = x + residual`` is computed and returned in the input dtype (as Hugging Face models
    do); the normalisation ``h * rsqrt(mean(h**2) + eps) * weight`` runs in float32 and is cast
    once to the dtype of ``x``. Runs the Triton kernel on CUDA tensors and the torch reference
    on CPU tensors (see ``MCORE_KERNELS_BACKEND``). Each row's result is bitwise independent of
    the number of rows. Under ``torch.compile`` the call is the opaque custom op
    ``torch.ops.mcore_kernels.rms_norm_fwd`` (with a registered backward), so it compiles with
    ``fullgraph=True``.

    Args:
        x: ``[..., hidden]`` input, float16, bfloat16 or float32 (float64 on the reference).
        weight: ``[hidden]`` scale.
        eps: added to the mean square before the reciprocal square root.
        residual: optional tensor shaped like ``x`` (same dtype) added to ``x`` first.

    Returns:
        ``y`` shaped like ``x``; with ``residual``, the pair ``(y, x + residual)``.

    Raises:
        KernelDtypeError: unsupported dtypes or a residual dtype different from ``x``.
        KernelShapeError: ``weight`` or ``residual`` do not match ``x``.
        KernelDeviceError: tensors on different devices.
        KernelValueError: ``eps`` negative or not finite.
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` asks for a backend that cannot run.
    """
    if _compile.compiling():
        check_rms_norm_args(x, weight, eps, residual)
        y, hidden, _ = _rms_norm_fwd_op(x, weight, residual, float(eps))
        return y if residual is None else (y, hidden)
    # The hot path is kept to the few attribute reads and calls a valid call needs, written
    # out here (no helper frames): on the GPU machines' hosts each costs 0.1-1 us against
    # about 15 us for a whole call. It checks the common valid call cheaply; anything else
    # goes through the full checks, which name the argument.
    try:
        device = x.get_device()
        on_cuda = x.is_cuda
        dtype = x.dtype
        shape = x.shape
        hidden = shape[-1]
        plain = (
            type(eps) is float
            and 0.0 <= eps < math.inf
            and dtype in _KERNEL_DTYPES
            and weight.dtype in _KERNEL_DTYPES
            and hidden != 0
            and weight.shape == (hidden,)
            # Device indices (-1 on the CPU) compare without building torch.device objects;
            # on the CPU, other devices (meta) also say -1.
            and weight.get_device() == device
            and (weight.is_cuda if on_cuda else (x.is_cpu and weight.is_cpu))
            and (
                residual is None
                or (
                    residual.dtype == dtype
                    and residual.shape == shape
                    and residual.get_device() == device
                    and (residual.is_cuda if on_cuda else residual.is_cpu)
                )
            )
        )
    except (AttributeError, IndexError):  # not tensors, or a 0-d x: the full checks name it
        plain = False
    if plain:
        triton = on_cuda and _triton_available() if not backend_forced() else use_triton(x)
    else:
        check_rms_norm_args(x, weight, eps, residual)
        eps = float(eps)
        triton = x.dtype != torch.float64 and use_triton(x)
        on_cuda, device = x.is_cuda, x.get_device()
    if not triton:
        return rms_norm_reference(x, weight, eps, residual=residual)
    if on_cuda and device != _current_device():
        # Triton launches on the current device: make it the tensors' one, then the same call.
        with torch.cuda.device(x.device):
            return rms_norm(x, weight, eps, residual=residual)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (residual is not None and residual.requires_grad)
    ):
        if _functorch_active():
            return _RMSNormFunction.apply(x, weight, residual, eps)
        return _APPLY(x, weight, residual, eps)
    y, hidden_states, _ = _forward(x, weight, eps, residual, False)
    return y if residual is None else (y, hidden_states)


class RMSNorm(nn.Module):
    """RMSNorm layer with an optional fused residual add.

    The parameter is named ``weight`` (initialised to ones) like Hugging Face's ``LlamaRMSNorm``,
    so its state dict loads from Hugging Face checkpoints unchanged.

    Args:
        hidden_size: size of the normalised last dimension.
        eps: added to the mean square before the reciprocal square root.
        dtype: dtype of ``weight`` (default: torch's default dtype).
        device: device of ``weight``.

    Raises:
        KernelValueError: ``hidden_size`` is not a positive int or ``eps`` is negative.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise KernelValueError(f"hidden_size={hidden_size!r} must be a positive int")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise KernelValueError(f"eps={eps!r} must be a number >= 0")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (after adding ``residual`` when given).

        Args:
            x: ``[..., hidden_size]`` input.
            residual: optional tensor shaped like ``x``.

        Returns:
            ``y``; with ``residual``, the pair ``(y, x + residual)``.
        """
        return rms_norm(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        """Return the printed summary of the layer.

        Returns:
            ``"hidden_size, eps=..."``.
        """
        return f"{self.hidden_size}, eps={self.eps}"
