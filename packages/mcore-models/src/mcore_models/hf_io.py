"""Reading slices of Hugging Face safetensors checkpoints into local shards.

A global mcore tensor is composed of one or more checkpoint tensors (:class:`HFPiece`): a dense
projection is one checkpoint tensor; an expert weight ``[E, ...]`` is ``E`` of them, one per
expert. :func:`read_into` fills a rank's block of the global tensor by reading, through
safetensors' slice API, only the parts of the checkpoint tensors that fall into the block, so a
rank never reads a whole tensor it holds only a slice of.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mcore_models.errors import CheckpointFormatError
from mcore_models.init import GlobalSlice

__all__ = ["HFPiece", "SafetensorsReader", "read_into"]


@dataclass(frozen=True, slots=True)
class HFPiece:
    """One checkpoint tensor and the region of a global mcore tensor that it fills.

    Attributes:
        hf_name: Name of the tensor in the checkpoint.
        region: One entry per dimension of the global tensor: an ``int`` (the checkpoint
            tensor has no such dimension; it fills that single index) or a ``slice`` with
            explicit start and stop (the checkpoint tensor's next dimension spans it).
    """

    hf_name: str
    region: tuple[int | slice, ...]


class SafetensorsReader:
    """Lazily opened safetensors files of a checkpoint directory.

    Args:
        directory: Directory with ``model.safetensors`` or ``model.safetensors.index.json``
            and its shards.

    Raises:
        CheckpointFormatError: If the directory has neither.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.files = checkpoint_files(self.directory)
        """Checkpoint tensor name -> file holding it."""
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0
        """Bytes of tensor data read so far (for memory accounting and tests)."""

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise CheckpointFormatError(
                f"tensor {name!r} is missing from the checkpoint at {str(self.directory)!r}"
            )
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a checkpoint tensor (reads only the header).

        Args:
            name: Checkpoint tensor name.

        Returns:
            Its shape.
        """
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read a checkpoint tensor, or only the block ``index`` of it.

        Args:
            name: Checkpoint tensor name.
            index: One slice per dimension (None: the whole tensor).

        Returns:
            The tensor (or block) on the CPU in the checkpoint's dtype.
        """
        handle = self._handle(name)
        tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        """Close the open files."""
        self._handles.clear()


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Map every tensor name of a safetensors checkpoint directory to its file.

    Args:
        directory: Checkpoint directory.

    Returns:
        Tensor name -> file.

    Raises:
        CheckpointFormatError: If no safetensors weights are found.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise CheckpointFormatError(
        f"path={str(directory)!r} has neither model.safetensors nor model.safetensors.index.json"
    )


def _intersect(
    region: tuple[int | slice, ...], box: tuple[slice, ...]
) -> tuple[tuple[slice, ...], tuple[int | slice, ...]] | None:
    """Checkpoint-tensor index and local-tensor index of ``region`` within ``box``."""
    source: list[slice] = []
    target: list[int | slice] = []
    for part, window in zip(region, box, strict=True):
        lo, hi = window.start, window.stop
        if isinstance(part, int):
            if not lo <= part < hi:
                return None
            target.append(part - lo)
            continue
        start, stop = max(part.start, lo), min(part.stop, hi)
        if start >= stop:
            return None
        source.append(slice(start - part.start, stop - part.start))
        target.append(slice(start - lo, stop - lo))
    return tuple(source), tuple(target)


@torch.no_grad()
def read_into(
    local: torch.Tensor,
    where: GlobalSlice,
    pieces: list[HFPiece],
    reader: SafetensorsReader,
) -> None:
    """Fill ``local`` (the block ``where`` of a global tensor) from checkpoint pieces.

    Args:
        local: The local tensor to fill.
        where: Its place in the global tensor.
        pieces: The checkpoint tensors that compose the global tensor.
        reader: Open checkpoint.

    Raises:
        CheckpointFormatError: If a checkpoint tensor's shape does not match its region, or
            the pieces leave part of ``local`` unfilled.
    """
    box = where.box(tuple(local.shape))
    covered = 0
    for piece in pieces:
        expected = tuple(p.stop - p.start for p in piece.region if isinstance(p, slice))
        actual = reader.shape(piece.hf_name)
        if actual != expected:
            raise CheckpointFormatError(
                f"tensor {piece.hf_name!r} has shape {actual}; the model expects {expected} "
                f"for {where.name!r}"
            )
        hit = _intersect(piece.region, box)
        if hit is None:
            continue
        source, target = hit
        block = reader.read(piece.hf_name, source)
        local[target] = block.to(local.dtype)
        covered += block.numel()
    if covered != local.numel():
        raise CheckpointFormatError(
            f"the checkpoint tensors {[p.hf_name for p in pieces][:4]} fill {covered} of the "
            f"{local.numel()} elements of {where.name!r} (shape {where.global_shape})"
        )
