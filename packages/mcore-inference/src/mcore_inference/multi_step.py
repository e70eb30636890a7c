"""Multi-step decode: several decode steps per host round trip, fed and sampled on the device.

A decode step that only continues requests needs nothing from the host: each row's next token
is the one the previous step sampled, its position one further, its block-table row the same.
When every row of a decode microbatch samples and none can reach its length limit before the
last of ``n`` steps, the engine runs those ``n`` steps back to back (a *run*): the first as an
ordinary step, the others replaying the same CUDA graph (or the eager forward) on inputs the
device advances itself, every step sampled through one
:class:`~mcore_inference.sample_step.SamplingPlan` into a ``[n, 2, rows]`` buffer that is
copied to the host once (asynchronously, see :mod:`mcore_inference.readback`). The host's
per-step bookkeeping (scheduling, batch building, stop checks, reports) then happens once per
run.

Results are those of single steps: a request's ``j``-th token of a run uses the uniform number
of its token index (:func:`~mcore_inference.sampling.sampling_uniforms`) and the same sampler
ops, and the host applies a run's tokens one by one, stopping a request at its stop token or
stop word; the tokens computed after it on the device are dropped. Those extra steps write
inside the request's reserved footprint, since a run never goes past the first length limit of
its rows. As with the one-step-late readback, a request that stops on a stop token or word
leaves the batch (and frees its blocks) only when its run has been read, up to ``n`` steps later
than single steps would; the rows of the other requests are computed the same way, but a
smaller batch after the stop may then fall into another CUDA graph bucket.
"""

from __future__ import annotations

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.sample_step import SamplingPlan

__all__ = ["RunBuffers", "plan_run", "run_length"]


def run_length(microbatch: Microbatch, limit: int) -> int:
    """Steps a microbatch may run back to back (1: an ordinary step).

    Args:
        microbatch: The step's microbatch, just built (its requests' ``num_computed`` already
            count its tokens).
        limit: Most steps of a run (``InferenceConfig.multi_step_decode``).

    Returns:
        ``limit`` capped by the first length limit of its requests, or 1 when the microbatch
        is not a pure decode step in which every row samples.
    """
    if limit <= 1 or not microbatch.is_decode:
        return 1
    requests = microbatch.sampling
    if len(requests) != microbatch.num_tokens:
        return 1
    steps = limit
    for request in requests:
        # Index of the token the first step samples; the run samples up to index + steps - 1.
        left = request.max_new_tokens - (request.num_computed - len(request.prompt))
        if left < steps:
            steps = left
    # The last step's positions stay inside the footprint reserved at admission.
    return max(steps, 1)


def plan_run(microbatch: Microbatch, steps: int, device: torch.device) -> SamplingPlan:
    """Turn a microbatch into a run of ``steps`` steps and build its sampling plan.

    The plan is built from the requests' state before the run (their first sampled index);
    then each request's ``num_computed`` advances past the run's other ``steps - 1`` fed tokens.

    Args:
        microbatch: A microbatch for which :func:`run_length` gave ``steps``.
        steps: Steps of the run.
        device: The engine's device.

    Returns:
        The sampling plan of every step of the run.
    """
    plan = SamplingPlan(microbatch.sampling, device, steps)
    microbatch.steps = steps
    for request in microbatch.sampling:
        request.num_computed += steps - 1
    return plan


class RunBuffers:
    """Reused device buffers of the float64 ``[steps, 2, n]`` samples of consecutive runs.

    Two in turn: a run's buffer is read by its host copy and by the next run's first step, both
    queued on the one stream before the run after next writes it.

    Args:
        device: The engine's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def take(self, steps: int, columns: int, *, nan_logprobs: bool) -> torch.Tensor:
        """The next buffer as a contiguous ``[steps, 2, columns]`` view.

        Args:
            steps: Steps of the run.
            columns: Sampling rows.
            nan_logprobs: Fill the log-prob rows with NaN (some rows ask for none).

        Returns:
            The view.
        """
        size = steps * 2 * columns
        if len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=torch.float64, device=self.device))
        index, self._next = self._next, 1 - self._next
        if self._buffers[index].numel() < size:
            self._buffers[index] = torch.empty(size, dtype=torch.float64, device=self.device)
        view = self._buffers[index][:size].view(steps, 2, columns)
        if nan_logprobs:
            view[:, 1].fill_(float("nan"))
        return view
