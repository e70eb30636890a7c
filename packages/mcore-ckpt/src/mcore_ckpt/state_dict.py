"""Walks nested state dicts into flat entries that a checkpoint stores, and back.

A state dict is a tree of ``dict`` and ``list`` containers whose leaves are tensors,
:class:`~mcore_parallel.sharding.ShardedTensor` blocks or picklable Python objects. A container
without any tensor inside (a config dict, a list of numbers) is one object leaf. Values with
a ``sharded_state_dict()`` method (a distributed optimizer, for instance) are expanded into the
state dict they return; on load, their ``load_sharded_state_dict(sd)`` receives it back. An ``nn.Module`` without such
a method is expanded by :func:`mcore_parallel.checkpointing.sharded_state_dict` (tensor-parallel
weights become their blocks; the blocks alias the parameters, so loading fills them in place).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mcore_ckpt.errors import CheckpointTypeError
from mcore_parallel.checkpointing import sharded_state_dict as module_sharded_state_dict
from mcore_parallel.sharding import ShardedTensor

__all__ = ["Entry", "flatten_state_dict", "sync_params"]

SEPARATOR = "."


@dataclass(slots=True)
class Entry:
    """One leaf of a state dict, flattened.

    Attributes:
        fqn: Dotted path of the leaf (``"model.layers.0.weight"``); list items use their index.
        container: The dict or list holding the leaf, so that loading can replace objects.
        key: Key or index of the leaf inside ``container``.
        value: The leaf itself.
    """

    fqn: str
    container: dict[Any, Any] | list[Any]
    key: Any
    value: Any

    @property
    def is_tensor(self) -> bool:
        """Whether the leaf is a tensor or a block of a sharded tensor."""
        return isinstance(self.value, (torch.Tensor, ShardedTensor))

    @property
    def local(self) -> torch.Tensor:
        """The tensor this rank holds for this leaf."""
        return self.value.local if isinstance(self.value, ShardedTensor) else self.value

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the full tensor across ranks."""
        if isinstance(self.value, ShardedTensor):
            return self.value.global_shape
        return tuple(self.value.shape)

    @property
    def global_offset(self) -> tuple[int, ...]:
        """Index of the local block's first element in the full tensor."""
        if isinstance(self.value, ShardedTensor):
            return self.value.global_offset
        return (0,) * self.value.dim()

    @property
    def is_replica(self) -> bool:
        """Whether another rank writes this block (a positive ``replica_id``)."""
        return isinstance(self.value, ShardedTensor) and self.value.replica_id > 0

    @property
    def is_empty_block(self) -> bool:
        """Whether this rank holds no element of a non-empty global tensor (nothing to move)."""
        return self.local.numel() == 0 and math.prod(self.global_shape) > 0


def _is_stateful(value: Any) -> bool:
    if isinstance(value, (dict, list, torch.Tensor, ShardedTensor)):
        return False
    return isinstance(value, nn.Module) or callable(getattr(value, "sharded_state_dict", None))


def _expand(value: Any, fqn: str, state: Any) -> dict[str, Any]:
    if callable(getattr(value, "sharded_state_dict", None)):
        sub = value.sharded_state_dict()
    else:
        sub = module_sharded_state_dict(value, state)
    if not isinstance(sub, dict):
        raise CheckpointTypeError(
            f"{type(value).__name__}.sharded_state_dict() at {fqn!r} must return a dict, got "
            f"{type(sub).__name__}"
        )
    return sub


def _holds_tensors(node: Any) -> bool:
    if isinstance(node, (torch.Tensor, ShardedTensor)) or _is_stateful(node):
        return True
    if isinstance(node, dict):
        return any(_holds_tensors(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_tensors(v) for v in node)
    return False


def sync_params(state_dict: Any) -> None:
    """Finishes in-flight parameter all-gathers of every object in ``state_dict`` that has them.

    A distributed optimizer that overlaps its parameter all-gather with the next forward pass
    holds stale parameter shards between steps; saving then would store old weights. Every
    value with a ``start_param_sync`` method is asked to sync now (``force_sync=True``).

    Args:
        state_dict: The nested state dict handed to save.
    """
    stack = [state_dict]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif callable(getattr(node, "start_param_sync", None)):
            node.start_param_sync(force_sync=True)


def flatten_state_dict(
    state_dict: dict[str, Any], state: Any = None
) -> tuple[dict[str, Entry], list[tuple[Any, dict[str, Any]]]]:
    """Flattens a nested state dict into entries keyed by dotted path.

    Args:
        state_dict: Nested dicts and lists of tensors, sharded tensors and objects. Dict keys
            must be strings or integers.
        state: The :class:`~mcore_parallel.ParallelState` that modules are sharded over, or
            None for modules held whole.

    Returns:
        The entries by path, and the expanded stateful objects with the state dict each
        returned (to hand back through ``load_sharded_state_dict`` after a load).

    Raises:
        CheckpointTypeError: If ``state_dict`` is not a dict, a key is neither a string nor an
            integer, or two leaves flatten to the same path.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointTypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    entries: dict[str, Entry] = {}
    expanded: list[tuple[Any, dict[str, Any]]] = []
    for fqn, container, key, value in _walk(state_dict, "", expanded, state):
        if fqn in entries:
            raise CheckpointTypeError(
                f"state_dict has two leaves at path {fqn!r}; a key containing "
                f"{SEPARATOR!r} collides with a nested key"
            )
        entries[fqn] = Entry(fqn, container, key, value)
    return entries, expanded


def _walk(
    node: dict[Any, Any] | list[Any],
    prefix: str,
    expanded: list[tuple[Any, dict[str, Any]]],
    state: Any,
) -> Iterator[tuple[str, Any, Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if isinstance(node, dict) and (isinstance(key, bool) or not isinstance(key, (str, int))):
            raise CheckpointTypeError(
                f"state_dict key {key!r} under {prefix or '<root>'!r} must be a str or int, "
                f"got {type(key).__name__}"
            )
        fqn = f"{prefix}{key}"
        if _is_stateful(value):
            sub = _expand(value, fqn, state)
            expanded.append((value, sub))
            value = sub
        if isinstance(value, (dict, list)) and _holds_tensors(value):
            yield from _walk(value, fqn + SEPARATOR, expanded, state)
        else:
            yield fqn, node, key, value
