"""In-place weight updates from tensors in any parallel layout (for RL weight pushes).

Every parameter of a model built by ``mcore_models`` records where its block sits in the global
tensor (:func:`mcore_models.init.global_slice`: canonical name, global shape, offset). The
caller gives global tensors or blocks of them (``mcore_parallel.sharding.ShardedTensor``) in
whatever layout its trainer uses; each local block receives its intersection with every given
block. The whole update is planned and checked first, then copied: a mismatch raises before any
parameter changes. Copies go into the existing storages, so captured CUDA graphs stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

from mcore_inference.errors import WeightUpdateError
from mcore_models.init import GlobalSlice, global_slice
from mcore_parallel.sharding import ShardedTensor

__all__ = ["WeightSource", "model_weight_shards", "update_weights_in_place", "whole_model_names"]

WeightSource: TypeAlias = (
    "Mapping[str, torch.Tensor | ShardedTensor | Sequence[ShardedTensor]] "
    "| Iterable[tuple[str, torch.Tensor | ShardedTensor | Sequence[ShardedTensor]]]"
)
"""Weights keyed by canonical name: full tensors, blocks with their offsets, or lists of blocks."""

_Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class _Copy:
    param: torch.Tensor
    target: tuple[slice, ...]
    source: torch.Tensor
    source_index: tuple[slice, ...]


def _as_blocks(name: str, value: Any) -> list[ShardedTensor]:
    values = value if isinstance(value, (list, tuple)) else [value]
    blocks = []
    for item in values:
        if isinstance(item, ShardedTensor):
            blocks.append(item)
        elif isinstance(item, torch.Tensor):
            blocks.append(ShardedTensor(item, tuple(item.shape), (0,) * item.dim()))
        else:
            raise WeightUpdateError(
                f"weights[{name!r}] holds a {type(item).__name__}; expected a torch.Tensor, a "
                "ShardedTensor or a list of ShardedTensors"
            )
    return blocks


def _collect(weights: Any) -> dict[str, list[ShardedTensor]]:
    items = weights.items() if isinstance(weights, Mapping) else weights
    collected: dict[str, list[ShardedTensor]] = {}
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise WeightUpdateError(
                f"weights entry {entry!r}; expected (canonical name, tensor) pairs or a mapping"
            )
        name, value = entry
        collected.setdefault(name, []).extend(_as_blocks(name, value))
    return collected


def _local_places(model: nn.Module) -> list[tuple[torch.Tensor, GlobalSlice]]:
    places: list[tuple[torch.Tensor, GlobalSlice]] = []
    for name, param in model.named_parameters():
        where = global_slice(param)
        if where is None:  # a model that was never placed: its local tensors are global
            where = GlobalSlice(name, tuple(param.shape), (0,) * param.dim())
        places.append((param, where))
    return places


def _global_names(model: nn.Module, local: set[str]) -> set[str]:
    """Canonical names of the whole model (parameters held by other ranks included)."""
    config = getattr(model, "config", None)
    try:
        whole = type(model)(config, device="meta")  # type: ignore[call-arg]
    except Exception:  # not a GPTModel-like class: only the local names are known
        return local
    names = {where.name for _, where in _local_places(whole)}
    return names | local


def _intersection(a: _Box, b: _Box) -> _Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in box) else box


def _volume(box: _Box) -> int:
    volume = 1
    for lo, hi in box:
        volume *= hi - lo
    return volume


def _plan(param: torch.Tensor, where: GlobalSlice, blocks: list[ShardedTensor]) -> list[_Copy]:
    name = where.name
    local_box = tuple(
        (offset, offset + size)
        for offset, size in zip(where.global_offset, param.shape, strict=True)
    )
    copies: list[_Copy] = []
    covered: list[_Box] = []
    for block in blocks:
        if tuple(block.global_shape) != tuple(where.global_shape):
            raise WeightUpdateError(
                f"weights[{name!r}] has global shape {tuple(block.global_shape)}; expected "
                f"{tuple(where.global_shape)}"
            )
        if block.local.dtype != param.dtype:
            raise WeightUpdateError(
                f"weights[{name!r}] has dtype {block.local.dtype}; expected {param.dtype} (the "
                "parameter's; cast before updating)"
            )
        block_box = tuple(
            (offset, offset + size)
            for offset, size in zip(block.global_offset, block.local.shape, strict=True)
        )
        box = _intersection(local_box, block_box)
        if box is None or box in covered:
            continue  # an identical block twice (the tied embedding's copy on a last stage)
        if any(_intersection(box, other) is not None for other in covered):
            raise WeightUpdateError(
                f"weights[{name!r}] holds overlapping blocks over global region {box}; "
                "expected disjoint blocks"
            )
        covered.append(box)
        target = tuple(slice(lo - l0, hi - l0) for (lo, hi), (l0, _) in zip(box, local_box))
        source_index = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(box, block_box))
        copies.append(_Copy(param, target, block.local, source_index))
    have = sum(_volume(box) for box in covered)
    if have != param.numel():
        raise WeightUpdateError(
            f"weights[{name!r}] covers {have} of the {param.numel()} elements of this rank's "
            f"block {local_box} of the global tensor {tuple(where.global_shape)}; expected "
            "blocks that cover it entirely"
        )
    return copies


def whole_model_names(model: nn.Module) -> set[str]:
    """Canonical parameter names of the whole model this model (or stage) belongs to.

    Args:
        model: A model or pipeline stage.

    Returns:
        The names (those of other stages and expert ranks included, when the model class can
        be built on the meta device from its config; else only the local ones).
    """
    return _global_names(model, {where.name for _, where in _local_places(model)})


def update_weights_in_place(
    model: nn.Module, weights: WeightSource, *, known_names: set[str] | None = None
) -> int:
    """Copy weights given in any layout into this rank's parameters, all or nothing.

    Args:
        model: A model (or pipeline stage) whose parameters carry global slices.
        weights: Canonical name -> full tensor, ShardedTensor, or list of ShardedTensors;
            a mapping or an iterable of pairs.
        known_names: :func:`whole_model_names` of the model, when the caller keeps them.

    Returns:
        The number of local parameters updated.

    Raises:
        WeightUpdateError: If a name is unknown to the model, a local parameter has no
            weight, a global shape or dtype differs, blocks overlap, or the blocks do not
            cover a local parameter; nothing is copied then.
    """
    given = _collect(weights)
    places = _local_places(model)
    local_names = {where.name for _, where in places}
    known = known_names if known_names is not None else _global_names(model, local_names)
    unknown = sorted(set(given) - known)
    if unknown:
        raise WeightUpdateError(
            f"weights hold {len(unknown)} names that are not parameters of the model "
            f"(e.g. {unknown[:3]}); expected canonical names such as "
            f"{sorted(local_names)[:2]}"
        )
    missing = sorted(local_names - set(given))
    if missing:
        raise WeightUpdateError(
            f"weights lack {len(missing)} parameters of this rank (e.g. {missing[:3]}); "
            "expected every local parameter"
        )
    plan = [copy for param, where in places for copy in _plan(param, where, given[where.name])]
    with torch.no_grad():
        for copy in plan:
            copy.param[copy.target].copy_(copy.source[copy.source_index])
    return len(places)


def model_weight_shards(model: nn.Module) -> dict[str, ShardedTensor]:
    """This rank's parameters as blocks of their global tensors, keyed by canonical name.

    What a trainer rank sends to :meth:`mcore_inference.InferenceEngine.update_weights`
    (gather the dicts of all trainer ranks, then pass lists of blocks per name).

    Args:
        model: A model (or stage) built by ``mcore_models``.

    Returns:
        Canonical name -> :class:`~mcore_parallel.sharding.ShardedTensor` (a detached view of
        the parameter).
    """
    return {
        where.name: ShardedTensor(param.detach(), where.global_shape, where.global_offset)
        for param, where in _local_places(model)
    }
