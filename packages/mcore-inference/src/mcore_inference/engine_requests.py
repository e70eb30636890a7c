"""Request intake and lifetime of the engine: validation, queueing, finishing, dropping.

The scheduling half of :class:`~mcore_inference.engine.InferenceEngine`: a new request is
validated (on every rank of a replica, which then agree), gets its seed and stop criteria and
joins the scheduler's waiting queue; a finished, aborted or failed one releases its KV blocks
and waits for its final report. The admission itself and the per-step choice of tokens are the
:class:`~mcore_inference.scheduler.Scheduler`'s.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.block_allocator import BlockAllocator
from mcore_inference.config import InferenceConfig, SamplingParams
from mcore_inference.distributed import EngineGroups, RequestVerdict, request_fingerprint
from mcore_inference.errors import EngineClosedError, InvalidRequestError
from mcore_inference.expert_parallel import ExpertParallelSync
from mcore_inference.fused_decode import FusedDecoder
from mcore_inference.intake import normalize_prompt, params_per_prompt, validate_request
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.mamba_state import MambaStateCache
from mcore_inference.multi_step import RunBuffers
from mcore_inference.readback import DeferredSamples, SampleReadback
from mcore_inference.request import FinishReason, GenerationResult, Request, RequestStatus
from mcore_inference.scheduler import Scheduler
from mcore_inference.stage import StageRunner
from mcore_inference.stopping import StopCriteria

__all__: list[str] = []


class _RequestBook:
    """Request intake, finishing and dropping (a base of ``InferenceEngine``)."""

    # State shared by the engine's parts (set in ``InferenceEngine.__init__``).
    model: Any
    config: InferenceConfig
    device: torch.device
    vocab_size: int
    groups: EngineGroups
    allocator: BlockAllocator
    kv_cache: PagedKVCache | None
    scheduler: Scheduler | None
    mamba_states: MambaStateCache | None
    tokenizer: Any
    _decoder: FusedDecoder | None
    _ep: ExpertParallelSync | None
    _runner: StageRunner | None
    _seed_source: random.Random
    _next_id: int
    _unreported: list[Request]
    _stops: dict[int, StopCriteria]
    _pipeline: deque[Microbatch | None]
    _readback: SampleReadback | None
    _deferred: DeferredSamples | None
    _multi_step: int
    _run_buffers: RunBuffers
    _stage_input: torch.Tensor | None
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; build a new InferenceEngine")

    def _admit_mamba_state(self, request: Request) -> None:
        assert self.mamba_states is not None
        self.mamba_states.admit(request.request_id)

    def _release_mamba_state(self, request: Request) -> None:
        if self.mamba_states is not None:
            self.mamba_states.release(request.request_id)

    def _add_requests(
        self,
        prompts: Sequence[Any],
        params_list: Sequence[SamplingParams | None],
        drawn_seeds: Sequence[int] | None = None,
    ) -> list[int]:
        requests, verdicts = [], []
        for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            params = params if params is not None else SamplingParams()
            prompt_list = normalize_prompt(prompt)
            valid_params = isinstance(params, SamplingParams)
            # Drawn for every request (seeded or not), so unseeded requests get the same seeds
            # whatever the seeds of the others.
            drawn = (
                drawn_seeds[index] if drawn_seeds is not None else self._seed_source.getrandbits(63)
            )
            seed = params.seed if valid_params and params.seed is not None else drawn
            request = Request(
                request_id=self._next_id,
                prompt=prompt_list if isinstance(prompt_list, list) else [],
                params=params if valid_params else SamplingParams(),
                seed=seed,
                max_new_tokens=0,
            )
            self._next_id += 1
            try:
                self._validate(prompt_list, params)
                error = None
            except InvalidRequestError as exc:
                error = str(exc)
            requests.append(request)
            verdicts.append(RequestVerdict(request_fingerprint(prompt_list, params), error))
        decisions = self.groups.agree_on_requests(verdicts)
        assert self.scheduler is not None
        for request, error in zip(requests, decisions, strict=True):
            if error is not None:
                request.status, request.finish_reason = RequestStatus.FAILED, FinishReason.ERROR
                request.error = error
                self._unreported.append(request)
                continue
            params = request.params
            request.max_new_tokens = min(
                params.max_tokens, self.config.max_sequence_length - len(request.prompt)
            )
            if request.max_new_tokens == 0:
                self._finish(request, FinishReason.LENGTH)
                continue
            self._stops[request.request_id] = StopCriteria(
                params, self._decode if self.tokenizer is not None else None
            )
            self.scheduler.waiting.append(request)
        return [request.request_id for request in requests]

    def _validate(self, prompt: Any, params: Any) -> None:
        assert self.scheduler is not None
        validate_request(
            prompt,
            params,
            vocab_size=self.vocab_size,
            max_sequence_length=self.config.max_sequence_length,
            has_tokenizer=self.tokenizer is not None,
            blocks_needed=self.scheduler.blocks_needed,
            cache_blocks=self.allocator.capacity,
        )

    def _finish(self, request: Request, reason: FinishReason, *, error: str | None = None) -> None:
        if self.scheduler is not None:
            # With deferred readback (one stage) the step still holding the request runs on
            # the same stream as any later use of its blocks: they may be freed now.
            keep_blocks = request.in_flight > 0 and self._readback is None
            self.scheduler.release(request, keep_blocks=keep_blocks)
        request.finish_reason = reason
        request.status = (
            RequestStatus.FAILED if reason == FinishReason.ERROR else RequestStatus.FINISHED
        )
        request.error = error
        self._stops.pop(request.request_id, None)
        self._unreported.append(request)

    def _drop(self, request_ids: set[int]) -> None:
        # The caller left before these requests ended (a stream closed early, an exception):
        # nobody will read them, so they must not keep KV blocks and run on in later steps.
        assert self.scheduler is not None
        for request_id in request_ids:
            request = self.scheduler.find(request_id)
            if request is not None:
                self._finish(request, FinishReason.ABORTED)
        self._unreported = [r for r in self._unreported if r.request_id not in request_ids]

    def _add_share(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[int]:
        """Add this replica's share of the prompts (all of them without data parallelism)."""
        params_list = params_per_prompt(len(prompts), params)
        if self.groups.dp_group is None:
            return self._add_requests(list(prompts), params_list)
        # Every replica draws every seed, so a request's seed does not depend on the split.
        drawn = [self._seed_source.getrandbits(63) for _ in prompts]
        share = self.groups.my_share(len(prompts))
        return self._add_requests(
            [prompts[i] for i in share], [params_list[i] for i in share], [drawn[i] for i in share]
        )

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def _snapshot(self, request: Request) -> GenerationResult:
        text = self._decode(request.output) if self.tokenizer is not None else None
        return request.result(text)
