"""Pipeline parallelism: microbatch schedules and stage-to-stage communication."""

from mcore_parallel.pipeline.p2p import PipelineChannel
from mcore_parallel.pipeline.schedules import ScheduleOutput, default_forward_step, forward_backward

__all__ = ["forward_backward", "ScheduleOutput", "default_forward_step", "PipelineChannel"]
