"""Launch configurations of the add + RMSNorm kernels, chosen per hidden size and device.

:data:`LAUNCH_CONFIGS` maps the row block width (the hidden size rounded up to a power of two, at
most :data:`MAX_BLOCK`) to the rows per forward program and its warps, and to the rows per
backward iteration, its warps, programs per multiprocessor and software-pipelining depth. The
numbers come from the sweep of ``benchmarks/tune_launch_configs.py`` (per width, the least
geometric mean of GPU time over the fastest time across the row counts) and are looked up once
per (hidden size, device) and cached with the constexprs they imply. The number of rows enters
three things only: a row block never holds more rows than the call (a one-row tile repeats the
layout of a row of a larger tile), the backward's grid (one program per row block up to the cap)
and its pipelining (only when a program walks several row blocks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mcore_kernels._triton_utils import device_limits, next_power_of_2
from mcore_kernels.errors import KernelValueError

__all__ = ["LAUNCH_CONFIGS", "MAX_BLOCK", "RMSNormLaunch"]

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

    def __post_init__(self) -> None:
        for name in ("fwd_rows", "fwd_warps", "bwd_rows", "bwd_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"{name}={value} must be a positive power of two")
        for name in ("bwd_programs_per_sm", "bwd_stages"):
            if getattr(self, name) < 1:
                raise KernelValueError(f"{name}={getattr(self, name)} must be >= 1")


LAUNCH_CONFIGS: dict[int, RMSNormLaunch] = {
    256: RMSNormLaunch(
        fwd_rows=4, fwd_warps=4, bwd_rows=8, bwd_warps=4, bwd_programs_per_sm=4, bwd_stages=2
    ),
    1024: RMSNormLaunch(
        fwd_rows=2, fwd_warps=4, bwd_rows=4, bwd_warps=4, bwd_programs_per_sm=4, bwd_stages=2
    ),
    2048: RMSNormLaunch(
        fwd_rows=1, fwd_warps=8, bwd_rows=4, bwd_warps=8, bwd_programs_per_sm=1, bwd_stages=3
    ),
    # 16 forward warps (8 before session 11): the specialised kernel, one H200, GPU time in one
    # interleaved loop, 256 / 4096 / 16384 rows: 3.32 / 34.7 / 131.2 us against 3.38 / 35.3 /
    # 131.5 with 8 warps and 3.36 / 35.1 / 131.7 with 4.
    4096: RMSNormLaunch(
        fwd_rows=1, fwd_warps=16, bwd_rows=2, bwd_warps=8, bwd_programs_per_sm=1, bwd_stages=3
    ),
    8192: RMSNormLaunch(
        fwd_rows=1, fwd_warps=16, bwd_rows=1, bwd_warps=8, bwd_programs_per_sm=1, bwd_stages=3
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
) -> dict[str, Any]:
    key = (plan.block, plan.single, has_residual, store_rstd, block_rows, flags, exact, pdl)
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
