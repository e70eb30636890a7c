"""Description of a rank's block of a global tensor, shared by parallel layers and checkpoints.

Tensor-parallel layers and the distributed optimizer hold shards of tensors whose full
("global") value no single rank has. :class:`ShardedTensor` records which block a rank holds so
that mcore-ckpt can save it and load it back under another parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_parallel.errors import ParallelConfigError, ParallelTypeError

__all__ = ["ShardedTensor", "set_partition_dim", "get_partition_dims", "PARTITION_AXES"]

PARTITION_AXES = ("tp", "ep", "etp")
"""Parallel dimensions along which a parameter can be partitioned."""


@dataclass(frozen=True, slots=True)
class ShardedTensor:
    """A rectangular block of a global tensor held by this rank.

    Attributes:
        local: The block held by this rank; ``local.shape[d] + global_offset[d] <=
            global_shape[d]`` for every dimension ``d``.
        global_shape: Shape of the full tensor across all ranks.
        global_offset: Index of ``local[0, 0, ...]`` inside the full tensor.
        replica_id: 0 for the rank that owns this block when saving; other ranks holding an
            identical copy (data-parallel replicas) use a positive id and are not written.

    Raises:
        ParallelTypeError: If ``local`` is not a tensor or ``replica_id`` not an integer.
        ParallelConfigError: If the ranks of the shapes disagree, the block does not fit or
            ``replica_id`` is negative.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise ParallelTypeError(
                f"local must be a torch.Tensor, got {type(self.local).__name__}"
            )
        shape, offset = tuple(self.global_shape), tuple(self.global_offset)
        if not (len(shape) == len(offset) == self.local.dim()):
            raise ParallelConfigError(
                f"global_shape={shape}, global_offset={offset} and local.shape="
                f"{tuple(self.local.shape)} must have the same number of dimensions"
            )
        for dim, (size, off, n) in enumerate(zip(shape, offset, self.local.shape)):
            if off < 0 or off + n > size:
                raise ParallelConfigError(
                    f"global_offset={offset} with local.shape={tuple(self.local.shape)} does not "
                    f"fit in global_shape={shape}: dimension {dim} spans [{off}, {off + n})"
                )
        if isinstance(self.replica_id, bool) or not isinstance(self.replica_id, int):
            raise ParallelTypeError(
                f"replica_id={self.replica_id!r} must be an int, got "
                f"{type(self.replica_id).__name__}"
            )
        if self.replica_id < 0:
            raise ParallelConfigError(f"replica_id={self.replica_id} must be >= 0")
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "global_offset", offset)

    @property
    def is_full(self) -> bool:
        """Whether this block covers the whole global tensor."""
        return tuple(self.local.shape) == self.global_shape


def set_partition_dim(tensor: torch.Tensor, dim: int, *, axis: str = "tp") -> None:
    """Records that ``tensor`` holds this rank's chunk of a global tensor along ``dim``.

    The global tensor is split into equal chunks along ``dim`` over the ranks of ``axis``
    (``"tp"``: tensor parallel, ``"ep"``: expert parallel, ``"etp"``: expert tensor parallel), chunk ``i`` on the rank of index
    ``i``. :func:`mcore_parallel.checkpointing.sharded_state_dict` reads this back.

    Args:
        tensor: A parameter or buffer (the attribute lives on the tensor object).
        dim: The partitioned dimension of ``tensor``.
        axis: The parallel dimension it is partitioned over; one of ``PARTITION_AXES``.

    Raises:
        ParallelConfigError: If ``axis`` is unknown, ``dim`` is out of range, or ``tensor`` is
            already partitioned along ``dim`` over another axis.
    """
    if axis not in PARTITION_AXES:
        raise ParallelConfigError(f"axis={axis!r} must be one of {PARTITION_AXES}")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ParallelConfigError(
            f"dim={dim} is out of range for a tensor of shape {tuple(tensor.shape)}"
        )
    dims = dict(get_partition_dims(tensor))
    dim %= tensor.dim()
    if dim in dims.values() and dims.get(axis) != dim:
        raise ParallelConfigError(f"dimension {dim} is already partitioned: {dims}")
    dims[axis] = dim
    tensor.mcore_partition_dims = dims  # type: ignore[attr-defined]


def get_partition_dims(tensor: torch.Tensor) -> dict[str, int]:
    """Returns the partitioned dimensions recorded by :func:`set_partition_dim`.

    Args:
        tensor: A parameter or buffer.

    Returns:
        A mapping from parallel axis (``"tp"``, ``"ep"``) to dimension; empty if replicated.
    """
    return dict(getattr(tensor, "mcore_partition_dims", {}))
