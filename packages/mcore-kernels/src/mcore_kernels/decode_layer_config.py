"""Configuration and inputs of :mod:`mcore_kernels.decode_layer` and
:mod:`mcore_kernels.decode_model`: the launch configuration, the folded-in attention and next
q/k/v projection, and the constants of the attention split and the L2 prefetch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_kernels.errors import KernelValueError
from mcore_kernels.rotary_kv_write import RotaryCacheWrite

__all__ = [
    "ATTENTION_SPLIT",
    "MAX_ROWS",
    "MERGE_CHUNK",
    "PREFETCH_CHUNK_BYTES",
    "LayerAttention",
    "LayerTailConfig",
    "NextProjection",
]

MAX_ROWS = 4
"""Most rows (tokens) :func:`decode_layer_tail` and :func:`decode_layer` take."""
ATTENTION_SPLIT = 64
"""Context positions per work item of :func:`decode_layer`'s attention."""
PREFETCH_CHUNK_BYTES = 16384
"""Bytes per bulk L2 request of :class:`LayerTailConfig`'s ``prefetch_l2``."""
MERGE_CHUNK = 2
"""Splits merged per step of the running maximum (4 needs more registers than two programs
per multiprocessor allow at 8 warps)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerAttention:
    """The layer's paged decode attention that :func:`decode_layer` folds in."""

    k_cache: torch.Tensor
    """The layer's key cache ``[num_blocks, block_size, Hkv, D]`` (``D`` a power of two >= 16)."""
    v_cache: torch.Tensor
    """The layer's value cache, shaped like ``k_cache``."""
    block_tables: torch.Tensor
    """int32 ``[M, max_blocks]`` physical block of each logical block of each token."""
    context_lens: torch.Tensor
    """int32 ``[M]`` positions each token attends (its own included; at least 1)."""
    scale: float
    """Multiplier of the query-key products."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NextProjection:
    """The next layer's q/k/v projection that :func:`decode_layer_tail` folds in."""

    weight: torch.Tensor
    """``[(Hq + 2 Hkv) * D, hidden]`` q, k then v projection weights (contiguous)."""
    bias: torch.Tensor | None
    """``[(Hq + 2 Hkv) * D]`` biases, or None."""
    norm_weight: torch.Tensor
    """``[hidden]`` weight of the next layer's input RMSNorm."""
    norm_eps: float
    """Its epsilon."""
    rope: RotaryCacheWrite
    """RoPE tables, the next layer's key/value cache and the tokens' slots."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerTailConfig:
    """Launch configuration of :func:`decode_layer_tail`."""

    programs_per_sm: int = 2
    """Resident programs per multiprocessor (capped by what the compiled kernel fits)."""
    num_warps: int = 8
    """Warps per program."""
    block_n_o: int = 4
    """Output columns per tile of the o projection."""
    block_n_gate_up: int = 8
    """Output columns (gate/up row pairs) per tile of the gate/up projection."""
    block_n_down: int = 2
    """Output columns per tile of the down projection."""
    block_n_qkv: int = 4
    """Channel pairs per tile of the q/k/v projection."""
    barrier_sleep_ns: int = 0
    """Nanoseconds a program sleeps between polls of a grid barrier (0: none)."""
    prefetch_l2: bool = True
    """Request the layer's weights into L2 at the start (bulk requests, Hopper and newer;
    ignored elsewhere and where a weight is not 16-byte aligned or smaller than a chunk)."""

    def __post_init__(self) -> None:
        if self.barrier_sleep_ns < 0:
            raise KernelValueError(
                f"LayerTailConfig.barrier_sleep_ns={self.barrier_sleep_ns}; expected >= 0"
            )
        if self.programs_per_sm < 1:
            raise KernelValueError(
                f"LayerTailConfig.programs_per_sm={self.programs_per_sm}; expected >= 1"
            )
        for name in ("num_warps", "block_n_o", "block_n_gate_up", "block_n_down", "block_n_qkv"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelValueError(f"LayerTailConfig.{name}={value}; expected a power of two")
