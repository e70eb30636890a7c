"""Data parallelism: DDP with bucketed overlapped reduction, a ZeRO-1 distributed optimizer with
overlapped parameter all-gather, CPU offload, sharded optimizer state dicts and FSDP2.
"""

from mcore_parallel.distributed.config import DDPConfig, OptimizerConfig, default_bucket_size
from mcore_parallel.distributed.ddp import DistributedDataParallel
from mcore_parallel.distributed.fsdp import (
    build_fsdp_mesh,
    fully_shard_model,
    fully_shard_optimizer,
    is_fsdp_param,
)
from mcore_parallel.distributed.hooks import ParamSyncHooks
from mcore_parallel.distributed.optimizer import DistributedOptimizer

__all__ = [
    "DDPConfig",
    "OptimizerConfig",
    "default_bucket_size",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "ParamSyncHooks",
    "build_fsdp_mesh",
    "fully_shard_model",
    "fully_shard_optimizer",
    "is_fsdp_param",
]
