"""Pipeline parallelism: microbatch schedules and stage-to-stage communication."""

from mcore_parallel.pipeline.p2p import PipelineChannel
from mcore_parallel.pipeline.schedules import ScheduleOutput, default_forward_step, forward_backward
from mcore_parallel.pipeline.tied import allreduce_tied_embedding_grads

__all__ = [
    "forward_backward",
    "ScheduleOutput",
    "default_forward_step",
    "PipelineChannel",
    "allreduce_tied_embedding_grads",
]
