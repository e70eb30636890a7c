"""Forward/backward schedules over microbatches: no pipelining, 1F1B and interleaved 1F1B.

The one-forward-one-backward (1F1B) schedule runs ``pp_size - pp_rank - 1`` warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards, so a stage
holds at most ``pp_size - pp_rank`` microbatches of activations (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473,
section 2.2). Gradients accumulate over the microbatches; each loss is divided by their number,
so the accumulated gradient is that of the mean loss.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch

from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.pipeline.interleaved import run_interleaved
from mcore_parallel.pipeline.p2p import PipelineChannel
from mcore_parallel.state import ParallelState

__all__ = ["ScheduleOutput", "forward_backward", "default_forward_step"]

ForwardStep = Callable[[Any, torch.Tensor | None, Any], torch.Tensor]
LossFunc = Callable[[torch.Tensor, Any], torch.Tensor]


def default_forward_step(model: Any, input_tensor: torch.Tensor | None, microbatch: Any) -> Any:
    """Calls ``model(microbatch)`` on the first stage and ``model(input_tensor)`` elsewhere.

    Args:
        model: This stage's module.
        input_tensor: Activation received from the previous stage; None on the first stage.
        microbatch: The microbatch (its model input on the first stage).

    Returns:
        The stage's output.
    """
    return model(microbatch if input_tensor is None else input_tensor)


@dataclass(slots=True)
class ScheduleOutput:
    """What :func:`forward_backward` returns; the lists are filled on the last stage only."""

    losses: list[torch.Tensor] = field(default_factory=list)
    """Per-microbatch losses as returned by ``loss_func`` (unscaled, detached)."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """Per-microbatch model outputs (detached) when ``loss_func`` is None."""

    @property
    def mean_loss(self) -> torch.Tensor | None:
        """Mean of :attr:`losses` (the loss whose gradient was accumulated), or None."""
        return torch.stack(self.losses).mean() if self.losses else None


@dataclass(slots=True)
class _Stage:
    model: Any
    forward_step: ForwardStep
    loss_func: LossFunc | None
    forward_only: bool
    is_last: bool
    num_microbatches: int
    no_sync: Callable[[], AbstractContextManager[Any]] | None
    result: ScheduleOutput
    average_microbatches: bool = True
    backward_count: int = 0

    def forward(self, input_tensor: torch.Tensor | None, microbatch: Any) -> torch.Tensor:
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_(True)
        output = self.forward_step(self.model, input_tensor, microbatch)
        if not self.is_last:
            return output
        if self.loss_func is None:
            self.result.outputs.append(output.detach())
            return output
        loss = self.loss_func(output, microbatch)
        if loss.dim() != 0:
            raise ParallelConfigError(
                f"loss_func must return a scalar, got a tensor of shape {tuple(loss.shape)}"
            )
        self.result.losses.append(loss.detach())
        return loss / self.num_microbatches if self.average_microbatches else loss

    def backward(
        self,
        input_tensor: torch.Tensor | None,
        output: torch.Tensor,
        output_grad: torch.Tensor | None,
    ) -> torch.Tensor | None:
        self.backward_count += 1
        is_final = self.backward_count == self.num_microbatches
        context = self.no_sync() if self.no_sync is not None and not is_final else nullcontext()
        with context:
            torch.autograd.backward(output, grad_tensors=output_grad)
        return None if input_tensor is None else input_tensor.grad


def forward_backward(
    model: Any,
    microbatches: Iterable[Any],
    *,
    state: ParallelState | None = None,
    num_microbatches: int | None = None,
    loss_func: LossFunc | None = None,
    forward_step: ForwardStep = default_forward_step,
    forward_only: bool = False,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    no_sync: Callable[[], AbstractContextManager[Any]] | None = None,
    average_microbatches: bool = True,
) -> ScheduleOutput:
    """Runs forward (and backward) passes of this pipeline stage over the microbatches.

    Without pipeline parallelism (``state`` None or ``pp_size == 1``) the microbatches run one
    after the other; otherwise the 1F1B schedule exchanges activations and gradients with the
    neighbouring stages. Given a list of model chunks (virtual stages: chunk ``c`` of pipeline
    rank ``r`` is stage ``c * pp + r``) the interleaved 1F1B schedule runs instead; it needs a
    fixed ``tensor_shape`` and a number of microbatches divisible by ``pp_size``. Every stage
    must call it with the same number of microbatches.

    Args:
        model: This stage's module, or a list of its model chunks (each passed through to
            ``forward_step``).
        microbatches: One item per microbatch (a sequence or an iterator), given on every
            stage: the first stage feeds it to the model, the last one to ``loss_func`` (e.g.
            a dict with inputs and labels).
        state: Parallel state; None runs without pipelining.
        num_microbatches: How many items to take from ``microbatches``; None takes them all.
        loss_func: ``loss_func(output, microbatch)`` returning a scalar loss, called on the
            last stage. None (with ``forward_only``) collects the outputs instead.
        forward_step: ``forward_step(model, input_tensor, microbatch)`` returning the stage's
            output; ``input_tensor`` is the received activation, None on the first stage.
            Non-last stages must return a single tensor.
        forward_only: Whether to skip the backward passes (no autograd graph is kept).
        tensor_shape: Shape of the activations between stages; None sends the shape with each
            activation, which allows different sequence lengths per microbatch.
        dtype: Dtype of the activations when ``tensor_shape`` is given.
        no_sync: Factory of a context manager entered around every backward pass but the last
            (e.g. a data-parallel wrapper's ``no_sync``), so gradients are reduced once; with
            model chunks, around every backward pass of a chunk but its last.
        average_microbatches: Divide each loss by the number of microbatches (the gradient of
            the mean loss, the default); False accumulates the gradient of their sum, for
            losses that are already shares of a global normaliser (e.g. a token count).

    Returns:
        The per-microbatch losses, or outputs when ``loss_func`` is None; empty on stages other
        than the last.

    Raises:
        ParallelConfigError: If there are no microbatches or fewer than ``num_microbatches``,
            ``loss_func`` is None without ``forward_only``, ``loss_func`` returns a
            non-scalar, ``model`` is an empty list, or the interleaved schedule's
            requirements are not met.
    """
    microbatches = _take(microbatches, num_microbatches)
    num_microbatches = len(microbatches)
    if loss_func is None and not forward_only:
        raise ParallelConfigError(
            "loss_func=None collects outputs and needs forward_only=True (got forward_only=False)"
        )
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ParallelConfigError("model is an empty list; expected at least one model chunk")
    result = ScheduleOutput()
    pipelined = state is not None and state.size("pp") > 1
    holds_last_stage = not pipelined or state.is_last_stage  # type: ignore[union-attr]
    stages = [
        _Stage(
            model=chunk,
            forward_step=forward_step,
            loss_func=loss_func,
            forward_only=forward_only,
            is_last=holds_last_stage and index == len(chunks) - 1,
            num_microbatches=num_microbatches,
            no_sync=no_sync,
            result=result,
            average_microbatches=average_microbatches,
        )
        for index, chunk in enumerate(chunks)
    ]
    grad_mode = torch.no_grad() if forward_only else nullcontext()
    with grad_mode:
        if not pipelined:
            _run_no_pipelining(stages, microbatches)
            return result
        assert state is not None
        channel = PipelineChannel(state, tensor_shape=tensor_shape, dtype=dtype)
        if len(stages) > 1:
            run_interleaved(stages, channel, state, microbatches, forward_only=forward_only)
        elif forward_only:
            _run_forward_only(stages[0], channel, microbatches)
        else:
            _run_1f1b(stages[0], channel, state, microbatches)
    return result


def _take(microbatches: Iterable[Any], count: int | None) -> list[Any]:
    if count is None:
        items = list(microbatches)
    elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ParallelConfigError(f"num_microbatches={count!r} must be a positive integer")
    else:
        items = list(islice(iter(microbatches), count))
        if len(items) < count:
            raise ParallelConfigError(
                f"microbatches yielded {len(items)} items, fewer than num_microbatches={count}"
            )
    if not items:
        raise ParallelConfigError("microbatches is empty; expected at least one microbatch")
    return items


def _run_no_pipelining(stages: list[_Stage], microbatches: Sequence[Any]) -> None:
    # Model chunks on one rank form a single model: chain them without cutting the graph.
    for microbatch in microbatches:
        output = None
        for stage in stages:
            output = stage.forward(output, microbatch)
        assert output is not None
        if not stages[-1].forward_only:
            stages[-1].backward(None, output, None)


def _run_forward_only(stage: _Stage, channel: PipelineChannel, microbatches: Sequence[Any]) -> None:
    for microbatch in microbatches:
        output = stage.forward(channel.recv_forward(), microbatch)
        channel.send_forward(output)


def _run_1f1b(
    stage: _Stage, channel: PipelineChannel, state: ParallelState, microbatches: Sequence[Any]
) -> None:
    total = len(microbatches)
    warmup = min(state.size("pp") - state.rank_in("pp") - 1, total)
    inputs: deque[torch.Tensor | None] = deque()
    outputs: deque[torch.Tensor] = deque()
    for index in range(warmup):
        input_tensor = channel.recv_forward()
        output = stage.forward(input_tensor, microbatches[index])
        channel.send_forward(output)
        inputs.append(input_tensor)
        outputs.append(output)
    input_tensor = channel.recv_forward() if warmup < total else None
    for index in range(warmup, total):
        output = stage.forward(input_tensor, microbatches[index])
        output_grad = channel.send_forward_recv_backward(output)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = stage.backward(inputs.popleft(), outputs.popleft(), output_grad)
        if index == total - 1:
            channel.send_backward(input_grad)
        else:
            input_tensor = channel.send_backward_recv_forward(input_grad)
    for _ in range(warmup):
        output_grad = channel.recv_backward()
        input_grad = stage.backward(inputs.popleft(), outputs.popleft(), output_grad)
        channel.send_backward(input_grad)
