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
        steps = deferred.steps
        for column, request in enumerate(deferred.microbatch.sampling):
            if request.status == active:
                request.deferred_index = column
                request.awaiting_token = True
                request.unread = steps
                if len(request.output) + steps >= request.max_new_tokens:
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
        if samples is not None and samples.dim() == 3:
            self._complete_run(leaving, samples, reports, progress=progress)
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
            request.unread = 0
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

    def _complete_run(
        self, leaving: Microbatch, values: torch.Tensor, reports: list[Request], *, progress: bool
    ) -> None:
        """Apply the ``[steps, 2, n]`` host samples of a multi-step run, step by step per request.

        Tokens after one that ends a request (stop token, stop word) were computed on the
        device before the host knew; they are dropped, so each request gets exactly the tokens
        of single steps.
        """
        # Per request: its tokens and log-probs of every step, as Python numbers in one go.
        tokens = values[:, 0].t().to(torch.long).tolist()
        logprobs = values[:, 1].t().tolist()
        active = RequestStatus.ACTIVE
        stops = self._stops
        length = FinishReason.LENGTH
        report = reports.append
        for request, new_tokens, new_logprobs in zip(
            leaving.sampling, tokens, logprobs, strict=True
        ):
            request.awaiting_token = False
            request.deferred_index = -1
            request.unread = 0
            if request.status != active:
                continue  # aborted while its tokens were on the device
            output = request.output
            keep_logprobs = request.params.return_logprobs
            criteria = stops[request.request_id]
            reason = None
            if not criteria.active:
                # No stop condition: every token up to the length limit stands.
                room = request.max_new_tokens - len(output)
                kept = new_tokens if room >= len(new_tokens) else new_tokens[:room]
                output.extend(kept)
                if keep_logprobs:
                    request.logprobs.extend(new_logprobs[: len(kept)])
                if len(output) >= request.max_new_tokens:
                    reason = length
            else:
                for token, logprob in zip(new_tokens, new_logprobs, strict=True):
                    output.append(token)
                    if keep_logprobs:
                        request.logprobs.append(logprob)
                    reason = criteria.check(output)
                    if reason is None and len(output) >= request.max_new_tokens:
                        reason = length
                    if reason is not None:
                        break
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
