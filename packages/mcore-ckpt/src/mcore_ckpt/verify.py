"""Checks that a checkpoint's files are all present, complete and intact.

Sizes are checked before every load (cheap); CRC-32 checksums, recorded at save, are checked by
``mcore-ckpt validate`` and by ``load(..., verify=True)``, or to find the culprit after a failed
load.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mcore_ckpt.errors import CheckpointCorruptError
from mcore_ckpt.format import CheckpointInfo

__all__ = ["file_crc32", "checksum_files", "check_file_sizes", "check_file_checksums"]

_READ_BYTES = 16 << 20


def file_crc32(path: Path) -> int:
    """CRC-32 of a file's content.

    Args:
        path: The file.

    Returns:
        The checksum as an unsigned 32-bit integer.
    """
    crc = 0
    with open(path, "rb", buffering=0) as stream:
        buffer = bytearray(_READ_BYTES)
        view = memoryview(buffer)
        while True:
            n = stream.readinto(buffer)
            if not n:
                return crc & 0xFFFFFFFF
            # zlib releases the GIL on large buffers, so several files hash in parallel.
            crc = zlib.crc32(view[:n], crc)


def checksum_files(paths: list[Path], threads: int = 4) -> dict[str, tuple[int, int]]:
    """Sizes and checksums of several files, hashed in parallel threads.

    Args:
        paths: The files.
        threads: Number of hashing threads.

    Returns:
        File name to ``(size, crc32)``.
    """
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths) or 1))) as pool:
        crcs = list(pool.map(file_crc32, paths))
    return {p.name: (p.stat().st_size, crc) for p, crc in zip(paths, crcs)}


def check_file_sizes(info: CheckpointInfo) -> None:
    """Checks that every recorded file exists with its recorded size.

    Args:
        info: The checkpoint's metadata.

    Raises:
        CheckpointCorruptError: Naming the first missing or resized file.
    """
    for name, expected in sorted(info.files.items()):
        target = info.path / name
        try:
            size = os.stat(target).st_size
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{target} is missing: the checkpoint {info.path} lists it ({expected.size} bytes)"
            ) from None
        if size != expected.size:
            state = "truncated" if size < expected.size else "larger than written"
            raise CheckpointCorruptError(
                f"{target} is {state}: {size} bytes, expected {expected.size}"
            )


def check_file_checksums(info: CheckpointInfo, names: list[str] | None = None) -> None:
    """Checks recorded CRC-32 checksums (after the sizes).

    Args:
        info: The checkpoint's metadata.
        names: Files to check; all recorded files when None.

    Raises:
        CheckpointCorruptError: Naming the first missing, resized or altered file.
    """
    check_file_sizes(info)
    selected = sorted(info.files) if names is None else sorted(names)
    found = checksum_files([info.path / n for n in selected])
    for name in selected:
        expected = info.files[name]
        if found[name][1] != expected.crc32:
            raise CheckpointCorruptError(
                f"{info.path / name} is corrupt: CRC-32 {found[name][1]:08x}, expected "
                f"{expected.crc32:08x}"
            )
