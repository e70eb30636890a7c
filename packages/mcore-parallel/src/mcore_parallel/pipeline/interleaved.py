"""The interleaved 1F1B schedule: each rank holds several model chunks (virtual stages).

With ``vp`` chunks per rank, chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r``;
activations leave the last rank's chunk ``c`` for the first rank's chunk ``c + 1``. Splitting
the model finer shrinks the pipeline bubble by ``vp`` at the cost of more communication
(Narayanan et al., arXiv:2104.04473, section 2.2.2). The order of forward and backward passes
and of the exchanges follows that paper's schedule as implemented in Megatron-LM
(megatron/core/pipeline_parallel/schedules.py); the exchanges of all ranks pair up, step by
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.pipeline.p2p import PipelineChannel
from mcore_parallel.state import ParallelState

__all__: list[str] = []


def run_interleaved(
    stages: Sequence[Any],
    channel: PipelineChannel,
    state: ParallelState,
    microbatches: Sequence[Any],
    *,
    forward_only: bool = False,
) -> None:
    """Runs forward (and backward) passes of every chunk of this rank over the microbatches.

    Args:
        stages: One runner per model chunk, with ``forward(input, microbatch)`` and
            ``backward(input, output, output_grad)`` (the schedules module's stage runner).
        channel: Channel with a fixed tensor shape.
        state: Parallel state with ``pp_size > 1``.
        microbatches: The microbatches; their number must be a multiple of ``pp_size``.
        forward_only: Whether to run the forward passes only.

    Raises:
        ParallelConfigError: If the number of microbatches is not a multiple of ``pp_size``.
    """
    pp, rank, vp = state.size("pp"), state.rank_in("pp"), len(stages)
    count = len(microbatches)
    if count % pp != 0:
        raise ParallelConfigError(
            f"interleaved pipelining needs the number of microbatches ({count}) to be a "
            f"multiple of pp={pp}"
        )
    total = count * vp
    group = pp * vp
    all_warmup = count == pp or forward_only
    warmup = total if all_warmup else min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
    first_rank, last_rank = rank == 0, rank == pp - 1

    def chunk_of(step: int, forward: bool) -> int:
        chunk = (step % group) // pp
        return chunk if forward else vp - 1 - chunk

    def microbatch_of(step: int) -> int:
        return (step // group) * pp + step % pp

    inputs: list[list[torch.Tensor | None]] = [[] for _ in range(vp)]
    outputs: list[list[torch.Tensor]] = [[] for _ in range(vp)]
    grads: list[list[torch.Tensor | None]] = [[] for _ in range(vp)]

    def forward(step: int) -> torch.Tensor | None:
        chunk = chunk_of(step, True)
        if first_rank and chunk == 0:
            inputs[0].append(None)
        output = stages[chunk].forward(inputs[chunk][-1], microbatches[microbatch_of(step)])
        outputs[chunk].append(output)
        # The last virtual stage's output is the loss: nothing to send.
        return None if last_rank and chunk == vp - 1 else output

    def backward(step: int) -> torch.Tensor | None:
        chunk = chunk_of(step, False)
        if last_rank and chunk == vp - 1:
            grads[chunk].append(None)
        input_grad = stages[chunk].backward(
            inputs[chunk].pop(0), outputs[chunk].pop(0), grads[chunk].pop(0)
        )
        return None if first_rank and chunk == 0 else input_grad

    if not first_rank:
        received, _ = channel.exchange(None, None, recv_prev=True, recv_next=False)
        inputs[0].append(received)
    for step in range(warmup):
        output = forward(step)
        next_chunk = chunk_of(step + 1, True)
        recv_prev = not (first_rank and next_chunk == 0) and step != total - 1
        recv_next = step == warmup - 1 and not all_warmup and not last_rank
        received, grad = channel.exchange(output, None, recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_chunk].append(received)
        if recv_next:
            grads[vp - 1].append(grad)

    remaining = total - warmup
    for index in range(remaining):
        forward_step_index = index + warmup
        output = forward(forward_step_index)
        input_grad = backward(index)
        if first_rank:
            next_forward = chunk_of(forward_step_index - (pp - 1), True)
            recv_prev = next_forward != vp - 1
            next_forward += 1
        else:
            next_forward = chunk_of(forward_step_index + 1, True)
            recv_prev = True
        if last_rank:
            next_backward = chunk_of(index - (pp - 1), False)
            recv_next = next_backward != 0
            next_backward -= 1
        else:
            next_backward = chunk_of(index + 1, False)
            recv_next = True
        if index == remaining - 1:
            recv_prev = False
        received, grad = channel.exchange(
            output, input_grad, recv_prev=recv_prev, recv_next=recv_next
        )
        if recv_prev:
            inputs[next_forward].append(received)
        if recv_next:
            grads[next_backward].append(grad)

    if forward_only:
        return
    if all_warmup and not last_rank:
        _, grad = channel.exchange(None, None, recv_prev=False, recv_next=True)
        grads[vp - 1].append(grad)
    for step in range(remaining, total):
        input_grad = backward(step)
        next_backward = chunk_of(step + 1, False)
        recv_next = not (last_rank and next_backward == vp - 1) and step != total - 1
        _, grad = channel.exchange(None, input_grad, recv_prev=False, recv_next=recv_next)
        if recv_next:
            grads[next_backward].append(grad)
