"""Worker groups behind one interface: in this process (or torchrun) and Ray actors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mcore_rl.config import GRPOConfig
from mcore_rl.distributed import backend_for, init_worker_state
from mcore_rl.worker import GRPOWorker, PhaseCallback

__all__ = ["WorkerGroup", "InProcessWorkers", "RayWorkerGroup", "make_workers"]


class WorkerGroup(Protocol):
    """What the driver loop needs from its workers."""

    is_main: bool
    """Whether this process writes files and prints (rank 0, or the Ray driver)."""

    def step(self, step: int, on_phase: PhaseCallback | None = None) -> dict[str, float]:
        """Runs one GRPO step on every rank and returns rank 0's metrics."""
        ...

    def save_checkpoint(self, root: Path, step: int) -> None:
        """Saves a checkpoint of every rank."""
        ...

    def load_checkpoint(self, root: Path) -> int:
        """Loads the latest checkpoint on every rank and returns its step count."""
        ...

    def close(self) -> None:
        """Releases the workers."""
        ...


class InProcessWorkers:
    """This process is one rank (a world of one, or one rank of torchrun).

    Args:
        config: The run config.

    Raises:
        RLError: If the worker cannot be built (unknown task or model, ...); a process group
            this object created is destroyed first, so the process can start another run.
    """

    def __init__(self, config: GRPOConfig) -> None:
        self._owns_group = not dist.is_initialized()
        # The worker sets torch's process-wide thread count (cpu_threads); close() restores it.
        self._num_threads = torch.get_num_threads()
        self.state = init_worker_state(config)
        try:
            self.worker = GRPOWorker(config, self.state)
        except BaseException:
            self.close()
            raise
        self.is_main = dist.get_rank() == 0

    def step(self, step: int, on_phase: PhaseCallback | None = None) -> dict[str, float]:
        """Runs one step.

        Args:
            step: Step number.
            on_phase: Phase callback.

        Returns:
            The metrics.
        """
        return self.worker.step(step, on_phase)

    def save_checkpoint(self, root: Path, step: int) -> None:
        """Saves a checkpoint.

        Args:
            root: Checkpoint root.
            step: Completed steps.
        """
        self.worker.save_checkpoint(root, step)

    def load_checkpoint(self, root: Path) -> int:
        """Loads the latest checkpoint.

        Args:
            root: Checkpoint root.

        Returns:
            Completed steps.
        """
        return self.worker.load_checkpoint(root)

    def close(self) -> None:
        """Restores torch's thread count and destroys the process group if this object made it."""
        torch.set_num_threads(self._num_threads)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


class _Actor:
    """A Ray actor holding one rank's :class:`GRPOWorker`."""

    def address(self) -> tuple[str, int]:
        import ray

        from mcore_rl.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, config: dict[str, Any], rank: int, world_size: int, addr: str, port: int):
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0",
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
        )
        self.config = GRPOConfig(**config)
        self.state = init_worker_state(self.config)
        self.worker = GRPOWorker(self.config, self.state)
        return os.getpid()

    def step(self, step: int) -> dict[str, float]:
        return self.worker.step(step)

    def save_checkpoint(self, root: str, step: int) -> None:
        self.worker.save_checkpoint(root, step)

    def load_checkpoint(self, root: str) -> int:
        return self.worker.load_checkpoint(root)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RayWorkerGroup:
    """``config.num_workers`` Ray actors in one placement group, torch.distributed among them.

    Generation and training are colocated: each actor generates its share of the rollouts
    and trains on its bins. Ray is started locally when not initialised.

    Args:
        config: The run config.

    Raises:
        RLError: If the workers cannot be built (raised from inside an actor); the actors and
            the placement group are released first.
    """

    is_main = True

    def __init__(self, config: GRPOConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray: Any = ray
        self._remove_placement_group = remove_placement_group
        if not ray.is_initialized():
            ray.init(num_cpus=max(2, config.num_workers), include_dashboard=False)
        gpus = 1 if backend_for(config) == "nccl" else 0
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        self.placement_group = placement_group([bundle] * config.num_workers, strategy="PACK")
        self.actors: list[Any] = []
        try:
            ray.get(self.placement_group.ready())
            actor_class = ray.remote(_Actor)
            self.actors = [
                actor_class.options(
                    num_cpus=1,
                    num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group, placement_group_bundle_index=rank
                    ),
                ).remote()
                for rank in range(config.num_workers)
            ]
            addr, port = ray.get(self.actors[0].address.remote())
            fields = config.to_dict()
            self.pids = ray.get(
                [
                    actor.setup.remote(fields, rank, config.num_workers, addr, port)
                    for rank, actor in enumerate(self.actors)
                ]
            )
        except BaseException:
            # A failed setup (unknown task or model ...) must not leave actors holding the
            # placement group's resources in a driver that goes on.
            self._release()
            raise

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def step(self, step: int, on_phase: PhaseCallback | None = None) -> dict[str, float]:
        """Runs one step on every actor.

        Args:
            step: Step number.
            on_phase: Called once with ``"step"`` (phases run inside the actors).

        Returns:
            Rank 0's metrics.
        """
        if on_phase is not None:
            on_phase("step")
        return self._all("step", step)[0]

    def save_checkpoint(self, root: Path, step: int) -> None:
        """Saves a checkpoint on every actor.

        Args:
            root: Checkpoint root.
            step: Completed steps.
        """
        self._all("save_checkpoint", str(root), step)

    def load_checkpoint(self, root: Path) -> int:
        """Loads the latest checkpoint on every actor.

        Args:
            root: Checkpoint root.

        Returns:
            Completed steps.
        """
        return int(self._all("load_checkpoint", str(root))[0])

    def close(self) -> None:
        """Tears down the process group, the actors and the placement group."""
        try:
            self._all("shutdown")
        finally:
            self._release()

    def _release(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)
        self._remove_placement_group(self.placement_group)


def make_workers(config: GRPOConfig) -> WorkerGroup:
    """Builds the worker group of the config's mode.

    Args:
        config: The run config.

    Returns:
        The workers.
    """
    if config.mode == "ray":
        return RayWorkerGroup(config)
    return InProcessWorkers(config)
