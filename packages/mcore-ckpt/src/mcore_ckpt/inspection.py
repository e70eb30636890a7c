"""What a checkpoint holds (``inspect``) and whether all of it is there and intact (``validate``)."""

from __future__ import annotations

import math
import os
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mcore_ckpt.errors import CheckpointCorruptError
from mcore_ckpt.format import DCP_METADATA_FILE, CheckpointInfo, TensorInfo, read_checkpoint_info
from mcore_ckpt.layout import resolve_checkpoint_dir
from mcore_ckpt.planner import RemapFileSystemReader
from mcore_ckpt.verify import check_file_checksums

__all__ = ["describe_sharding", "inspect_checkpoint", "format_report", "validate_checkpoint"]


def describe_sharding(tensor: TensorInfo) -> str:
    """Says in words how a tensor's chunks split it.

    Args:
        tensor: The stored tensor.

    Returns:
        ``"whole"``, ``"4 chunks along dim 0"`` or ``"6 blocks"``.
    """
    if len(tensor.chunks) == 1 and tuple(tensor.chunks[0][1]) == tensor.shape:
        return "whole"
    split_dims = {
        dim
        for _, sizes in tensor.chunks
        for dim, (size, full) in enumerate(zip(sizes, tensor.shape))
        if size != full
    }
    if len(split_dims) == 1:
        return f"{len(tensor.chunks)} chunks along dim {split_dims.pop()}"
    return f"{len(tensor.chunks)} blocks"


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describes a checkpoint: versions, layout, tensors with shapes, dtypes and sharding, size.

    Args:
        path: A checkpoint directory or a root with a ``latest`` marker.

    Returns:
        A JSON-serialisable description.

    Raises:
        CheckpointNotFoundError: If ``path`` holds no committed checkpoint.
        CheckpointVersionError: If the format version cannot be read.
        CheckpointCorruptError: If the metadata file is unreadable.
    """
    info = read_checkpoint_info(resolve_checkpoint_dir(path))
    return {
        "path": str(info.path),
        "format_version": info.format_version,
        "step": info.step,
        "created_utc": info.created_utc,
        "versions": info.versions,
        "layout": info.layout,
        "total_bytes": info.total_bytes,
        "tensors": {
            fqn: {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "sharding": describe_sharding(t),
                "bytes": t.nbytes,
            }
            for fqn, t in info.tensors.items()
        },
        "objects": list(info.objects),
        "files": {name: f.size for name, f in sorted(info.files.items())},
    }


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def format_report(report: dict[str, Any]) -> str:
    """Renders :func:`inspect_checkpoint`'s description as text for a terminal.

    Args:
        report: The description.

    Returns:
        Multi-line text.
    """
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    layout = " ".join(f"{k}={v}" for k, v in report["layout"].items())
    lines = [
        f"checkpoint  {report['path']}",
        f"format      v{report['format_version']}, step {report['step']}, "
        f"{_human(report['total_bytes'])} in {len(report['files'])} files",
        f"written by  {versions} at {report['created_utc']}",
        f"layout      {layout}",
        f"tensors     {len(report['tensors'])}",
    ]
    rows = [
        (
            fqn,
            "x".join(map(str, t["shape"])) or "scalar",
            t["dtype"],
            t["sharding"],
            _human(t["bytes"]),
        )
        for fqn, t in report["tensors"].items()
    ]
    widths = [max([len(r[i]) for r in rows] + [1]) for i in range(5)]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    lines.append(f"objects     {len(report['objects'])}")
    lines += [f"  {name}" for name in report["objects"]]
    return "\n".join(lines)


def validate_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Checks that every file is present, complete and unaltered and that all data is covered.

    Args:
        path: A checkpoint directory or a root with a ``latest`` marker.

    Returns:
        The checkpoint's metadata when everything is in order.

    Raises:
        CheckpointNotFoundError: If ``path`` holds no committed checkpoint.
        CheckpointVersionError: If the format version cannot be read.
        CheckpointCorruptError: Naming the file at fault: missing, truncated, altered, or
            storage metadata that disagrees with the checkpoint's own metadata.
    """
    info = read_checkpoint_info(resolve_checkpoint_dir(path))
    check_file_checksums(info)
    metadata = RemapFileSystemReader(info.path).read_metadata()
    where = info.path / DCP_METADATA_FILE
    for fqn, tensor in info.tensors.items():
        stored = metadata.state_dict_metadata.get(fqn)
        if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != tensor.shape:
            raise CheckpointCorruptError(f"{where} does not describe tensor {fqn!r} {tensor.shape}")
        covered = sum(math.prod(sizes) for _, sizes in tensor.chunks)
        if covered != math.prod(tensor.shape):
            raise CheckpointCorruptError(
                f"tensor {fqn!r} of {info.path}: chunks cover {covered} of "
                f"{math.prod(tensor.shape)} elements"
            )
    for fqn in info.objects:
        if fqn not in metadata.state_dict_metadata:
            raise CheckpointCorruptError(f"{where} does not describe object {fqn!r}")
    for index, storage in (metadata.storage_data or {}).items():
        recorded = info.files.get(storage.relative_path)
        if recorded is None:
            raise CheckpointCorruptError(
                f"{info.path / storage.relative_path} holds {index.fqn!r} but is not listed in "
                f"the checkpoint's metadata"
            )
        if storage.offset + storage.length > recorded.size:
            raise CheckpointCorruptError(
                f"{info.path / storage.relative_path} is too short for {index.fqn!r}"
            )
    return info
