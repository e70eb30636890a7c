"""Whether the symmetric-memory kernels can run for a call, and the one-time log of why not."""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.distributed as dist

from mcore_kernels._backend import selected_backend

__all__ = [
    "MAX_WORLD_SIZE",
    "MAX_HIDDEN",
    "MAX_TOKENS",
    "size_limit_reason",
    "symmetric_memory_unavailable_reason",
    "log_fallback_once",
]

logger = logging.getLogger("mcore_kernels.comm")

MAX_WORLD_SIZE = 8
"""Largest group the kernels serve: the peers of one NVLink node."""

MAX_HIDDEN = 16384
"""Largest hidden size: one program holds a whole row in registers."""

MAX_TOKENS = 4096
"""Largest token count served: it bounds the symmetric buffers (three of ``tokens x hidden``
per rank) and keeps the kernels' 32-bit offsets far from overflow."""

_logged_reasons: set[str] = set()


def symmetric_memory_unavailable_reason(
    partial: torch.Tensor, group: dist.ProcessGroup | None
) -> str | None:
    """Say why the symmetric-memory path cannot serve this call, from local facts only.

    Every condition checked depends on values that agree across the ranks of a correct
    program (device type, backend, dtype, shapes, installed versions), so all ranks take the
    same path without communicating. Conditions that need the peers (same host, a successful
    rendezvous) are checked once when the workspace is built.

    Args:
        partial: this rank's ``[tokens, hidden]`` partial sum.
        group: the tensor-parallel process group (None: the default group).

    Returns:
        None when the symmetric-memory path may run, else a sentence naming the cause.

    Raises:
        KernelBackendError: ``MCORE_KERNELS_BACKEND`` holds an unknown value.
    """
    if selected_backend() == "torch":
        return "MCORE_KERNELS_BACKEND=torch asks for the collective path"
    if not partial.is_cuda:
        return f"partial is on {partial.device.type} (cpu/gloo); symmetric memory needs CUDA"
    backend = str(dist.get_backend(group))
    if backend != "nccl":
        return f"the group's backend is {backend!r}; symmetric memory needs an NCCL group"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory"
    if not hasattr(symm_mem, "empty") or not hasattr(symm_mem, "rendezvous"):
        return f"torch {torch.__version__} lacks symmetric_memory.empty/rendezvous"
    tokens, hidden = partial.shape
    return size_limit_reason(tokens, hidden, dist.get_world_size(group))


def size_limit_reason(tokens: int, hidden: int, world: int) -> str | None:
    """Say which size limit of the symmetric-memory kernels a call exceeds, if any.

    Args:
        tokens: rows of the call.
        hidden: row length.
        world: ranks in the group.

    Returns:
        None when every limit holds, else a sentence naming the limit.
    """
    if world > MAX_WORLD_SIZE:
        return f"the group has {world} ranks; the kernels serve at most {MAX_WORLD_SIZE}"
    if hidden > MAX_HIDDEN:
        return f"hidden={hidden} exceeds the kernels' limit of {MAX_HIDDEN}"
    if tokens > MAX_TOKENS:
        return f"tokens={tokens} exceeds the symmetric workspace limit of {MAX_TOKENS}"
    return None


def log_fallback_once(reason: str) -> None:
    """Log at INFO level that the collective path runs, once per distinct reason.

    Args:
        reason: why the symmetric-memory path cannot run.
    """
    if reason in _logged_reasons:
        return
    _logged_reasons.add(reason)
    logger.info("fused_rs_add_rmsnorm_ag uses reduce_scatter + rms_norm + all_gather: %s", reason)
