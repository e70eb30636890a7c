"""Test helpers for resharding: a tiny tensor-parallel MLP and the gathering of sharded blocks.

The optimizer tests of mcore-parallel and the checkpoint tests of mcore-ckpt train the same
model under one layout and load its state under another; both compare states as full global
tensors, gathered here from every rank's blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.sharding import ShardedTensor
from mcore_parallel.state import ParallelState
from mcore_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["TinyTPMLP", "gather_global_tensors"]


class TinyTPMLP(nn.Module):
    """Column-parallel ``12 -> 32``, tanh, row-parallel ``32 -> 10``, LayerNorm (replicated).

    Args:
        state: Parallel state whose tp group splits the linear layers; None for a plain MLP.
        seeds: Seeds of the two linear layers' weights.
    """

    TP_DIMS: ClassVar[dict[str, int | None]] = {
        "fc1.weight": 0,
        "fc1.bias": 0,
        "fc2.weight": 1,
        "fc2.bias": None,
        "norm.weight": None,
        "norm.bias": None,
    }
    """Tensor-parallel split dimension of each parameter (None: replicated over tp)."""

    GLOBAL_SHAPES: ClassVar[dict[str, tuple[int, ...]]] = {
        "fc1.weight": (32, 12),
        "fc1.bias": (32,),
        "fc2.weight": (10, 32),
        "fc2.bias": (10,),
        "norm.weight": (10,),
        "norm.bias": (10,),
    }
    """Shape of each parameter before the tensor-parallel split."""

    def __init__(self, state: ParallelState | None, seeds: tuple[int, int]) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(12, 32, state=state, gather_output=False, seed=seeds[0])
        self.fc2 = RowParallelLinear(32, 10, state=state, input_is_parallel=True, seed=seeds[1])
        self.norm = nn.LayerNorm(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the MLP.

        Args:
            x: Input ``[..., 12]``, the same on every tp rank.

        Returns:
            ``[..., 10]``.
        """
        return self.norm(self.fc2(torch.tanh(self.fc1(x))))  # type: ignore[no-any-return]


def gather_global_tensors(blocks: Mapping[str, ShardedTensor]) -> dict[str, torch.Tensor]:
    """All-gathers every rank's blocks of replica 0 into full global tensors, on the CPU.

    Every rank of the default process group must call it; each gets the same result. This is
    what a checkpoint holds, assembled without one.

    Args:
        blocks: This rank's blocks by name (a sharded state dict's leaves).

    Returns:
        The global tensors by name; an element that no rank's replica-0 block covers is NaN.
    """
    mine = [
        (key, leaf.global_shape, leaf.global_offset, leaf.local.detach().cpu().clone())
        for key, leaf in blocks.items()
        if leaf.replica_id == 0
    ]
    gathered: list[list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]] | None]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    full: dict[str, torch.Tensor] = {}
    for rank_blocks in gathered:
        for key, shape, offset, local in rank_blocks or []:
            tensor = full.setdefault(key, torch.full(shape, float("nan")))
            tensor[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))] = local
    return full
