"""Global gradient norm reduced over exactly the groups that shard the gradients.

Every gradient element is counted on one rank only (replica 0 of its block: one data-parallel
shard owner, one tensor-parallel rank for a parameter replicated over tp). The squared sums are
then reduced over the groups that split the model, and nothing else: dense gradients over the
data x context group and the tensor-parallel group, expert gradients over the expert-data,
expert- and expert-tensor-parallel groups, and both over the pipeline group. For a
:class:`~mcore_parallel.state.ParallelState` these groups tile its ranks; a model trained on a
subset of the world (DDP over a ``ProcessGroup``) reduces over that subset only, so other ranks
are neither waited for nor counted.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mcore_parallel.distributed.buffers import CommGroup
from mcore_parallel.distributed.groups import DataParallelGroups

__all__ = ["global_grad_norm", "clip_coefficient"]


def _squared_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    if grads:
        # One fused kernel per dtype group instead of a reduction per tensor.
        total += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    return total


def _reduce(total: torch.Tensor, comms: list[CommGroup | None]) -> None:
    for comm in comms:
        if comm is not None and comm.size > 1:
            dist.all_reduce(total, group=comm.group)


def global_grad_norm(
    dense: list[torch.Tensor],
    expert: list[torch.Tensor],
    groups: DataParallelGroups,
    device: torch.device,
) -> float:
    """Returns the L2 norm of all gradients of the model, identical on every rank of it.

    Args:
        dense: This rank's counted (replica 0) pieces of dense gradients.
        expert: This rank's counted pieces of expert gradients.
        groups: The model's groups.
        device: Device of the reduction (the gradients').

    Returns:
        The norm.
    """
    dense_total = _squared_sum(dense, device)
    _reduce(dense_total, [groups.dense, groups.tp])
    if groups.expert is not None:
        expert_total = _squared_sum(expert, device)
        _reduce(expert_total, [groups.expert, groups.ep, groups.etp])
        dense_total += expert_total
    _reduce(dense_total, [groups.pp])
    return math.sqrt(float(dense_total))


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Returns the factor that scales gradients of norm ``grad_norm`` to at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: ``max_norm / (grad_norm + 1e-6)`` when
    that is below 1, else 1; ``max_norm == 0`` disables clipping.

    Args:
        grad_norm: The global gradient norm.
        max_norm: The clipping threshold (0 disables clipping).

    Returns:
        The factor, in ``(0, 1]``.
    """
    if max_norm <= 0.0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))
