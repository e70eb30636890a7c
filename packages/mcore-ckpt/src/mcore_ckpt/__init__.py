"""mcore-ckpt: sharded, resharding, atomic, async checkpoints with a versioned format."""

from mcore_ckpt._version import __version__
from mcore_ckpt.api import load, save
from mcore_ckpt.async_save import AsyncSave, release_staging_buffers
from mcore_ckpt.compat import class_renames, register_class_rename, unregister_class_rename
from mcore_ckpt.consolidate import convert_to_torch_file, load_consolidated
from mcore_ckpt.errors import (
    AsyncSaveError,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTypeError,
    CheckpointVersionError,
    CheckpointWriteError,
)
from mcore_ckpt.format import FORMAT_VERSION, CheckpointInfo, TensorInfo, read_checkpoint_info
from mcore_ckpt.inspection import inspect_checkpoint, validate_checkpoint

__all__ = [
    "__version__",
    "save",
    "load",
    "load_consolidated",
    "convert_to_torch_file",
    "AsyncSave",
    "release_staging_buffers",
    "register_class_rename",
    "unregister_class_rename",
    "class_renames",
    "FORMAT_VERSION",
    "CheckpointInfo",
    "TensorInfo",
    "read_checkpoint_info",
    "inspect_checkpoint",
    "validate_checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointVersionError",
    "CheckpointMismatchError",
    "CheckpointConfigError",
    "CheckpointTypeError",
    "CheckpointExistsError",
    "CheckpointWriteError",
    "AsyncSaveError",
]
