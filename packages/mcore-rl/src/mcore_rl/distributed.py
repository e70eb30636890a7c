"""Setting up torch.distributed for a worker: in this process, under torchrun, or in a Ray actor."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from mcore_parallel import ParallelState
from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.state import initialize
from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLConfigError

__all__ = ["backend_for", "init_worker_state", "free_port"]


def free_port() -> int:
    """Asks the OS for a free TCP port on the loopback interface.

    Returns:
        The port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def backend_for(config: GRPOConfig) -> str:
    """The torch.distributed backend of the config's device.

    Args:
        config: The run config.

    Returns:
        ``"nccl"`` on CUDA, ``"gloo"`` on the CPU.
    """
    device = config.run.device
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if use_cuda else "gloo"


def init_worker_state(config: GRPOConfig) -> ParallelState:
    """Initialises torch.distributed (a world of one when not launched) and the parallel state.

    Under torchrun (or inside a Ray actor that set ``RANK``/``WORLD_SIZE``) the environment
    describes the world; a plain ``python`` process becomes a world of one on a free port.

    Args:
        config: The run config.

    Returns:
        This rank's parallel state at the training layout (``train_parallel``).

    Raises:
        RLConfigError: If the training or generation layout does not fill the world.
    """
    if "RANK" in os.environ or dist.is_initialized():
        return _initialize(config)
    single = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    saved = {name: os.environ.get(name) for name in single}
    os.environ.update(single)
    try:
        return _initialize(config)
    finally:
        # The store is connected; leave the environment as the caller had it.
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _initialize(config: GRPOConfig) -> ParallelState:
    layout = config.train_parallel
    try:
        state = initialize(
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            ep=layout.ep,
            backend=backend_for(config),
            etp=layout.etp,
        )
    except ParallelConfigError as error:
        raise RLConfigError(f"train_parallel: {error}") from None
    world = dist.get_world_size()
    try:
        for name in ("train_parallel", "infer_parallel"):
            section = getattr(config, name)
            dp = section.data_parallel_size(world)
            if section.dp is not None and section.dp != dp:
                raise RLConfigError(f"{name}.dp={section.dp} does not fit {world} ranks")
    except RLConfigError:
        state.destroy()
        raise
    return state
