"""The unfused collective sequence: reduce-scatter, residual add + RMSNorm, all-gather.

It runs on any backend torch.distributed offers (gloo on CPU, NCCL on GPU) and defines the
semantics the symmetric-memory kernels reproduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_kernels.rms_norm import rms_norm

__all__ = ["rs_add_rmsnorm_ag_collectives"]


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros(rows, tensor.shape[1])
    padded[: tensor.shape[0]] = tensor
    return padded


def rs_add_rmsnorm_ag_collectives(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: dist.ProcessGroup | None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce-scatter, residual add + RMSNorm on this rank's token slice, then all-gather.

    Tokens are split into ``world`` contiguous slices of ``ceil(tokens / world)`` rows (the last
    padded with zero rows, which are dropped again after the gather). The reduction is the
    backend's own ``reduce_scatter_tensor`` in the input dtype; the add and the normalisation are
    :func:`mcore_kernels.rms_norm` with ``residual``; one ``all_gather_into_tensor`` carries both
    the normalised rows and the new residual rows. Arguments are assumed validated.

    Args:
        partial: this rank's ``[tokens, hidden]`` partial sum.
        residual: ``[tokens, hidden]`` residual, the same on every rank.
        weight: ``[hidden]`` RMSNorm scale.
        eps: added to the mean square before the reciprocal square root.
        group: the tensor-parallel process group (None: the default group).
        out: optional ``(normed_out, residual_out)`` written in place and returned.

    Returns:
        ``(normed, new_residual)``, each ``[tokens, hidden]`` in the input dtype.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    tokens, hidden = partial.shape
    slice_rows = -(-tokens // world)
    padded_rows = slice_rows * world
    reduced = partial.new_empty(slice_rows, hidden)
    dist.reduce_scatter_tensor(reduced, _pad_rows(partial, padded_rows), group=group)
    start = rank * slice_rows
    # Zero rows stand in for the padding so that every rank runs the same shapes.
    own_residual = _pad_rows(residual, padded_rows)[start : start + slice_rows]
    normed_slice, residual_slice = rms_norm(reduced, weight, eps, residual=own_residual)
    gathered = partial.new_empty(world * 2, slice_rows, hidden)
    dist.all_gather_into_tensor(gathered, torch.stack((normed_slice, residual_slice)), group=group)
    gathered = gathered.view(world, 2, slice_rows, hidden)
    normed = gathered[:, 0].reshape(padded_rows, hidden)[:tokens]
    new_residual = gathered[:, 1].reshape(padded_rows, hidden)[:tokens]
    if out is None:
        return normed.contiguous(), new_residual.contiguous()
    out[0].copy_(normed)
    out[1].copy_(new_residual)
    return out[0], out[1]
