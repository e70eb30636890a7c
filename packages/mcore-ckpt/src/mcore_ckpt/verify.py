"""Checks that a checkpoint's files are all present, complete and intact.

Sizes are checked before every load (cheap); CRC-32 checksums of fixed-size segments, recorded
at save, are checked by ``mcore-ckpt validate`` and by ``load(..., verify=True)``, or to find the
culprit after a failed load. Segments hash in parallel threads (zlib releases the GIL on large
buffers), so hashing keeps up with a fast disk.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mcore_ckpt.errors import CheckpointCorruptError
from mcore_ckpt.format import CheckpointInfo, FileInfo

__all__ = [
    "SEGMENT_BYTES",
    "segment_crc32",
    "checksum_files",
    "check_file_sizes",
    "check_file_checksums",
]

SEGMENT_BYTES = 256 << 20
_READ_BYTES = 16 << 20


def _threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def segment_crc32(path: Path, start: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of a file from ``start``.

    Args:
        path: The file.
        start: Offset of the first byte.
        length: Number of bytes (fewer if the file ends first).

    Returns:
        The checksum as an unsigned 32-bit integer.
    """
    crc = 0
    buffer = bytearray(min(_READ_BYTES, max(length, 1)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        stream.seek(start)
        left = length
        while left > 0:
            n = stream.readinto(view[: min(left, len(buffer))])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            left -= n
    return crc & 0xFFFFFFFF


def _segments(size: int) -> list[tuple[int, int]]:
    return [(start, min(SEGMENT_BYTES, size - start)) for start in range(0, size, SEGMENT_BYTES)]


def checksum_files(paths: list[Path]) -> dict[str, FileInfo]:
    """Sizes and segment checksums of several files, hashed in parallel threads.

    Args:
        paths: The files.

    Returns:
        File name to its :class:`~mcore_ckpt.format.FileInfo`.
    """
    sizes = {p: p.stat().st_size for p in paths}
    jobs = [(p, start, length) for p in paths for start, length in _segments(sizes[p])]
    with ThreadPoolExecutor(max_workers=_threads()) as pool:
        crcs = list(pool.map(lambda job: segment_crc32(*job), jobs))
    per_file: dict[Path, list[int]] = {p: [] for p in paths}
    for (path, _, _), crc in zip(jobs, crcs):
        per_file[path].append(crc)
    return {p.name: FileInfo(sizes[p], tuple(per_file[p]), SEGMENT_BYTES) for p in paths}


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
        CheckpointCorruptError: Naming the first missing, resized or altered file and the byte
            range of the damaged segment.
    """
    check_file_sizes(info)
    selected = sorted(info.files) if names is None else sorted(names)
    jobs = [
        (name, start, length)
        for name in selected
        for start, length in _segments_of(info.files[name])
    ]
    with ThreadPoolExecutor(max_workers=_threads()) as pool:
        crcs = list(pool.map(lambda job: segment_crc32(info.path / job[0], job[1], job[2]), jobs))
    index: dict[str, int] = {}
    for (name, start, length), crc in zip(jobs, crcs):
        i = index.get(name, 0)
        index[name] = i + 1
        expected = info.files[name].crc32
        if i >= len(expected) or crc != expected[i]:
            want = f"{expected[i]:08x}" if i < len(expected) else "no checksum"
            raise CheckpointCorruptError(
                f"{info.path / name} is corrupt: CRC-32 {crc:08x} of bytes "
                f"[{start}, {start + length}), expected {want}"
            )


def _segments_of(recorded: FileInfo) -> list[tuple[int, int]]:
    step = recorded.segment_bytes
    return [(start, min(step, recorded.size - start)) for start in range(0, recorded.size, step)]
