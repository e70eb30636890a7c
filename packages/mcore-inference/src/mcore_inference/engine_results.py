"""Sampled tokens back to requests: the engine's sampling and reporting half.

A microbatch that leaves the last pipeline stage brings its sampled tokens (read at once, or
one step late through :class:`~mcore_inference.readback.SampleReadback`); each token is
appended to its request, the stop criteria and the length limit are checked, and the request
is reported (progress or final result).
"""

from __future__ import annotations

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.engine_requests import _RequestBook
from mcore_inference.readback import DeferredSamples
from mcore_inference.request import FinishReason, Request, RequestStatus, TokenUpdate

__all__: list[str] = []


class _ResultBook(_RequestBook):
    """Applying sampled tokens and building reports (a base of ``InferenceEngine``)."""

    def _complete_deferred(self, reports: list[Request], *, progress: bool) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._complete(deferred.microbatch, deferred.wait(), reports, progress=progress)

    def _defer(self, deferred: DeferredSamples) -> None:
        active = RequestStatus.ACTIVE
        for column, request in enumerate(deferred.microbatch.sampling):
            if request.status == active:
                request.deferred_index = column
                request.awaiting_token = True
                if len(request.output) + 1 >= request.max_new_tokens:
                    deferred.ends_by_length = True
        self._deferred = deferred

    def _decides_samples(self) -> bool:
        groups = self.groups
        return groups.replica_group is None or (torch.distributed.get_rank() == groups.sampler_rank)

    def _take_unreported(self) -> list[Request]:
        taken, self._unreported = self._unreported, []
        return taken

    def _complete(
        self,
        leaving: Microbatch,
        samples: torch.Tensor | None,
        reports: list[Request],
        *,
        progress: bool,
    ) -> None:
        """Apply a microbatch that left the last stage: tokens, stop decisions, freed blocks."""
        assert self.scheduler is not None
        active = RequestStatus.ACTIVE
        for request, _ in leaving.entries:
            request.in_flight -= 1
            if request.in_flight == 0 and request.status != active:
                self.scheduler.free_blocks(request)
        if not leaving.sampling:
            return
        values = self.groups.broadcast_samples(samples, len(leaving.sampling))
        if values.device.type != "cpu":
            values = values.cpu()
        # Token ids as Python ints in one conversion (float64 holds them exactly).
        tokens = values[0].to(torch.long).tolist()
        logprobs = values[1].tolist()
        stops = self._stops
        length = FinishReason.LENGTH
        report = reports.append
        for request, token, logprob in zip(leaving.sampling, tokens, logprobs, strict=True):
            request.awaiting_token = False
            request.deferred_index = -1
            if request.status != active:
                continue  # aborted while its tokens were in the pipeline
            output = request.output
            output.append(token)
            if request.params.return_logprobs:
                request.logprobs.append(logprob)
            criteria = stops[request.request_id]
            reason = criteria.check(output) if criteria.active else None
            if reason is None and len(output) >= request.max_new_tokens:
                reason = length
            if reason is not None:
                self._finish(request, reason)
            elif progress:
                report(request)

    def _token_updates(self, requests: list[Request]) -> list[TokenUpdate]:
        """The tokens each request got since its previous update (a final result when done)."""
        updates = []
        for request in requests:
            start = request.num_reported
            request.num_reported = len(request.output)
            done = request.status in (RequestStatus.FINISHED, RequestStatus.FAILED)
            updates.append(
                TokenUpdate(
                    request_id=request.request_id,
                    new_tokens=request.output[start:],
                    new_logprobs=(
                        request.logprobs[start:] if request.params.return_logprobs else None
                    ),
                    result=self._snapshot(request) if done else None,
                )
            )
        return updates
