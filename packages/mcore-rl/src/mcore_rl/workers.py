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
        """Runs one GRPO step on every rank.

        Args:
            step: Index of the step (0-based).
            on_phase: Called with the name of each phase as it starts, or None.

        Returns:
            Rank 0's metrics of the step.
        """
        ...

    def save_checkpoint(self, root: Path, step: int) -> None:
        """Saves a checkpoint of every rank.

        Args:
            root: The checkpoint root (``<run_dir>/checkpoints``).
            step: Number of completed steps.
        """
        ...

    def load_checkpoint(self, root: Path) -> int:
        """Loads the latest checkpoint on every rank.

        Args:
            root: The checkpoint root.

        Returns:
            Number of completed steps it holds.
        """
        ...

    def evaluate(self) -> dict[str, float]:
        """Greedy evaluation on the held-out prompts.

        Returns:
            Rank 0's evaluation metrics.
        """
        ...

    def export_hf(self, directory: Path) -> None:
        """Writes the policy as a Hugging Face checkpoint.

        Args:
            directory: Where to write it.
        """
        ...

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (decisions that end the loop must match).

        Args:
            flag: This rank's decision.

        Returns:
            Rank 0's decision.
        """
        ...

    @property
    def max_steps(self) -> int | None:
        """Steps until the prompt dataset's epochs are used up; None when unbounded."""
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

    def evaluate(self) -> dict[str, float]:
        """Evaluates greedily on the held-out prompts.

        Returns:
            The evaluation metrics.
        """
        return self.worker.evaluate()

    def export_hf(self, directory: Path) -> None:
        """Writes a Hugging Face checkpoint.

        Args:
            directory: Output directory.
        """
        self.worker.export_hf(directory)

    def agree(self, flag: bool) -> bool:
        """Broadcasts rank 0's flag, so that every rank leaves the loop together.

        Args:
            flag: This rank's decision.

        Returns:
            Rank 0's decision.
        """
        if dist.get_world_size() == 1:
            return flag
        decision = torch.tensor([1.0 if flag else 0.0], device=self.worker.device)
        dist.broadcast(decision, src=0)
        return bool(decision.item())

    @property
    def max_steps(self) -> int | None:
        """Steps until the dataset's epochs are used up.

        Returns:
            The step count or None.
        """
        return self.worker.max_steps

    def close(self) -> None:
        """Restores torch's thread count and destroys the process group if this object made it."""
        torch.set_num_threads(self._num_threads)
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close()
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
        self.config = GRPOConfig.from_dict(config)
        self.state = init_worker_state(self.config)
        self.worker = GRPOWorker(self.config, self.state)
        return os.getpid()

    def step(self, step: int) -> dict[str, float]:
        return self.worker.step(step)

    def save_checkpoint(self, root: str, step: int) -> None:
        self.worker.save_checkpoint(root, step)

    def load_checkpoint(self, root: str) -> int:
        return self.worker.load_checkpoint(root)

    def evaluate(self) -> dict[str, float]:
        return self.worker.evaluate()

    def export_hf(self, directory: str) -> None:
        self.worker.export_hf(directory)

    def max_steps(self) -> int | None:
        return self.worker.max_steps

    def shutdown(self) -> None:
        self.worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class RayWorkerGroup:
    """``config.run.num_workers`` Ray actors in one placement group, torch.distributed among them.

    Generation and training are colocated: each actor generates its share of the rollouts
    and trains on its bins. Ray is started locally when not initialised, and shut down again
    by :meth:`close` in that case (a Ray instance the caller started is left running).

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
        self.started_ray = not ray.is_initialized()
        """Whether this group started Ray (and therefore shuts it down on close)."""
        num_workers = config.run.num_workers
        self.actors: list[Any] = []
        self.placement_group: Any = None
        try:
            if self.started_ray:
                ray.init(num_cpus=max(2, num_workers), include_dashboard=False)
            gpus = 1 if backend_for(config) == "nccl" else 0
            bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
            self.placement_group = placement_group([bundle] * num_workers, strategy="PACK")
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
                for rank in range(num_workers)
            ]
            addr, port = ray.get(self.actors[0].address.remote())
            fields = config.to_dict()
            self.pids = ray.get(
                [
                    actor.setup.remote(fields, rank, num_workers, addr, port)
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

    def evaluate(self) -> dict[str, float]:
        """Evaluates on every actor.

        Returns:
            Rank 0's evaluation metrics.
        """
        return self._all("evaluate")[0]  # type: ignore[no-any-return]

    def export_hf(self, directory: Path) -> None:
        """Writes a Hugging Face checkpoint (every actor takes part).

        Args:
            directory: Output directory.
        """
        self._all("export_hf", str(directory))

    def agree(self, flag: bool) -> bool:
        """The driver decides alone.

        Args:
            flag: The driver's decision.

        Returns:
            ``flag``.
        """
        return flag

    @property
    def max_steps(self) -> int | None:
        """Steps until the dataset's epochs are used up.

        Returns:
            The step count or None.
        """
        return self._ray.get(self.actors[0].max_steps.remote())  # type: ignore[no-any-return]

    def close(self) -> None:
        """Tears down the process group, the actors, the placement group and a Ray it started."""
        try:
            self._all("shutdown")
        finally:
            self._release()

    def _release(self) -> None:
        try:
            for actor in self.actors:
                self._ray.kill(actor)
            if self.placement_group is not None:
                self._remove_placement_group(self.placement_group)
        finally:
            if self.started_ray and self._ray.is_initialized():
                self._ray.shutdown()


def make_workers(config: GRPOConfig) -> WorkerGroup:
    """Builds the worker group of the config's mode.

    Args:
        config: The run config.

    Returns:
        The workers.
    """
    if config.run.mode == "ray":
        return RayWorkerGroup(config)
    return InProcessWorkers(config)
