"""Record where each local parameter sits in its global tensor, and materialise meta models.

``parallelize`` and the pipeline split change which block of every global tensor a rank holds;
:func:`place_parameters` writes that down on each parameter (a
:class:`~mcore_models.init.GlobalSlice`: canonical name, global shape, offset) from the
partition dimensions that the tensor-parallel and expert layers record
(``mcore_parallel.sharding.set_partition_dim``). :func:`materialize` then allocates the
parameters of a model built on the meta device and fills each one with its block of the
layout-independent initialisation, so every layout starts from the same full weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from mcore_models.init import GlobalSlice, fill_normal_block, global_slice, set_global_slice
from mcore_parallel.sharding import get_partition_dims

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["axis_size_and_rank", "initialize_parameter", "materialize_module", "place_parameters"]


def axis_size_and_rank(state: ParallelState | None, axis: str) -> tuple[int, int]:
    """Size of a partition axis and this rank's index along it.

    Args:
        state: Parallel state, or None for a single rank.
        axis: ``"tp"``, ``"ep"`` or ``"etp"``.

    Returns:
        ``(size, rank)``.
    """
    if state is None:
        return 1, 0
    return getattr(state, f"{axis}_size"), getattr(state, f"{axis}_rank")


def place_parameters(
    module: nn.Module, state: ParallelState | None, canonical: Callable[[str], str]
) -> None:
    """Record the :class:`GlobalSlice` of every parameter of ``module``.

    Args:
        module: A model or pipeline chunk (after any sharding).
        state: Parallel state whose axis sizes/ranks the partition dims refer to.
        canonical: Maps a local parameter name to its name in the unsharded, unpipelined model.
    """
    for name, param in module.named_parameters():
        shape = list(param.shape)
        offset = [0] * param.dim()
        for axis, dim in get_partition_dims(param).items():
            size, rank = axis_size_and_rank(state, axis)
            offset[dim] = rank * shape[dim]
            shape[dim] *= size
        set_global_slice(param, GlobalSlice(canonical(name), tuple(shape), tuple(offset)))


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer storage on ``device`` (uninitialised).

    Unlike ``Module.to_empty`` this allocates with ``torch.empty`` directly: the meta path of
    ``empty_like`` runs a Python reference that imports sympy (seconds per process), and the
    attributes recorded on each parameter (partition dims, global slices) are kept.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            fresh = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device),
                requires_grad=param.requires_grad,
            )
            fresh.__dict__.update(vars(param))
            sub._parameters[name] = fresh
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


@torch.no_grad()
def materialize_module(
    module: nn.Module,
    device: torch.device | str,
    *,
    seed: int,
    init_std: float,
    initialize: bool = True,
) -> None:
    """Allocate a meta-device module on ``device`` and initialise this rank's blocks.

    Rules by canonical name: norm weights (``*norm.weight``) are ones, biases zeros, every
    other parameter its block of ``normal(0, init_std)`` drawn as in :mod:`mcore_models.init`.
    Buffers are reset by each module's ``reset_buffers()``. Attributes recorded on the
    parameters (partition dims, global slices, sequence-parallel marks) are kept.

    Args:
        module: Model or pipeline chunk, parameters on the meta device (or already placed).
        device: Target device.
        seed: Model seed.
        init_std: Standard deviation of the normal initialisation.
        initialize: False only allocates (for loaders that overwrite every parameter).
    """
    _allocate(module, torch.device(device))
    if initialize:
        for param in module.parameters():
            initialize_parameter(param, seed=seed, init_std=init_std)
    for sub in module.modules():
        reset_buffers = getattr(sub, "reset_buffers", None)
        if callable(reset_buffers):
            reset_buffers()


@torch.no_grad()
def initialize_parameter(param: torch.Tensor, *, seed: int, init_std: float) -> None:
    """Fill one placed parameter with its block of the global initial value.

    Args:
        param: A parameter with a recorded :class:`GlobalSlice`.
        seed: Model seed.
        init_std: Standard deviation of the normal initialisation.

    Raises:
        ValueError: If the parameter has no recorded place.
    """
    where = global_slice(param)
    if where is None:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} has no global slice; call "
            "place_parameters first"
        )
    if where.name.endswith("norm.weight"):
        param.fill_(1.0)
    elif where.name.endswith(".bias"):
        param.zero_()
    else:
        fill_normal_block(param, where, seed=seed, std=init_std)
