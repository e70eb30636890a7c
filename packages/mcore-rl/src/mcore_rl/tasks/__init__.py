"""Procedural, seeded, verifiable tasks with rewards in [0, 1], and the task registry."""

from mcore_rl.tasks.arithmetic import ArithmeticTask
from mcore_rl.tasks.base import (
    FunctionTask,
    Problem,
    Task,
    available_tasks,
    get_task,
    register_task,
    sample_problems,
)
from mcore_rl.tasks.countdown import CountdownTask
from mcore_rl.tasks.dataset import DatasetTask
from mcore_rl.tasks.sequences import ReverseTask, SortTask

__all__ = [
    "Problem",
    "Task",
    "FunctionTask",
    "ArithmeticTask",
    "CountdownTask",
    "DatasetTask",
    "SortTask",
    "ReverseTask",
    "register_task",
    "get_task",
    "available_tasks",
    "sample_problems",
]

register_task("arithmetic", ArithmeticTask)
register_task("countdown", CountdownTask)
register_task("sort", SortTask)
register_task("reverse", ReverseTask)
