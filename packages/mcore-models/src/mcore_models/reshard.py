"""Move weights between two parallel layouts of the same model, in memory, by their slices.

RL trains the policy at one layout (say tp=2 x pp=2) and generates at another (tp=1 x dp=4) on
the same ranks. After every optimizer step, :class:`Resharder` copies the new weights from the
training model's parameters into the inference model's parameters: every parameter records its
block of the global tensor (:func:`mcore_models.init.global_slice`), so a plan made once from
that metadata says which part of which source block every destination block needs; each step
then sends exactly those parts point-to-point (``batch_isend_irecv``), never a whole model to
one rank and never through disk. Destination parameters are written in place (same storages),
so CUDA graphs captured over the inference model stay valid.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_models.errors import ModelConfigError
from mcore_models.init import GlobalSlice, global_slice

__all__ = ["Resharder", "ReshardStats"]


@dataclass(frozen=True, slots=True)
class _Block:
    """One rank's block of a global tensor: (name, offset, shape)."""

    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class _Transfer:
    """Part of a source block that a destination block needs."""

    name: str
    region: tuple[slice, ...]
    """The overlap, in global coordinates."""


@dataclass(slots=True)
class ReshardStats:
    """What one :meth:`Resharder.push` moved."""

    bytes_sent: int = 0
    """Bytes this rank sent to other ranks."""
    bytes_received: int = 0
    """Bytes this rank received from other ranks."""
    bytes_local: int = 0
    """Bytes copied between the two models on this rank."""
    seconds: float = 0.0
    """Wall time of the push on this rank."""


def _blocks(chunks: list[nn.Module]) -> dict[str, tuple[torch.Tensor, GlobalSlice]]:
    found: dict[str, tuple[torch.Tensor, GlobalSlice]] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            where = global_slice(param)
            if where is None:
                raise ModelConfigError(
                    f"a parameter of shape {tuple(param.shape)} has no global slice; build the "
                    "models with GPTModel and mcore_models.parallelize"
                )
            # A tied copy (last stage) holds the same block as the embedding: one is enough.
            found.setdefault(where.name, (param, where))
    return found


def _describe(tensor: torch.Tensor, where: GlobalSlice) -> _Block:
    return _Block(where.name, where.global_offset, tuple(tensor.shape), str(tensor.dtype))


def _overlap(
    offset: tuple[int, ...], shape: tuple[int, ...], b: _Block
) -> tuple[slice, ...] | None:
    region = []
    for oa, na, ob, nb in zip(offset, shape, b.offset, b.shape, strict=True):
        start, stop = max(oa, ob), min(oa + na, ob + nb)
        if start >= stop:
            return None
        region.append(slice(start, stop))
    return tuple(region)


def _local_view(
    tensor: torch.Tensor, where: GlobalSlice, region: tuple[slice, ...]
) -> torch.Tensor:
    index = tuple(
        slice(r.start - o, r.stop - o) for r, o in zip(region, where.global_offset, strict=True)
    )
    return tensor.data[index]


