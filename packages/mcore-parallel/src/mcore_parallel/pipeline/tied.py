"""Gradients of weights shared by the first and the last pipeline stage (tied embeddings).

With tied input and output embeddings under pipeline parallelism the first stage holds the
word embedding and the last stage a copy of it for the output layer. Each copy receives only
its own part of the gradient; summing the two over ``ParallelState.embedding_group`` after
backward gives both copies the gradient of the shared weight, so they stay identical.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from mcore_parallel.state import ParallelState

__all__ = ["allreduce_tied_embedding_grads"]


def allreduce_tied_embedding_grads(
    parameters: Iterable[torch.Tensor], state: ParallelState | None
) -> None:
    """Sums the gradients of tied weights over the first and last pipeline stage.

    Call it on the first and last stage with that stage's copy of the shared weights; it is a
    no-op without pipelining (``state`` None or ``pp_size == 1``) and on middle stages.

    Args:
        parameters: This stage's copies of the shared weights (parameters without a gradient
            are skipped).
        state: Parallel state.
    """
    if state is None or state.size("pp") == 1 or state.embedding_group is None:
        return
    for param in parameters:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=state.embedding_group)
