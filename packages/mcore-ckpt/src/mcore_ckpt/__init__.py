"""mcore-ckpt: sharded, resharding, atomic, async checkpoints with a versioned format."""

from mcore_ckpt._version import __version__
from mcore_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)

__all__ = [
    "__version__",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointVersionError",
]
