"""Reading sampled tokens back to the host one step late, so the host never waits for the GPU.

Without it, every engine step ends in a blocking device-to-host copy of the sampled tokens: the
host waits for the whole step, then does its bookkeeping (stop checks, scheduling, building the
next inputs) while the GPU idles. With it, step ``N`` starts an asynchronous copy of its
samples into pinned host memory and records an event; the next step feeds those tokens to the
model from the device (the requests that continue decoding need no host value), launches its
own work, and only then reads step ``N``'s tokens, by which time the copy is normally done.

Stop decisions therefore lag one step: a request whose token ``N`` is a stop token has already
been scheduled for step ``N + 1``; that extra token is discarded (the request's cache holds
room for it, see :meth:`mcore_inference.scheduler.Scheduler.schedule`) and results are exactly
those of the synchronous engine. Requests that finish by length are never continued, and the
engine reads such a step's tokens before admitting new requests, so the batches (and hence the
results, bit for bit) are those of the synchronous engine unless a stop token or word ends a
request (its blocks are then freed one step later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_inference.batch import Microbatch

__all__ = ["DeferredSamples", "SampleReadback"]


@dataclass(slots=True)
class DeferredSamples:
    """The samples of a step whose host copy may still be on its way."""

    microbatch: Microbatch
    """The step's microbatch (its ``sampling`` requests, in row order)."""
    samples: torch.Tensor
    """float64 ``[2, n]`` tokens and log-probabilities on the device (fed to the next step; of
    the last step of a multi-step run)."""
    host: torch.Tensor
    """Host copy of the samples (pinned on CUDA), valid after :meth:`wait`: ``[2, n]``, or
    ``[steps, 2, n]`` for a multi-step run."""
    event: torch.cuda.Event | None
    """Recorded after the copy on CUDA; None on the CPU (the copy is then synchronous)."""
    ends_by_length: bool = False
    """Whether a token of it is a request's last by length (the engine reads it before the
    next admission)."""

    @property
    def steps(self) -> int:
        """Steps whose samples it holds (1, or the length of a multi-step run)."""
        return self.host.shape[0] if self.host.dim() == 3 else 1

    def wait(self) -> torch.Tensor:
        """Block until the host copy is complete.

        Returns:
            The float64 ``[2, n]`` (or ``[steps, 2, n]``) host tensor.
        """
        if self.event is not None:
            self.event.synchronize()
        return self.host


class SampleReadback:
    """Starts the asynchronous host copies of sampled tokens, into reused pinned buffers.

    Args:
        device: The engine's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        # One event per buffer, recorded again at each use (creating one per step costs host
        # time): the event of a buffer is only re-recorded once the host read that buffer.
        self._events: list[torch.cuda.Event] = []

    def _buffer(self, shape: torch.Size) -> torch.Tensor:
        # Two buffers in turn: the one of the previous step may still be read by the host.
        pinned = self.device.type == "cuda"
        if len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=torch.float64))
        index, self._next = self._next, 1 - self._next
        buffer = self._buffers[index]
        count = shape.numel()
        if buffer.numel() < count:
            buffer = torch.empty(count, dtype=torch.float64, pin_memory=pinned)
            self._buffers[index] = buffer
        # A contiguous prefix: the copy goes straight into pinned memory.
        return buffer[:count].view(shape)

    def start(self, microbatch: Microbatch, samples: torch.Tensor) -> DeferredSamples:
        """Start copying a step's (or a multi-step run's) samples to the host.

        Args:
            microbatch: The step's microbatch.
            samples: Its float64 ``[2, n]`` samples on the device, or ``[steps, 2, n]`` of a
                multi-step run (contiguous).

        Returns:
            The deferred samples; their ``samples`` are the last step's ``[2, n]``.
        """
        host = self._buffer(samples.shape)
        last = samples[-1] if samples.dim() == 3 else samples
        if self.device.type != "cuda":
            host.copy_(samples)
            return DeferredSamples(microbatch, last, host, None)
        host.copy_(samples, non_blocking=True)
        index = 1 - self._next  # the buffer just taken
        while len(self._events) <= index:
            self._events.append(torch.cuda.Event())
        event = self._events[index]
        event.record()
        return DeferredSamples(microbatch, last, host, event)
