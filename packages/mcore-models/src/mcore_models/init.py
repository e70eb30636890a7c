"""Layout-independent initialisation: every rank fills only its block of each global tensor.

A parameter's initial value is a function of ``(seed, canonical name, global index)`` alone,
never of the parallel layout, so a model built on the meta device, sharded over any TP / EP /
ETP / PP layout and then materialised holds exactly the slices of the model an unsharded run
builds from the same seed.

How: the global tensor is viewed as ``rows x columns`` (all leading dimensions flattened,
the last one the columns) and cut into fixed blocks of :data:`ROWS_PER_BLOCK` rows. Block
``b`` is drawn from a generator seeded with a hash of ``(seed, name, b)``. A rank generates
only the blocks its rows fall in (one block at a time, so the transient memory is
``ROWS_PER_BLOCK x columns``) and keeps its rows and columns of them. Normal draws are
generated on the parameter's device (values differ between CPU and CUDA generators; they are
equal across layouts on the same device type).

Rules by name (Megatron-Core's and Hugging Face's conventions for these models): ``*norm.weight``
and other 1-D ``weight`` parameters of norm modules are ones, biases are zeros, everything else
is ``normal(0, init_std)``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ROWS_PER_BLOCK", "GlobalSlice", "fill_normal_block", "global_slice", "block_seed"]

ROWS_PER_BLOCK = 64
"""Rows of the flattened global tensor drawn from one generator seed."""


@dataclass(frozen=True, slots=True)
class GlobalSlice:
    """Where a local tensor sits in its global tensor.

    Attributes:
        name: Canonical name of the global tensor (its name in the unsharded, unpipelined
            model, e.g. ``"layers.7.mlp.up_proj.weight"``).
        global_shape: Shape of the global tensor.
        global_offset: Index of the local tensor's first element in the global tensor.
    """

    name: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def box(self, local_shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The local tensor's region of the global tensor.

        Args:
            local_shape: Shape of the local tensor.

        Returns:
            One slice per dimension.
        """
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, local_shape, strict=True))


def global_slice(param: torch.Tensor) -> GlobalSlice | None:
    """The :class:`GlobalSlice` recorded on a parameter by ``parallelize``, or None.

    Args:
        param: A parameter or buffer.

    Returns:
        The recorded slice, or None for tensors that were never placed.
    """
    return getattr(param, "mcore_global_slice", None)


def set_global_slice(param: torch.Tensor, where: GlobalSlice) -> None:
    """Record where ``param`` sits in its global tensor (read by init, loaders and exporters).

    Args:
        param: A parameter or buffer.
        where: Its place.
    """
    param.mcore_global_slice = where  # type: ignore[attr-defined]


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one block of rows of a global tensor.

    Args:
        seed: Model seed.
        name: Canonical tensor name.
        block: Block index (``row // ROWS_PER_BLOCK``).

    Returns:
        A 63-bit seed.
    """
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _local_rows(where: GlobalSlice, local_shape: tuple[int, ...]) -> torch.Tensor:
    """Flattened global row indices of the local tensor's rows, in local row-major order."""
    lead_global = where.global_shape[:-1]
    if not lead_global:
        return torch.zeros(1, dtype=torch.int64)
    index = torch.zeros(1, dtype=torch.int64)
    for size, offset, count in zip(
        lead_global, where.global_offset[:-1], local_shape[:-1], strict=True
    ):
        index = index[:, None] * size + torch.arange(offset, offset + count)[None, :]
        index = index.reshape(-1)
    return index


@torch.no_grad()
def fill_normal_block(local: torch.Tensor, where: GlobalSlice, *, seed: int, std: float) -> None:
    """Fill ``local`` with its block of the global ``normal(0, std)`` tensor of ``where``.

    Args:
        local: The local tensor (any device; materialised, not meta).
        where: Its place in the global tensor.
        seed: Model seed.
        std: Standard deviation.
    """
    local_shape = tuple(local.shape)
    columns = where.global_shape[-1] if where.global_shape else 1
    col0 = where.global_offset[-1] if where.global_shape else 0
    ncols = local_shape[-1] if local_shape else 1
    rows = _local_rows(where, local_shape)  # ascending: row-major order of the leading dims
    flat = local.view(-1, ncols) if local_shape else local.view(1, 1)
    generator = torch.Generator(device=local.device)
    total_rows = math.prod(where.global_shape[:-1]) if where.global_shape else 1
    blocks = torch.unique_consecutive(rows // ROWS_PER_BLOCK)
    bounds = torch.searchsorted(rows, torch.cat([blocks, blocks[-1:] + 1]) * ROWS_PER_BLOCK)
    for index, block in enumerate(blocks.tolist()):
        lo, hi = int(bounds[index]), int(bounds[index + 1])
        first = block * ROWS_PER_BLOCK
        count = min(ROWS_PER_BLOCK, total_rows - first)
        generator.manual_seed(block_seed(seed, where.name, block))
        values = torch.empty(count, columns, dtype=torch.float32, device=local.device)
        values.normal_(0.0, std, generator=generator)
        picked = values[(rows[lo:hi] - first).to(local.device), col0 : col0 + ncols]
        flat[lo:hi] = picked.to(local.dtype)


def iter_placed(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, GlobalSlice]]:
    """Parameters of ``module`` with their recorded places (see :func:`set_global_slice`).

    Args:
        module: A model or pipeline stage.

    Yields:
        ``(local name, tensor, place)`` for every parameter that has a place.
    """
    for name, param in module.named_parameters():
        where = global_slice(param)
        if where is not None:
            yield name, param, where
