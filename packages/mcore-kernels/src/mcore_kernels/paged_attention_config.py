"""Launch configuration of the paged attention split kernel.

A program of the split kernel computes one split of context positions for the query heads of
one key/value head, in tiles of ``tile`` positions with an online softmax. Its products are
either

- ``"dot"`` (the default): tensor-core products with float32 accumulation. The query-key
  product takes the 16-bit queries and keys themselves (their products are exact in float32);
  for the value product the probabilities are split into a 16-bit high part and a 16-bit
  remainder, two products, so the weighted sum keeps about 16 bits of each probability
  instead of the 8 of a single rounding (flash attention's). The query group is padded to 16
  rows, the smallest tensor-core tile: for multi-head attention 15 rows are padding, which
  costs little on tensor cores, and in launches of at least ``prefill_tokens`` tokens
  (chunked prefill) the padding rows hold the next tokens of the same sequence, which then
  share every key and value load. With float32 inputs the products run in IEEE float32.
- ``"sum"``: the group broadcast against the tile in float32 (``tl.sum``, no padding rows);
  also what tiles of fewer than 16 positions run.

On one H100 (``benchmarks/bench_paged_attention.py``) the tensor-core products were the fastest
at every measured group size (1 to 8) and head dimension (64, 72, 128), ahead of float32
broadcast products (with one to eight key/value heads per program) by 1.2-2.2x, and tiles of 64
positions the best or within a few percent of it. The configuration depends only on the shape
and the dtype, never on the batch or the context lengths, so a token's output does not depend
on the other tokens of the launch.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_kernels.errors import KernelShapeError

__all__ = [
    "PAGED_ATTENTION_MODES",
    "WIDE_LAUNCH_PROGRAMS_PER_SM",
    "PagedDecodeConfig",
    "paged_decode_config",
]

PAGED_ATTENTION_MODES = ("dot", "sum")
"""Product variants of the paged split kernel (see the module docstring)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PagedDecodeConfig:
    """How the paged split kernel computes its tiles.

    Raises:
        KernelShapeError: If a field is out of range.
    """

    mode: str = "dot"
    """One of :data:`PAGED_ATTENTION_MODES`."""
    tile: int = 64
    """Context positions per loop iteration (a power of two; capped by the split size)."""
    num_warps: int = 4
    """Warps per program (a power of two)."""
    num_stages: int = 2
    """Software-pipelining stages of the tile loop."""
    max_registers: int = 0
    """Registers per thread the compiler may use (``maxnreg``; 0: its own choice). A cap lets
    more programs share a multiprocessor."""
    prefill_tokens: int = 1024
    """Launches of at least this many tokens put consecutive tokens of one sequence into one
    program (mode ``"dot"``); results are the same either way, only the loads differ."""

    def __post_init__(self) -> None:
        if self.mode not in PAGED_ATTENTION_MODES:
            raise KernelShapeError(f"mode={self.mode!r}; expected one of {PAGED_ATTENTION_MODES}")
        for name in ("tile", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelShapeError(f"{name}={value}; expected a power of two")
        if self.num_stages < 1:
            raise KernelShapeError(f"num_stages={self.num_stages}; expected at least 1")
        if self.max_registers < 0 or self.max_registers > 255:
            raise KernelShapeError(
                f"max_registers={self.max_registers}; expected 0 (no cap) to 255"
            )
        if self.prefill_tokens < 1:
            raise KernelShapeError(f"prefill_tokens={self.prefill_tokens}; expected at least 1")


WIDE_LAUNCH_PROGRAMS_PER_SM = 4
"""Decode launches with at least this many programs per multiprocessor run 2 warps per program
with at most 128 registers per thread (more programs resident per multiprocessor; the same
bits as 4 warps). One H200, Qwen2.5-0.5B heads, split 256: 8 x 32768 49.3 against 57.0 us, 4 x
32768 27.5 against 33.1 us, 512 x 160 16.9 against 21.1 us; slower from 2 programs per
multiprocessor down (16 x 2048 15.9 against 15.8 us, 1 x 32768 18.7 against 17.1 us)."""


def paged_decode_config(
    group: int,
    head_dim: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    programs_per_sm: float = 0.0,
) -> PagedDecodeConfig:
    """Default launch configuration of the paged split kernel for one attention shape.

    Args:
        group: Query heads per key/value head.
        head_dim: Channels per head.
        num_kv_heads: Key/value heads of the cache.
        dtype: Dtype of the queries and the cache.
        programs_per_sm: Programs of the decode launch per multiprocessor (0: unknown or not
            a decode launch).

    Returns:
        The configuration: tensor-core products in tiles of 64 positions for every shape
        measured so far (see the module docstring); 2 warps and at most 128 registers per
        thread in decode launches of at least :data:`WIDE_LAUNCH_PROGRAMS_PER_SM` programs per
        multiprocessor, else 4 warps.
    """
    del group, head_dim, num_kv_heads, dtype
    if programs_per_sm >= WIDE_LAUNCH_PROGRAMS_PER_SM:
        return PagedDecodeConfig(num_warps=2, max_registers=128)
    return PagedDecodeConfig()
