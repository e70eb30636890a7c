"""mcore-parallel: model and data parallelism on real torch.distributed process groups."""

from mcore_parallel._version import __version__
from mcore_parallel.errors import (
    DistributedRunError,
    DistributedTimeoutError,
    ParallelConfigError,
    ParallelError,
    ParallelStateError,
    ParallelTypeError,
)
from mcore_parallel.state import ParallelState, initialize

__all__ = [
    "__version__",
    "ParallelError",
    "ParallelConfigError",
    "ParallelStateError",
    "ParallelTypeError",
    "DistributedRunError",
    "DistributedTimeoutError",
    "ParallelState",
    "initialize",
]
