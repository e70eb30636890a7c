"""Launch configuration of the paged decode-attention kernel, chosen per attention shape.

The split kernel of :mod:`mcore_kernels.paged_attention` has several ways to form the scores
and the weighted values of a tile of context positions; which one is fastest depends on the
number of query heads per key/value head (the group) and on the head dimension:

- ``"heads"`` (multi-head attention, group 1): no matrix product at all. A program handles
  ``heads`` key/value heads of one token (adjacent in the cache, so one load reads a longer
  contiguous run), multiplies each key by its single query in float32 and sums over the head
  dimension; there is no padding row.
- ``"sum"``: one key/value head per program, the group's queries broadcast against the tile
  in float32 (``tl.sum`` instead of ``tl.dot``): no 16-row padding, cost grows with the group.
- ``"dot"``: one key/value head per program, tensor-core products with float32 accumulation.
  The query-key product takes the cache's own 16-bit keys and queries (their products are exact
  in float32); the probabilities are split into a 16-bit high part and a 16-bit remainder, two
  products with the values, so the weighted sum keeps about 16 bits of each probability
  instead of 8 (near float32, unlike flash attention's single rounding). The group is padded to
  16 rows (the smallest tensor-core tile), which costs little on tensor cores.

The choice depends only on the attention shape and the dtype, never on the batch or the context
lengths, so a token's output does not depend on the other tokens of the launch.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_kernels.errors import KernelShapeError

__all__ = ["PAGED_DECODE_MODES", "PagedDecodeConfig", "paged_decode_config"]

PAGED_DECODE_MODES = ("heads", "sum", "dot", "dot1")
"""Score/value product variants of the paged split kernel (see the module docstring)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PagedDecodeConfig:
    """How the paged split kernel computes one tile of context positions.

    Raises:
        KernelShapeError: If a field is out of range.
    """

    mode: str
    """One of :data:`PAGED_DECODE_MODES`."""
    heads: int = 1
    """Key/value heads per program (a power of two; more than 1 only with mode ``"heads"``)."""
    tile: int = 32
    """Context positions per loop iteration (a power of two dividing the split size)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 2
    """Software-pipelining stages of the tile loop."""

    def __post_init__(self) -> None:
        if self.mode not in PAGED_DECODE_MODES:
            raise KernelShapeError(f"mode={self.mode!r}; expected one of {PAGED_DECODE_MODES}")
        for name in ("heads", "tile", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise KernelShapeError(f"{name}={value}; expected a power of two")
        if self.heads > 1 and self.mode != "heads":
            raise KernelShapeError(f"heads={self.heads} needs mode='heads', got {self.mode!r}")
        if self.mode in ("dot", "dot1") and self.tile < 16:
            raise KernelShapeError(f"tile={self.tile}; mode {self.mode!r} needs at least 16")
        if self.num_stages < 1:
            raise KernelShapeError(f"num_stages={self.num_stages}; expected at least 1")


def paged_decode_config(
    group: int, head_dim: int, num_kv_heads: int, dtype: torch.dtype
) -> PagedDecodeConfig:
    """Default launch configuration of the paged split kernel for one attention shape.

    Args:
        group: Query heads per key/value head.
        head_dim: Channels per head.
        num_kv_heads: Key/value heads of the cache.
        dtype: Dtype of the queries and the cache.

    Returns:
        The configuration.
    """
    del head_dim
    if group == 1:
        heads = 1
        while heads < 4 and num_kv_heads % (2 * heads) == 0:
            heads *= 2
        return PagedDecodeConfig(mode="heads", heads=heads, tile=16)
    if dtype == torch.float32 or group <= 2:
        return PagedDecodeConfig(mode="sum", tile=16)
    return PagedDecodeConfig(mode="dot", tile=32)
