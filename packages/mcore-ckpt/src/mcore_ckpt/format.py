"""The versioned on-disk format: our metadata file and a registry of readers per version.

A checkpoint directory holds the files of torch.distributed.checkpoint (``.metadata`` and
``__<rank>_<n>.distcp``) plus ``mcore_metadata.json``, written last, which records the format
version, the package versions that wrote it, the parallel layout, every tensor's global shape,
dtype and chunks, the Python objects, and every file's size and CRC-32. JSON rather than a
pickle so that reading it never depends on importable classes.

Each format version that was ever released has a reader in :data:`READERS`. A checkpoint whose
version has no reader fails with :class:`~mcore_ckpt.errors.CheckpointVersionError` saying
which version it is and what to do.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from mcore_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "DCP_METADATA_FILE",
    "TensorInfo",
    "FileInfo",
    "CheckpointInfo",
    "READERS",
    "register_reader",
    "read_checkpoint_info",
    "write_checkpoint_info",
    "package_versions",
]

FORMAT_NAME = "mcore-ckpt"
FORMAT_VERSION = 1
METADATA_FILE = "mcore_metadata.json"
DCP_METADATA_FILE = ".metadata"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor as stored: its global shape, dtype and the chunks that cover it.

    Attributes:
        shape: Global shape.
        dtype: Name of the torch dtype (``"bfloat16"``).
        chunks: ``(offsets, sizes)`` of every stored block.
    """

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a :class:`torch.dtype`."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorruptError(f"dtype={self.dtype!r} is not a torch dtype")
        return dtype


@dataclass(frozen=True, slots=True)
class FileInfo:
    """Size and checksums of one file of a checkpoint.

    Attributes:
        size: Length in bytes.
        crc32: CRC-32 of each consecutive segment of ``segment_bytes`` bytes (the last one may
            be shorter); segments let large files hash in parallel and locate damage.
        segment_bytes: Length of a checksum segment.
    """

    size: int
    crc32: tuple[int, ...]
    segment_bytes: int


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """Everything the metadata file says about one checkpoint.

    Attributes:
        path: The checkpoint directory.
        format_version: Format version it was written with.
        name: Directory name (``"step_000000100"``).
        step: Step number encoded in the name.
        created_utc: ISO time of the commit.
        versions: Package versions of the writer (mcore-ckpt, mcore-parallel, torch, python).
        layout: Parallel layout of the writer (world_size and, when known, tp/pp/cp/ep/dp).
        tensors: Tensors by dotted path.
        objects: Dotted paths of the pickled Python objects.
        files: Every data file of the checkpoint by name.
    """

    path: Path
    format_version: int
    name: str
    step: int
    created_utc: str
    versions: dict[str, str]
    layout: dict[str, int]
    tensors: dict[str, TensorInfo]
    objects: tuple[str, ...]
    files: dict[str, FileInfo] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Bytes of all files."""
        return sum(f.size for f in self.files.values())


def package_versions() -> dict[str, str]:
    """Versions of the packages a checkpoint's readability depends on.

    Returns:
        Distribution name to version (``"absent"`` when not installed), plus ``python``.
    """
    out = {}
    for dist in ("mcore-ckpt", "mcore-parallel", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    out["python"] = platform.python_version()
    return out


def write_checkpoint_info(info: CheckpointInfo) -> None:
    """Writes ``mcore_metadata.json`` into ``info.path`` and flushes it to disk.

    Args:
        info: What to record; ``info.format_version`` must be :data:`FORMAT_VERSION`.
    """
    payload = {
        "format": FORMAT_NAME,
        "format_version": info.format_version,
        "name": info.name,
        "step": info.step,
        "created_utc": info.created_utc,
        "versions": info.versions,
        "layout": info.layout,
        "tensors": {
            fqn: {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in t.chunks],
            }
            for fqn, t in info.tensors.items()
        },
        "objects": list(info.objects),
        "files": {
            name: {"size": f.size, "segment_bytes": f.segment_bytes, "crc32": list(f.crc32)}
            for name, f in info.files.items()
        },
    }
    target = info.path / METADATA_FILE
    with open(target, "w", encoding="utf-8") as stream:
        json.dump(payload, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())


def _read_v1(path: Path, raw: dict[str, Any]) -> CheckpointInfo:
    tensors = {
        fqn: TensorInfo(
            shape=tuple(t["shape"]),
            dtype=t["dtype"],
            chunks=tuple((tuple(c["offsets"]), tuple(c["sizes"])) for c in t["chunks"]),
        )
        for fqn, t in raw["tensors"].items()
    }
    return CheckpointInfo(
        path=path,
        format_version=int(raw["format_version"]),
        name=str(raw["name"]),
        step=int(raw["step"]),
        created_utc=str(raw["created_utc"]),
        versions=dict(raw["versions"]),
        layout={k: int(v) for k, v in raw["layout"].items()},
        tensors=tensors,
        objects=tuple(raw["objects"]),
        files={
            n: FileInfo(int(f["size"]), tuple(int(c) for c in f["crc32"]), int(f["segment_bytes"]))
            for n, f in raw["files"].items()
        },
    )


READERS: dict[int, Callable[[Path, dict[str, Any]], CheckpointInfo]] = {1: _read_v1}
"""Readers of the metadata file by format version; each returns the current schema."""


def register_reader(
    format_version: int, reader: Callable[[Path, dict[str, Any]], CheckpointInfo]
) -> None:
    """Adds (or replaces) the reader of one format version.

    Args:
        format_version: The version the reader understands.
        reader: Called with the checkpoint directory and the parsed metadata JSON.
    """
    READERS[int(format_version)] = reader


def read_checkpoint_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Reads and upgrades the metadata of one checkpoint directory.

    Args:
        path: A checkpoint directory (not a root holding several).

    Returns:
        The checkpoint's description in the current schema.

    Raises:
        CheckpointNotFoundError: If ``path`` has no metadata file (not a committed checkpoint).
        CheckpointCorruptError: If the metadata file is unreadable or malformed.
        CheckpointVersionError: If no reader exists for the checkpoint's format version.
    """
    directory = Path(path)
    target = directory / METADATA_FILE
    if not target.is_file():
        raise CheckpointNotFoundError(
            f"path={str(directory)!r} is not a committed mcore-ckpt checkpoint: {METADATA_FILE} "
            f"is missing"
        )
    try:
        raw = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointCorruptError(f"{target} is unreadable: {error}") from error
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{target} is not mcore-ckpt metadata (no 'format' field)")
    found = raw.get("format_version")
    reader = READERS.get(found) if isinstance(found, int) else None
    if reader is None:
        known = sorted(READERS)
        advice = (
            "upgrade mcore-ckpt to a release that reads it"
            if isinstance(found, int) and found > max(known)
            else "convert it with an older mcore-ckpt release that reads it"
        )
        raise CheckpointVersionError(
            f"{target} has format_version={found!r}; this mcore-ckpt reads versions {known}: "
            f"{advice}"
        )
    try:
        return reader(directory, raw)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointCorruptError(f"{target} is malformed: {error!r}") from error
