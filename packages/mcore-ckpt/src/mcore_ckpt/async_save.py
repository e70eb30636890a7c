"""Background saves: staging to host memory, the handle returned to the caller, and errors.

An asynchronous save copies every tensor it writes into host buffers (page-locked when the
source is on a GPU, so the copy runs at full PCIe speed) and deep-copies the Python objects
before returning; later changes to the live tensors therefore never reach the checkpoint. A
thread then writes and commits. Its error is raised by :meth:`AsyncSave.wait` and, if nobody
waited, by the next :func:`~mcore_ckpt.save` or :func:`~mcore_ckpt.load` of this process.

Staging buffers are kept per checkpoint root and tensor path and reused by the next save with
the same shapes, since allocating page-locked memory costs far more than copying into it;
:func:`release_staging_buffers` frees them.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mcore_ckpt.errors import AsyncSaveError
from mcore_ckpt.planner import Block

__all__ = ["AsyncSave", "stage_blocks", "stage_objects", "release_staging_buffers", "drain_pending"]

_LOCK = threading.Lock()
_PENDING: list[AsyncSave] = []
_BUFFERS: dict[tuple[str, str], torch.Tensor] = {}


class AsyncSave:
    """Handle of a save running in the background.

    Args:
        path: The checkpoint directory the save commits to.
        work: The function that writes and commits; returns the committed directory.
    """

    def __init__(self, path: Path, work: Callable[[], Path]) -> None:
        self.path = path
        self._work = work
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mcore-ckpt-async-save")
        with _LOCK:
            _PENDING.append(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as error:  # surfaced to the caller by wait() or the next call
            self._error = error

    def done(self) -> bool:
        """Whether the background save has finished (successfully or not).

        Returns:
            True once writing and committing are over.
        """
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Blocks until the save is committed.

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            The committed checkpoint directory.

        Raises:
            AsyncSaveError: If the save failed (its cause is chained).
            TimeoutError: If ``timeout`` passed first; the save goes on.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save of {self.path} is still running")
        with _LOCK:
            if self in _PENDING:
                _PENDING.remove(self)
        if self._error is not None:
            raise AsyncSaveError(
                f"the asynchronous save of {self.path} failed: {self._error}"
            ) from self._error
        return self.path


def drain_pending() -> None:
    """Waits for this process's background saves; raises the first unreported failure.

    Raises:
        AsyncSaveError: If a background save failed and its handle's ``wait()`` did not
            already raise it.
    """
    with _LOCK:
        pending = list(_PENDING)
    first: AsyncSaveError | None = None
    for handle in pending:
        try:
            handle.wait()
        except AsyncSaveError as error:
            if first is None:
                first = error
    if first is not None:
        raise first


def stage_blocks(root: Path, blocks: dict[str, Block]) -> dict[str, Block]:
    """Copies every block into host buffers owned by the checkpoint machinery.

    Args:
        root: The checkpoint root (buffers are reused per root and path).
        blocks: The blocks to write.

    Returns:
        Blocks over the staged copies.
    """
    staged: dict[str, Block] = {}
    copied_from_cuda = False
    for fqn, block in blocks.items():
        source = block.tensor.detach()
        key = (str(root), fqn)
        with _LOCK:
            buffer = _BUFFERS.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
            with _LOCK:
                _BUFFERS[key] = buffer
        buffer.copy_(source, non_blocking=source.is_cuda)
        copied_from_cuda = copied_from_cuda or source.is_cuda
        staged[fqn] = Block(buffer, block.global_shape, block.offset)
    if copied_from_cuda:
        torch.cuda.synchronize()
    return staged


def stage_objects(objects: dict[str, Any]) -> dict[str, Any]:
    """Deep-copies the Python objects to write, so later mutations do not reach the save.

    Args:
        objects: Objects by path.

    Returns:
        The copies by path.
    """
    return {fqn: copy.deepcopy(value) for fqn, value in objects.items()}


def release_staging_buffers(root: str | Path | None = None) -> None:
    """Frees the host buffers kept for asynchronous saves.

    Args:
        root: Only free those of this checkpoint root; all when None.
    """
    with _LOCK:
        for key in [k for k in _BUFFERS if root is None or k[0] == str(Path(root))]:
            del _BUFFERS[key]
