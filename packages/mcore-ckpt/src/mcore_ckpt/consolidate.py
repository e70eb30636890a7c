"""A checkpoint as one flat dict of full tensors, for export and for tools without the model."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch

from mcore_ckpt.api import load
from mcore_ckpt.errors import CheckpointWriteError
from mcore_ckpt.format import read_checkpoint_info
from mcore_ckpt.layout import resolve_checkpoint_dir

__all__ = ["load_consolidated", "convert_to_torch_file"]


def load_consolidated(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Loads every tensor of a checkpoint in full, and every object, without a template.

    Every rank of the default process group must call it (or one process without
    torch.distributed); each gets the whole content, so mind host memory.

    Args:
        path: A checkpoint directory or a root with a ``latest`` marker.

    Returns:
        Dotted path (``"model.layers.0.weight"``) to the full CPU tensor or the object.

    Raises:
        CheckpointNotFoundError: If ``path`` holds no committed checkpoint.
        CheckpointVersionError: If the format version cannot be read.
        CheckpointCorruptError: If a file is missing, truncated or altered.
    """
    info = read_checkpoint_info(resolve_checkpoint_dir(path))
    flat: dict[str, Any] = {
        fqn: torch.empty(tensor.shape, dtype=tensor.torch_dtype)
        for fqn, tensor in info.tensors.items()
    }
    flat.update(dict.fromkeys(info.objects))
    load(info.path, flat)
    return flat


def convert_to_torch_file(path: str | os.PathLike[str], output: str | os.PathLike[str]) -> Path:
    """Writes a checkpoint as one ``torch.save`` file of :func:`load_consolidated`'s dict.

    The file is written next to ``output`` under a temporary name, flushed and renamed, so an
    interrupted conversion never leaves a partial ``output``.

    Args:
        path: A checkpoint directory or a root with a ``latest`` marker.
        output: The file to write.

    Returns:
        The written file.

    Raises:
        CheckpointNotFoundError: If ``path`` holds no committed checkpoint.
        CheckpointCorruptError: If a file of the checkpoint is damaged.
        CheckpointWriteError: If ``output`` cannot be written (missing directory, a directory
            in its place, no space); an existing ``output`` is left as it was.
    """
    target = Path(output)
    flat = load_consolidated(path)
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(temporary, "wb") as stream:
            torch.save(flat, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except OSError as error:
        raise CheckpointWriteError(
            f"output={str(target)!r} could not be written: {error}"
        ) from error
    finally:
        temporary.unlink(missing_ok=True)
    return target
