"""mcore-parallel: model and data parallelism on real torch.distributed process groups."""

from mcore_parallel._version import __version__
from mcore_parallel.checkpointing import sharded_state_dict
from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
    build_fsdp_mesh,
    fully_shard_model,
    fully_shard_optimizer,
)
from mcore_parallel.errors import (
    DistributedRunError,
    DistributedTimeoutError,
    GradientNotFiniteError,
    OptimizerStateError,
    ParallelConfigError,
    ParallelError,
    ParallelStateError,
    ParallelTypeError,
)
from mcore_parallel.pipeline import ScheduleOutput, forward_backward
from mcore_parallel.sharding import ShardedTensor
from mcore_parallel.state import ParallelState, initialize
from mcore_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    model_parallel_seed,
)

__all__ = [
    "__version__",
    "ParallelError",
    "ParallelConfigError",
    "ParallelStateError",
    "ParallelTypeError",
    "DistributedRunError",
    "DistributedTimeoutError",
    "OptimizerStateError",
    "GradientNotFiniteError",
    "ParallelState",
    "initialize",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "RNGStatesTracker",
    "model_parallel_seed",
    "forward_backward",
    "ScheduleOutput",
    "sharded_state_dict",
    "ShardedTensor",
    "DDPConfig",
    "OptimizerConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "build_fsdp_mesh",
    "fully_shard_model",
    "fully_shard_optimizer",
]
