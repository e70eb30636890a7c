"""mcore-models: GPT and MoE models in plain torch, parallelized with mcore-parallel."""

from mcore_models._version import __version__
from mcore_models.errors import (
    AttentionBackendError,
    CheckpointFormatError,
    ModelConfigError,
    ModelError,
)

__all__ = [
    "__version__",
    "ModelError",
    "ModelConfigError",
    "CheckpointFormatError",
    "AttentionBackendError",
]
