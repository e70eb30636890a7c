"""``save`` and ``load``: sharded, resharding, atomic, optionally asynchronous checkpoints."""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mcore_ckpt import errors as errors_module
from mcore_ckpt._dist import Communicator
from mcore_ckpt.async_save import AsyncSave, drain_pending, stage_blocks, stage_objects
from mcore_ckpt.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointTypeError,
    CheckpointWriteError,
)
from mcore_ckpt.format import (
    FORMAT_VERSION,
    CheckpointInfo,
    FileInfo,
    TensorInfo,
    package_versions,
    read_checkpoint_info,
    write_checkpoint_info,
)
from mcore_ckpt.layout import (
    apply_retention,
    checkpoint_name,
    commit,
    committed_checkpoints,
    new_temporary_dir,
    remove_leftovers,
    resolve_checkpoint_dir,
)
from mcore_ckpt.planner import Block, BlockLoadPlanner, BlockSavePlanner, RemapFileSystemReader
from mcore_ckpt.state_dict import Entry, flatten_state_dict, sync_params
from mcore_ckpt.verify import check_file_checksums, check_file_sizes, checksum_files
from mcore_parallel.state import ParallelState

__all__ = ["save", "load"]

_LAYOUT_FIELDS = ("tp", "pp", "cp", "ep", "dp")


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # Single-process use is intended; DCP warns about it on every call.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _first_failure(error: BaseException) -> BaseException:
    """The exception of the first failing rank inside DCP's wrapper, or ``error`` itself."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _run_dcp(
    call: Callable[..., object], comm: Communicator, **storage: Any
) -> tuple[BaseException, BaseException] | None:
    """Runs ``dcp.save`` or ``dcp.load`` over the communicator's group.

    Args:
        call: ``dcp.save`` or ``dcp.load``.
        comm: The communicator whose group runs the call.
        **storage: The storage writer or reader and the planner.

    Returns:
        None on success, else ``(caught, cause)``: the exception DCP raised and the first
        failing rank's exception inside it, for the caller to wrap.

    Raises:
        CheckpointError: The cause of the failure, when it is one of this package's errors.
    """
    try:
        with _quiet_single_process():
            call({}, process_group=comm.group, no_dist=not comm.distributed, **storage)
    except (Exception, CheckpointException) as caught:
        cause = _first_failure(caught)
        if isinstance(cause, CheckpointError):
            raise cause from caught
        return caught, cause
    return None


def _check_optional_int(name: str, value: Any, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointConfigError(f"{name}={value!r} must be None or an integer >= {minimum}")


def _check_path_and_flag(path: Any, flag_name: str, flag: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointTypeError(f"path={path!r} must be a str or os.PathLike")
    if not isinstance(flag, bool):
        raise CheckpointTypeError(f"{flag_name}={flag!r} must be a bool")


def _layout(state: Any, comm: Communicator) -> dict[str, int]:
    layout = {"world_size": comm.world_size}
    if isinstance(state, ParallelState):
        layout.update({dim: state.size(dim) for dim in _LAYOUT_FIELDS})
    return layout


def _raise_agreed(comm: Communicator, error: BaseException | None) -> None:
    """Raises on every rank when any rank failed, so that no rank hangs in a collective."""
    reports = comm.all_gather(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            name, message = report
            cls = getattr(errors_module, name, None)
            if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
                cls = CheckpointError
            raise cls(f"rank {rank}: {message}")


def _split_entries(entries: dict[str, Entry]) -> tuple[dict[str, Block], dict[str, Any]]:
    blocks = {
        e.fqn: Block(e.local, e.global_shape, e.global_offset)
        for e in entries.values()
        if e.is_tensor and not e.is_replica and not e.is_empty_block
    }
    objects = {e.fqn: e.value for e in entries.values() if not e.is_tensor}
    return blocks, objects


def save(
    path: str | os.PathLike[str],
    state_dict: dict[str, Any],
    *,
    state: Any = None,
    async_save: bool = False,
    keep_last: int | None = None,
    step: int | None = None,
    io_threads: int = 1,
) -> Path | AsyncSave:
    """Saves a state dict as a new checkpoint under the root ``path``.

    Every rank of the default process group calls it with its own blocks (or a single process
    calls it without torch.distributed). Tensors are written whole, or as this rank's block
    when given as :class:`~mcore_parallel.sharding.ShardedTensor` (blocks with a positive
    ``replica_id`` are skipped). Other leaves are pickled once (they must be equal on every
    rank). Values with a ``start_param_sync`` method (a distributed optimizer overlapping its
    parameter all-gather) are synced first with ``force_sync=True``; values with a
    ``sharded_state_dict`` method are saved as the dict it returns, other ``nn.Module`` values
    as :func:`mcore_parallel.checkpointing.sharded_state_dict` over ``state``.

    The checkpoint is written into a temporary directory, flushed, renamed to
    ``path/step_<n>`` and then named by ``path/latest``; a crash at any moment leaves the
    previous checkpoint loadable.

    Args:
        path: The checkpoint root; created if missing.
        state_dict: Nested dicts and lists of tensors, sharded tensors and objects.
        state: The :class:`~mcore_parallel.ParallelState` of the caller, recorded as the
            layout and used to shard ``nn.Module`` values; None for a single process or
            modules held whole.
        async_save: Stage to host memory, return an :class:`AsyncSave` handle at once and write
            in a background thread.
        keep_last: After committing, delete all but this many newest checkpoints.
        step: Step number of the new checkpoint; default one past the newest committed one.
        io_threads: Writer threads per rank.

    Returns:
        The committed checkpoint directory, or the :class:`AsyncSave` handle when
        ``async_save``.

    Raises:
        CheckpointConfigError: If ``keep_last``, ``step`` or ``io_threads`` is out of range.
        CheckpointTypeError: If ``path`` is not a str or path, ``async_save`` not a bool, or
            ``state_dict`` not a dict of the supported containers.
        CheckpointExistsError: If the checkpoint of ``step`` already exists.
        CheckpointWriteError: If writing failed (the previous checkpoint is untouched).
        AsyncSaveError: If an earlier asynchronous save of this process failed unnoticed.
    """
    _check_optional_int("keep_last", keep_last, 1)
    _check_optional_int("step", step, 0)
    _check_optional_int("io_threads", io_threads, 1)
    _check_path_and_flag(path, "async_save", async_save)
    drain_pending()
    root = Path(path)
    comm = Communicator()
    error: BaseException | None = None
    blocks: dict[str, Block] = {}
    objects: dict[str, Any] = {}
    try:
        sync_params(state_dict)
        entries, _ = flatten_state_dict(state_dict, state)
        blocks, objects = _split_entries(entries)
    except Exception as caught:  # every rank must learn of it, or the others would hang
        error = caught
    _raise_agreed(comm, error)

    target: tuple[str, str] | None = None
    if comm.is_coordinator:
        try:
            target = _prepare_root(root, step)
        except Exception as caught:
            error = caught
    _raise_agreed(comm, error)
    name, temporary = comm.broadcast(target)
    layout = _layout(state, comm)

    def work() -> Path:
        return _write_and_commit(
            comm, root, name, Path(temporary), blocks, objects, layout, keep_last, io_threads
        )

    if not async_save:
        return work()
    blocks = stage_blocks(root, blocks)
    objects = stage_objects(objects)
    return AsyncSave(root / name, work)


def _prepare_root(root: Path, step: int | None) -> tuple[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root)
    existing = committed_checkpoints(root)
    if step is None:
        step = existing[-1][0] + 1 if existing else 0
    name = checkpoint_name(step)
    if (root / name).exists():
        raise CheckpointExistsError(f"step={step}: checkpoint {root / name} already exists")
    temporary = new_temporary_dir(root, name)
    temporary.mkdir()
    return name, str(temporary)


def _storage_info(metadata: Metadata) -> tuple[dict[str, TensorInfo], tuple[str, ...]]:
    tensors: dict[str, TensorInfo] = {}
    objects = []
    for fqn, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            tensors[fqn] = TensorInfo(
                shape=tuple(item.size),
                dtype=str(item.properties.dtype).removeprefix("torch."),
                chunks=tuple(
                    (tuple(c.offsets), tuple(c.sizes))
                    for c in sorted(item.chunks, key=lambda c: tuple(c.offsets))
                ),
            )
        else:
            objects.append(fqn)
    return tensors, tuple(objects)


def _write_and_commit(
    comm: Communicator,
    root: Path,
    name: str,
    temporary: Path,
    blocks: dict[str, Block],
    objects: dict[str, Any],
    layout: dict[str, int],
    keep_last: int | None,
    io_threads: int,
) -> Path:
    planner = BlockSavePlanner(blocks, objects)
    writer = FileSystemWriter(
        temporary, single_file_per_rank=True, sync_files=True, thread_count=io_threads
    )
    failure = _run_dcp(dcp.save, comm, storage_writer=writer, planner=planner)
    if failure is not None:
        dcp_error, cause = failure
        raise CheckpointWriteError(f"writing {temporary} failed: {_describe(cause)}") from dcp_error

    report: tuple[dict[str, FileInfo] | None, str | None]
    try:
        files = sorted(p for p in temporary.iterdir() if p.is_file())
        report = (checksum_files(files[comm.rank :: comm.world_size]), None)
    except Exception as caught:  # every rank must learn of it, or the others would hang
        report = (None, f"checksumming {temporary} failed: {caught}")
    reports = comm.all_gather(report)
    for rank, (_, message) in enumerate(reports):
        if message is not None:
            raise CheckpointWriteError(f"rank {rank}: {message}")

    error: BaseException | None = None
    final = root / name
    if comm.is_coordinator:
        try:
            tensors, object_names = _storage_info(planner.metadata)
            files_info = {
                file_name: file_info
                for part, _ in reports
                for file_name, file_info in (part or {}).items()
            }
            write_checkpoint_info(
                CheckpointInfo(
                    path=temporary,
                    format_version=FORMAT_VERSION,
                    name=name,
                    step=int(name.split("_")[1]),
                    created_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    versions=package_versions(),
                    layout=layout,
                    tensors=tensors,
                    objects=object_names,
                    files=files_info,
                )
            )
            commit(temporary, root, name)
        except Exception as caught:
            error = CheckpointWriteError(f"committing {temporary} as {final} failed: {caught}")
        if error is None and keep_last is not None:
            try:
                apply_retention(root, keep_last)
            except OSError as caught:
                # The new checkpoint is committed; failing the save would misreport it.
                warnings.warn(
                    f"keep_last={keep_last}: deleting old checkpoints of {root} failed: {caught}",
                    RuntimeWarning,
                    stacklevel=2,
                )
    _raise_agreed(comm, error)
    return final


def load(
    path: str | os.PathLike[str],
    state_dict: dict[str, Any],
    *,
    state: Any = None,
    verify: bool = False,
) -> CheckpointInfo:
    """Loads a checkpoint into ``state_dict`` in place, resharding to its blocks.

    Every tensor leaf is filled in place: a whole tensor with the whole stored tensor, a
    :class:`~mcore_parallel.sharding.ShardedTensor` with its block of the global tensor,
    whatever layout saved it. Other leaves are replaced by the stored objects. Values with a
    ``sharded_state_dict`` method receive the filled dict through ``load_sharded_state_dict``.
    Keys of the checkpoint absent from ``state_dict`` are not read.

    Args:
        path: A checkpoint directory, or a root whose ``latest`` marker names one.
        state_dict: The structure to fill, shaped like the one saved (any layout).
        state: The caller's :class:`~mcore_parallel.ParallelState`, over which ``nn.Module``
            values are sharded; None loads modules whole. All ranks of the default group take
            part either way.
        verify: Also check the CRC-32 of every file before reading.

    Returns:
        The loaded checkpoint's metadata.

    Raises:
        CheckpointNotFoundError: If ``path`` holds no committed checkpoint.
        CheckpointVersionError: If the format version cannot be read by this release.
        CheckpointCorruptError: If a file is missing, truncated or altered (named).
        CheckpointMismatchError: If a key is missing from the checkpoint or its kind or global
            shape differs.
        CheckpointTypeError: If ``path`` is not a str or path or ``verify`` not a bool.
        AsyncSaveError: If an earlier asynchronous save of this process failed unnoticed.
    """
    _check_path_and_flag(path, "verify", verify)
    drain_pending()
    comm = Communicator()
    error: BaseException | None = None
    try:
        directory = resolve_checkpoint_dir(path)
        info = read_checkpoint_info(directory)
        if verify:
            names = sorted(info.files)[comm.rank :: comm.world_size]
            check_file_checksums(info, names)
        else:
            check_file_sizes(info)
        entries, expanded = flatten_state_dict(state_dict, state)
        blocks, object_names = _match(entries, info)
        reader = RemapFileSystemReader(directory)
        reader.read_metadata()
    except Exception as caught:  # every rank must learn of it, or the others would hang
        error = caught
    _raise_agreed(comm, error)

    planner = BlockLoadPlanner(blocks, object_names)
    failure = _run_dcp(dcp.load, comm, storage_reader=reader, planner=planner)
    if failure is not None:
        dcp_error, cause = failure
        try:
            check_file_checksums(info)
        except CheckpointCorruptError as culprit:
            raise CheckpointCorruptError(
                f"{culprit} (loading failed: {_describe(cause)})"
            ) from dcp_error
        raise CheckpointCorruptError(
            f"loading {directory} failed: {_describe(cause)}"
        ) from dcp_error
    for fqn in object_names:
        entry = entries[fqn]
        entry.container[entry.key] = planner.loaded_objects[fqn]
    for owner, sub_state_dict in expanded:
        if callable(getattr(owner, "load_sharded_state_dict", None)):
            owner.load_sharded_state_dict(sub_state_dict)
    return info


def _match(entries: dict[str, Entry], info: CheckpointInfo) -> tuple[dict[str, Block], list[str]]:
    missing = [f for f in entries if f not in info.tensors and f not in info.objects]
    if missing:
        stored = sorted([*info.tensors, *info.objects])
        raise CheckpointMismatchError(
            f"state_dict keys {missing[:5]} are not in the checkpoint {info.path} "
            f"(it holds {len(stored)} keys, e.g. {stored[:5]})"
        )
    blocks: dict[str, Block] = {}
    objects: list[str] = []
    for fqn, entry in entries.items():
        stored_tensor = info.tensors.get(fqn)
        if entry.is_tensor != (stored_tensor is not None):
            held = "a tensor" if stored_tensor is not None else "a Python object"
            raise CheckpointMismatchError(
                f"state_dict[{fqn!r}] is a {type(entry.value).__name__}, but the checkpoint "
                f"{info.path} holds {held} there"
            )
        if stored_tensor is None:
            objects.append(fqn)
            continue
        if tuple(entry.global_shape) != stored_tensor.shape:
            raise CheckpointMismatchError(
                f"state_dict[{fqn!r}] has global shape {tuple(entry.global_shape)}, the "
                f"checkpoint {info.path} holds shape {stored_tensor.shape}"
            )
        if not entry.is_empty_block:
            blocks[fqn] = Block(entry.local, tuple(entry.global_shape), tuple(entry.global_offset))
    return blocks, objects
