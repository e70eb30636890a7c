"""The directory layout of a checkpoint root and its crash-safe commit protocol.

A root holds committed checkpoints ``step_<n>/``, a ``latest`` marker naming the newest one, and
possibly leftovers of interrupted saves (``.tmp-*``) or deletions (``.trash-*``). A save writes
into a ``.tmp-`` directory, flushes every file, renames the directory into place (atomic on
POSIX) and then replaces ``latest`` (write, flush, atomic rename). A crash at any moment leaves
either the previous state or the new one; leftovers are removed by the next save.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from mcore_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from mcore_ckpt.format import METADATA_FILE

__all__ = [
    "LATEST_FILE",
    "checkpoint_name",
    "committed_checkpoints",
    "resolve_checkpoint_dir",
    "read_latest",
    "new_temporary_dir",
    "remove_leftovers",
    "commit",
    "apply_retention",
    "fsync_dir",
]

LATEST_FILE = "latest"
_NAME = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def checkpoint_name(step: int) -> str:
    """Name of the directory of the checkpoint of ``step``.

    Args:
        step: Non-negative step number.

    Returns:
        ``"step_"`` followed by the zero-padded step.
    """
    return f"step_{step:09d}"


def fsync_dir(path: Path) -> None:
    """Flushes a directory's entries (creations, renames) to disk.

    Args:
        path: The directory.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Lists the committed checkpoints of a root, oldest first.

    Args:
        root: The checkpoint root.

    Returns:
        ``(step, directory)`` of every ``step_<n>`` directory holding a metadata file.
    """
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / METADATA_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def read_latest(root: Path) -> str | None:
    """Reads the ``latest`` marker of a root.

    Args:
        root: The checkpoint root.

    Returns:
        The name it holds, or None if there is no marker.

    Raises:
        CheckpointCorruptError: If the marker does not hold a checkpoint name.
    """
    marker = root / LATEST_FILE
    if not marker.is_file():
        return None
    name = marker.read_text(encoding="utf-8").strip()
    if not _NAME.match(name):
        raise CheckpointCorruptError(f"{marker} holds {name!r}, expected a name like 'step_<n>'")
    return name


def resolve_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """Finds the checkpoint directory that ``path`` designates.

    Args:
        path: A checkpoint directory, or a root: its ``latest`` marker names the checkpoint;
            without a marker (a crash right after the first commit) the newest committed one.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointNotFoundError: If ``path`` is neither a checkpoint nor a root with a committed
            checkpoint.
        CheckpointCorruptError: If ``latest`` names a directory that is not committed.
    """
    directory = Path(path)
    if (directory / METADATA_FILE).is_file():
        return directory
    name = read_latest(directory)
    if name is None:
        committed = committed_checkpoints(directory)
        if committed:
            return committed[-1][1]
        raise CheckpointNotFoundError(
            f"path={str(directory)!r} holds no committed checkpoint: neither {METADATA_FILE} "
            f"nor a {LATEST_FILE!r} marker nor a committed step_<n> directory"
        )
    target = directory / name
    if not (target / METADATA_FILE).is_file():
        raise CheckpointCorruptError(
            f"{directory / LATEST_FILE} names {name!r}, but {target / METADATA_FILE} is missing"
        )
    return target


def new_temporary_dir(root: Path, name: str) -> Path:
    """Returns a fresh path (not yet created) to write the checkpoint ``name`` into.

    Args:
        root: The checkpoint root.
        name: Final name of the checkpoint.

    Returns:
        A hidden path inside ``root``, unique to this save.
    """
    return root / f"{_TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}"


def remove_leftovers(root: Path) -> list[Path]:
    """Removes directories of interrupted saves and deletions.

    Only call this when no save into ``root`` is in flight.

    Args:
        root: The checkpoint root.

    Returns:
        The removed paths.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if not child.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        removed.append(child)
    return removed


def commit(temporary: Path, root: Path, name: str) -> Path:
    """Moves a fully written checkpoint into place and points ``latest`` at it.

    Every file inside ``temporary`` must already be flushed to disk.

    Args:
        temporary: The directory the checkpoint was written into.
        root: The checkpoint root.
        name: Final name of the checkpoint.

    Returns:
        The committed checkpoint directory.
    """
    final = root / name
    fsync_dir(temporary)
    os.rename(temporary, final)
    fsync_dir(root)
    marker_tmp = root / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:12]}"
    with open(marker_tmp, "w", encoding="utf-8") as stream:
        stream.write(name + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(marker_tmp, root / LATEST_FILE)
    fsync_dir(root)
    return final


def apply_retention(root: Path, keep_last: int) -> list[Path]:
    """Deletes all but the ``keep_last`` newest committed checkpoints.

    The checkpoint ``latest`` names is never deleted. Each victim is first renamed to a
    ``.trash-`` path, so a crash mid-deletion never leaves a half-deleted checkpoint that looks
    committed.

    Args:
        root: The checkpoint root.
        keep_last: How many of the newest checkpoints to keep (at least 1).

    Returns:
        The deleted checkpoint directories.
    """
    latest = read_latest(root)
    checkpoints = committed_checkpoints(root)
    victims = [
        d for _, d in checkpoints[: max(0, len(checkpoints) - keep_last)] if d.name != latest
    ]
    for victim in victims:
        trash = root / f"{_TRASH_PREFIX}{victim.name}-{uuid.uuid4().hex[:12]}"
        os.rename(victim, trash)
        fsync_dir(root)
        shutil.rmtree(trash, ignore_errors=True)
    return victims
