"""Launch configurations of :func:`mcore_kernels.decode_gemv.decode_gemv`: the tile sizes, the
split of the reduction and the choice per shape (:func:`gemv_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_kernels._triton_utils import next_power_of_2
from mcore_kernels.errors import KernelValueError

__all__ = [
    "EARLY_TAIL",
    "WHOLE_ROW_MAX_K",
    "WHOLE_ROW_WARPS",
    "GemvConfig",
    "block_rows",
    "gemv_config",
]

_REDUCES = ("ticket", "second_pass")
WHOLE_ROW_MAX_K = 8192
"""At 1-2 rows, projections of one weight row per program and at most this many inputs load
the whole row as one tile (see :func:`gemv_config`; 0: never): under PDL a program has its
whole weight in flight before it waits."""
WHOLE_ROW_WARPS = 8
"""Warps per program of those whole-row tiles wider than 4096 (4 up to 4096)."""
EARLY_TAIL = True
"""Programs whose reduction is one full ``block_k`` tile and a shorter tail (no split-K)
request both tiles at once, before the PDL wait (False: the tail after the first products)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class GemvConfig:
    """Launch configuration of :func:`decode_gemv_triton`."""

    block_n: int = 16
    """Output columns (weight rows) per program; a power of two >= 16 with ``use_dot``."""
    block_k: int = 512
    """Reduction elements per loop iteration; a power of two >= 16."""
    split_k: int = 1
    """Programs sharing one output tile's reduction (float32 partials, summed in order)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int | None = None
    """Software-pipelining stages of the reduction loop (None: Triton's default)."""
    use_dot: bool = False
    """Tensor-core ``tl.dot`` over rows padded to 16 instead of one vector pass per row."""
    reduce: str = "ticket"
    """Split-K sum: ``"ticket"`` (last program of a tile, one launch) or ``"second_pass"``."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"GemvConfig.{name}={value}; expected a power of two")
        if self.block_k < 16:
            raise KernelValueError(f"GemvConfig.block_k={self.block_k}; expected >= 16")
        if self.use_dot and self.block_n < 16:
            raise KernelValueError(
                f"GemvConfig.block_n={self.block_n} with use_dot; expected >= 16"
            )
        if self.num_stages is not None and self.num_stages < 1:
            raise KernelValueError(f"GemvConfig.num_stages={self.num_stages}; expected >= 1")
        if self.split_k < 1:
            raise KernelValueError(f"GemvConfig.split_k={self.split_k}; expected >= 1")
        if self.reduce not in _REDUCES:
            raise KernelValueError(f"GemvConfig.reduce={self.reduce!r}; expected one of {_REDUCES}")


def gemv_config(rows: int, out_features: int, in_features: int, multiprocessors: int) -> GemvConfig:
    """The launch configuration :func:`decode_gemv` uses for a shape.

    Chosen from a sweep on one H100 (``bench_decode_gemv.py --sweep``, the Qwen2.5-0.5B and
    Llama-3.2-1B projections at 1..64 rows, then ``--refine`` at 1 and 2 rows): up to 2 rows,
    vector passes without split-K over ``[4, 1024]`` weight tiles (``[2, 2048]`` for
    reductions of 2048 and more) were the fastest or within a few percent of it for every
    shape; on one H200 one weight row per program for narrow outputs over long reductions
    (fewer than ``8 x multiprocessors`` outputs, at least 2048 inputs); from 3 rows on,
    ``tl.dot`` tiles, narrow ones (16 columns) for narrow projections with a 4-way split-K
    over long reductions, wide ones (32 or 64 columns) for wide ones.

    Args:
        rows: ``M``, the rows of ``x``.
        out_features: ``N_out``, the output columns (``F`` for SwiGLU).
        in_features: ``K``.
        multiprocessors: The device's multiprocessor count (it caps the split).

    Returns:
        A :class:`GemvConfig`.
    """
    if rows <= 2:
        if in_features >= 2048:
            # Narrow outputs over long reductions (Qwen2.5-0.5B's down projection, 896 x
            # 4864): one weight row per program keeps about seven programs per multiprocessor
            # (H200: 6.1 against 7.3 us with two rows per program).
            block_n = 2 if out_features // 2 >= 4 * multiprocessors else 1
            if block_n == 1 and in_features <= WHOLE_ROW_MAX_K:
                # The whole weight row in flight before the PDL wait: one tile of the largest
                # power of two in the row plus the tail (both requested before the wait, see
                # EARLY_TAIL), 4 warps up to 4096 (H200, the captured batch-1 step of the
                # Qwen2.5-0.5B shape, down 896 x 4864: 534.1 against 547.3-552.8 us with one
                # 8192-wide tile over 8 warps).
                block_k = next_power_of_2(in_features)
                if block_k != in_features:
                    block_k //= 2
                warps = 4 if block_k <= 4096 else WHOLE_ROW_WARPS
                return GemvConfig(block_n=1, block_k=block_k, num_warps=warps)
            return GemvConfig(block_n=block_n, block_k=2048, num_warps=4)
        return GemvConfig(block_n=4, block_k=1024, num_warps=4)
    if out_features <= 4096:
        tiles = -(-out_features // 16) * -(-rows // block_rows(rows, True))
        split_k = 4 if in_features >= 4096 and tiles <= multiprocessors else 1
        return GemvConfig(block_n=16, block_k=256, split_k=split_k, num_warps=4, use_dot=True)
    block_n = 32 if out_features < 12288 else 64
    return GemvConfig(block_n=block_n, block_k=128, num_warps=4, use_dot=True)


def block_rows(rows: int, use_dot: bool) -> int:
    """Rows of ``x`` per program: up to 4 for the vector path, 16..64 for ``tl.dot`` tiles."""
    if use_dot:
        return min(64, max(16, next_power_of_2(rows)))
    return min(4, next_power_of_2(rows))
