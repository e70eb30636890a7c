"""mcore-parallel: model and data parallelism on real torch.distributed process groups."""

from mcore_parallel._version import __version__
from mcore_parallel.errors import ParallelConfigError, ParallelError, ParallelStateError

__all__ = [
    "__version__",
    "ParallelError",
    "ParallelConfigError",
    "ParallelStateError",
]