class Resharder:
    """A reusable plan that copies weights from one layout of a model into another.

    Every rank of the default process group must construct it (it exchanges block metadata)
    and call :meth:`push` together. Source and destination may be any layouts built by
    :func:`mcore_models.parallelize` (tp, pp with virtual stages, ep, etp; replicated over
    dp/cp): a destination rank that holds a source block itself (a replica) copies it locally;
    otherwise, of the ranks holding it, the one with the lowest global rank sends it.

    Args:
        source: This rank's chunks of the model to read (e.g. the training stages).
        destination: This rank's chunks of the model to write (e.g. the inference model).

    Raises:
        ModelConfigError: If a destination block is not fully covered by the source blocks,
            or the shapes of a tensor disagree between the two layouts.
    """

    def __init__(self, source: list[nn.Module], destination: list[nn.Module]) -> None:
        self._source = _blocks(source)
        self._destination = _blocks(destination)
        rank = dist.get_rank()
        world = dist.get_world_size()
        mine = (
            [_describe(t, w) for t, w in self._source.values()],
            [_describe(t, w) for t, w in self._destination.values()],
            {w.name: (w.global_shape, str(t.dtype)) for t, w in self._source.values()},
        )
        everyone: list[tuple[list[_Block], list[_Block], dict[str, tuple[Any, str]]]] = [
            ([], [], {}) for _ in range(world)
        ]
        dist.all_gather_object(everyone, mine)
        holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for source_rank, (blocks, _, _) in enumerate(everyone):
            for block in blocks:
                holders.setdefault((block.name, block.offset, block.shape), []).append(source_rank)
        sources: dict[str, tuple[Any, str]] = {}
        for _, _, described in everyone:
            sources.update(described)
        for tensor, where in self._destination.values():
            expected = (where.global_shape, str(tensor.dtype))
            if sources.get(where.name) != expected:
                raise ModelConfigError(
                    f"{where.name!r} is {expected} (global shape, dtype) in the destination and "
                    f"{sources.get(where.name)} in the source layout"
                )
        self._sends: dict[int, list[_Transfer]] = defaultdict(list)
        self._receives: dict[int, list[_Transfer]] = defaultdict(list)
        for destination_rank, (_, wanted, _) in enumerate(everyone):
            for target in wanted:
                covered = 0
                for (name, offset, shape), ranks in holders.items():
                    if name != target.name:
                        continue
                    region = _overlap(offset, shape, target)
                    if region is None:
                        continue
                    # Replicas (data or context parallel) never travel to a rank holding one.
                    source_rank = destination_rank if destination_rank in ranks else ranks[0]
                    covered += _numel(region)
                    transfer = _Transfer(name, region)
                    if source_rank == rank:
                        self._sends[destination_rank].append(transfer)
                    if destination_rank == rank:
                        self._receives[source_rank].append(transfer)
                if covered != _numel(tuple(slice(0, n) for n in target.shape)):
                    raise ModelConfigError(
                        f"the source layout covers {covered} of the "
                        f"{_numel(tuple(slice(0, n) for n in target.shape))} elements of "
                        f"{target.name!r} at offset {target.offset} on rank {destination_rank}"
                    )

    def _by_dtype(self, transfers: list[_Transfer]) -> list[list[_Transfer]]:
        """Transfers split into one group per dtype (one message each), in a fixed order."""
        groups: dict[torch.dtype, list[_Transfer]] = {}
        for transfer in transfers:
            dtype = self._destination.get(transfer.name, self._source.get(transfer.name))
            key = dtype[0].dtype if dtype is not None else torch.float32
            groups.setdefault(key, []).append(transfer)
        return [groups[key] for key in sorted(groups, key=str)]

    @torch.no_grad()
    def push(self) -> ReshardStats:
        """Copy the source weights into the destination parameters (collective).

        Returns:
            Bytes moved and the time it took on this rank.
        """
        start = time.perf_counter()
        stats = ReshardStats()
        rank = dist.get_rank()
        for transfer in self._sends.get(rank, []):
            source, source_where = self._source[transfer.name]
            target, target_where = self._destination[transfer.name]
            piece = _local_view(source, source_where, transfer.region)
            _local_view(target, target_where, transfer.region).copy_(piece)
            stats.bytes_local += piece.numel() * piece.element_size()
        operations = []
        incoming: list[tuple[list[_Transfer], torch.Tensor]] = []
        for peer, transfers in sorted(self._sends.items()):
            if peer == rank:
                continue
            for group in self._by_dtype(transfers):
                parts = [_local_view(*self._source[t.name], t.region).reshape(-1) for t in group]
                buffer = torch.cat(parts)
                stats.bytes_sent += buffer.numel() * buffer.element_size()
                operations.append(dist.P2POp(dist.isend, buffer, peer))
        for peer, transfers in sorted(self._receives.items()):
            if peer == rank:
                continue
            for group in self._by_dtype(transfers):
                first = self._destination[group[0].name][0]
                buffer = torch.empty(
                    sum(_numel(t.region) for t in group), dtype=first.dtype, device=first.device
                )
                incoming.append((group, buffer))
                stats.bytes_received += buffer.numel() * buffer.element_size()
                operations.append(dist.P2POp(dist.irecv, buffer, peer))
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()
        for group, buffer in incoming:
            cursor = 0
            for transfer in group:
                view = _local_view(*self._destination[transfer.name], transfer.region)
                count = view.numel()
                view.copy_(buffer[cursor : cursor + count].view(view.shape))
                cursor += count
        stats.seconds = time.perf_counter() - start
        return stats


def _numel(region: tuple[slice, ...]) -> int:
    count = 1
    for part in region:
        count *= part.stop - part.start
    return count
