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

# Hopper (H100), bf16/fp16. From a sweep of tile shapes, warps, stages, split-K and TMA at
# M = 1, 256 and 4096 for the Llama-3.2-1B projections (packages/mcore-inference/benchmarks/
# results/nvidia-h100/batch_invariant.md): each shape takes the configuration with the lowest
# sum of slowdowns against cuBLAS over the three M, since one configuration has to serve decode
# and training alike. Shapes not swept take the rule of _hopper_rule.
_HOPPER_VOCAB = GemmConfig(block_m=128, block_n=256, block_k=64, warps=8, stages=3, tma=True)
_HOPPER_NARROW = GemmConfig(block_m=64, block_n=64, block_k=128, warps=4, stages=4, tma=True)
_HOPPER_SQUARE = GemmConfig(block_m=64, block_n=128, block_k=64, warps=4, stages=4, tma=True)
_HOPPER_WIDE = GemmConfig(block_m=64, block_n=128, block_k=64, warps=4, stages=3)
_HOPPER_DEEP = GemmConfig(
    block_m=128, block_n=128, block_k=64, warps=4, stages=4, splits=2, tma=True
)


def _hopper_rule(width: int, depth: int) -> GemmConfig:
    """Configuration on Hopper from the output width ``N`` and the depth ``K``."""
    if width >= 32768:
        return _HOPPER_VOCAB
    if depth >= 4096 and depth >= 2 * width:
        return _HOPPER_DEEP
    if width <= 1024:
        return _HOPPER_NARROW
    if width <= 4096:
        return _HOPPER_SQUARE
    return _HOPPER_WIDE


@functools.lru_cache(maxsize=256)
def _hopper_config(width: int, depth: int) -> GemmConfig:
    return _hopper_rule(width, depth)


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
    if device.type == "cuda" and _capability(device.index) >= 9:
        return _hopper_config(width, depth)
    return _DEFAULT


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]
