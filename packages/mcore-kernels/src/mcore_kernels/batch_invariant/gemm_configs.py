"""Which :class:`~mcore_kernels.batch_invariant.gemm.GemmConfig` a product runs with.

The choice is a function of ``(N, K, dtype)`` and of the GPU generation, never of the number
of rows ``M``: that is what makes the GEMM batch-invariant. Inside those limits it is tuned for
both ends of ``M`` at once (decode, a few rows; training and prefill, thousands).
"""

from __future__ import annotations

import functools

import torch

from mcore_kernels.batch_invariant.gemm import GemmConfig

__all__ = ["gemm_config"]

_FLOAT32 = GemmConfig(block_m=32, block_n=64, block_k=32, warps=4, stages=2)
_DEFAULT = GemmConfig(block_m=64, block_n=128, block_k=64, warps=4, stages=3)


@functools.lru_cache(maxsize=256)
def _hopper_config(width: int, depth: int) -> GemmConfig:
    return _DEFAULT


def gemm_config(width: int, depth: int, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """The launch configuration of an invariant product with ``N = width`` and ``K = depth``.

    Args:
        width: Output columns ``N``.
        depth: Reduction size ``K``.
        dtype: Operand dtype.
        device: Device of the operands (the GPU generation picks the table).

    Returns:
        The configuration; it never depends on the number of rows.
    """
    if dtype == torch.float32:
        return _FLOAT32
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return _hopper_config(width, depth)
    return _DEFAULT
