"""InferenceEngine: continuous batching with chunked prefill over a paged KV cache."""

from __future__ import annotations

import gc
import random
import warnings
from array import array
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from typing import Any

import torch

from mcore_inference.block_allocator import BlockAllocator
from mcore_inference.config import InferenceConfig, SamplingParams
from mcore_inference.cuda_graphs import DecodeGraphRunner
from mcore_inference.errors import EngineClosedError, InvalidRequestError, UnsupportedModelError
from mcore_inference.expert_parallel import ExpertParallelSync, find_expert_parallel_group
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.request import (
    FinishReason,
    GenerationResult,
    Request,
    RequestStatus,
    TokenUpdate,
)
from mcore_inference.sampling import sample_tokens, sampling_uniform
from mcore_inference.scheduler import Scheduler
from mcore_inference.stopping import StopCriteria
from mcore_inference.tokenizer import load_tokenizer
from mcore_kernels import token_logprobs

__all__ = ["InferenceEngine"]


class InferenceEngine:
    """Serves generation requests on a ``GPTModel`` with continuous batching.

    Each :meth:`step` admits waiting requests whose whole KV footprint (prompt plus
    ``max_tokens``) fits in free blocks, so an admitted request never runs out of cache; gives
    every decoding request one token; then fills the rest of the token budget with prefill
    chunks; runs one forward over all those tokens flattened in one row; samples the requests
    whose tokens are all computed; and retires the finished ones. Requests join and leave
    between steps.

    The engine owns the KV cache, the decode CUDA graphs and their memory pool; the model is
    only called (its modules are never changed). Weights may be updated in place between
    calls (graphs see the new values); if they are re-allocated (offloaded and reloaded), the
    graphs are dropped and recaptured at the next call. :meth:`close` (or leaving the ``with`` block)
    releases all of it.

    Under expert parallelism (the model's MoE layers hold an EP group of more than one rank)
    every step is collective over the EP group: the ranks agree on the step in one small
    all-reduce, a rank without work runs a padding-only forward (token 0 at position 0 in the
    scratch block, touching no request's cache) while a peer still has tokens, and
    :meth:`generate` returns on all of them at the first step in which no rank has work. Every
    EP rank must therefore call :meth:`generate` (possibly with no prompts) or :meth:`stream`
    the same number of times. Decode CUDA graphs are replayed only when every rank can and all
    have the same graph batch sizes (the same ``max_batch_size`` and
    ``cuda_graph_batch_sizes``), with the bucket of the largest batch; drop-and-pad MoE
    routing gets the same token count on every rank.

    Args:
        model: A single-rank ``mcore_models.GPTModel`` (or any module with the same forward,
            ``compute_logits`` and ``config``).
        config: Engine configuration (default: ``InferenceConfig()``).

    Raises:
        InferenceConfigError: If the config is invalid.
        UnsupportedModelError: If the model is sharded over a tensor-parallel group.
        TokenizerUnavailableError: If ``config.tokenizer_path`` cannot be loaded.
    """

    def __init__(self, model: Any, config: InferenceConfig | None = None) -> None:
        tp_group = getattr(model, "tp_group", None)
        if tp_group is not None:
            # The cache is sized for every KV head of the config, a TP rank computes only its
            # share: every step would fail. Refuse at once instead.
            raise UnsupportedModelError(
                f"model={type(model).__name__} is sharded over a tensor-parallel group of "
                f"{torch.distributed.get_world_size(tp_group)} ranks; expected a single-rank "
                "or expert-parallel model"
            )
        self.model = model
        self.config = config = config if config is not None else InferenceConfig()
        model_config = model.config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.vocab_size: int = model_config.vocab_size
        kv_dtype = config.kv_dtype or parameter.dtype
        num_kv_heads, head_dim = model_config.num_kv_heads, model_config.kv_channels
        bytes_per_block = (
            2
            * model_config.num_layers
            * config.block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=kv_dtype).element_size()
        )
        if config.num_blocks is not None:
            usable = config.num_blocks
        elif config.kv_memory_bytes is not None:
            usable = max(1, config.kv_memory_bytes // bytes_per_block)
        else:
            usable = config.max_batch_size * config.max_blocks_per_sequence
        self.allocator = BlockAllocator(usable + 1)
        self.kv_cache: PagedKVCache | None = PagedKVCache(
            num_layers=model_config.num_layers,
            num_blocks=usable + 1,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=kv_dtype,
            device=self.device,
            split_size=config.attention_split_size,
        )
        self.scheduler: Scheduler | None = Scheduler(config, self.allocator, self.device)
        self._graphs: DecodeGraphRunner | None = None
        if config.use_cuda_graphs and self.device.type == "cuda":
            self._graphs = DecodeGraphRunner(
                model,
                self.kv_cache,
                self.scheduler.block_tables,
                self.scheduler.padding_row,
                config.graph_batch_sizes(),
            )
        ep_group = find_expert_parallel_group(model)
        self._ep: ExpertParallelSync | None = (
            ExpertParallelSync(model, ep_group, self.device) if ep_group is not None else None
        )
        self.tokenizer: Any = (
            load_tokenizer(config.tokenizer_path) if config.tokenizer_path is not None else None
        )
        self._seed_source = random.Random(config.seed)
        self._next_id = 0
        self._unreported: list[Request] = []
        self._stops: dict[int, StopCriteria] = {}
        self._closed = False

    # ----------------------------------------------------------------------------- lifecycle

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def num_waiting(self) -> int:
        """Requests queued for KV blocks."""
        return len(self.scheduler.waiting) if self.scheduler is not None else 0

    @property
    def num_active(self) -> int:
        """Requests holding KV blocks."""
        return len(self.scheduler.active) if self.scheduler is not None else 0

    @property
    def group_has_work(self) -> bool:
        """Under expert parallelism, whether any EP rank ran tokens in the last step.

        Always False without expert parallelism. A loop over :meth:`step` under expert
        parallelism runs until neither :meth:`has_unfinished` nor this is true, after at least
        one step.
        """
        return self._ep is not None and self._ep.group_has_work

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, active, or finished but not yet reported.

        Returns:
            True if :meth:`step` has work to do or results to report.
        """
        return bool(self.num_waiting or self.num_active or self._unreported)

    def close(self) -> None:
        """Abort every request and release the KV cache, CUDA graphs and their memory pool.

        Idempotent. Afterwards weak references to the cache and graph objects die at the next
        ``gc.collect()`` and the engine's device memory is back with the allocator.
        """
        if self._closed:
            return
        self._closed = True
        self._unreported.clear()
        self._stops.clear()
        self._ep = None
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None
        if self.kv_cache is not None:
            self.kv_cache.clear_step()
            self.kv_cache = None
        if self.scheduler is not None:
            self.scheduler.clear()
            self.scheduler = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; build a new InferenceEngine")

    # ------------------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request.

        An invalid request (empty prompt, token ids outside the vocabulary, a prompt longer
        than ``max_sequence_length``, invalid parameters, a footprint larger than the whole
        cache) does not raise: it is recorded as FAILED with finish reason ``error`` and a
        message, and reported by the next :meth:`step`, so the other requests go on.

        Args:
            prompt: Prompt token ids (a list, tuple or 1-D integer tensor).
            params: Sampling parameters (default: ``SamplingParams()``).

        Returns:
            The request id.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        request_id = self._next_id
        self._next_id += 1
        params = params if params is not None else SamplingParams()
        if (
            isinstance(prompt, torch.Tensor)
            and prompt.dim() == 1
            and not prompt.is_floating_point()
        ):
            prompt = prompt.tolist()
        prompt_list = list(prompt) if isinstance(prompt, (list, tuple)) else prompt
        valid_params = isinstance(params, SamplingParams)
        request = Request(
            request_id=request_id,
            prompt=prompt_list if isinstance(prompt_list, list) else [],
            params=params if valid_params else SamplingParams(),
            seed=self._request_seed(params if valid_params else None),
            max_new_tokens=0,
        )
        try:
            self._validate(prompt_list, params)
        except InvalidRequestError as exc:
            request.status, request.finish_reason = RequestStatus.FAILED, FinishReason.ERROR
            request.error = str(exc)
            self._unreported.append(request)
            return request_id
        request.max_new_tokens = min(
            params.max_tokens, self.config.max_sequence_length - len(request.prompt)
        )
        if request.max_new_tokens == 0:
            self._finish(request, FinishReason.LENGTH)
            return request_id
        self._stops[request_id] = StopCriteria(
            params, self._decode if self.tokenizer is not None else None
        )
        assert self.scheduler is not None
        self.scheduler.waiting.append(request)
        return request_id

    def _request_seed(self, params: SamplingParams | None) -> int:
        # Drawn for every request (seeded or not), so unseeded requests get the same seeds
        # whatever the seeds of the others.
        drawn = self._seed_source.getrandbits(63)
        return params.seed if params is not None and params.seed is not None else drawn

    def _validate(self, prompt: Any, params: Any) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params={params!r}; expected a SamplingParams")
        params.validate()
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError(f"prompt={prompt!r}; expected a non-empty list of token ids")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
        bad += [t for t in prompt if isinstance(t, int) and not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token {bad[0]!r}; expected integer ids in [0, {self.vocab_size})"
            )
        limit = self.config.max_sequence_length
        if len(prompt) > limit:
            raise InvalidRequestError(
                f"prompt length {len(prompt)}; expected at most max_sequence_length={limit}"
            )
        if self.tokenizer is None and any(isinstance(w, str) for w in params.stop_words):
            raise InvalidRequestError(
                f"stop_words={params.stop_words!r} holds strings; expected token sequences or "
                "an engine with tokenizer_path"
            )
        new_tokens = min(params.max_tokens, limit - len(prompt))
        assert self.scheduler is not None
        needed = self.scheduler.blocks_needed(len(prompt), new_tokens)
        if needed > self.allocator.capacity:
            raise InvalidRequestError(
                f"prompt length {len(prompt)} + max_tokens {new_tokens} needs {needed} KV blocks; "
                f"expected at most the cache's {self.allocator.capacity}"
            )

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or active request and free its blocks.

        Its final result (status FINISHED, finish reason ``aborted``) is reported by the next
        :meth:`step`.

        Args:
            request_id: Id from :meth:`add_request`.

        Returns:
            True if the request was running or waiting, False if unknown or already done.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        assert self.scheduler is not None
        request = self.scheduler.find(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORTED)
        return True

    def _finish(self, request: Request, reason: FinishReason, *, error: str | None = None) -> None:
        if self.scheduler is not None:
            self.scheduler.release(request)
        request.finish_reason = reason
        request.status = (
            RequestStatus.FAILED if reason == FinishReason.ERROR else RequestStatus.FINISHED
        )
        request.error = error
        self._stops.pop(request.request_id, None)
        self._unreported.append(request)

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def _snapshot(self, request: Request) -> GenerationResult:
        text = self._decode(request.output) if self.tokenizer is not None else None
        return request.result(text)

    # --------------------------------------------------------------------------------- steps

    def step(self) -> list[GenerationResult]:
        """Run one engine step.

        Under expert parallelism the step is collective over the EP group: every EP rank
        calls it, also without work of its own, until no rank has any (see
        :attr:`group_has_work`).

        Returns:
            Snapshots of the requests that got a token or finished (or failed) in this step;
            a finished request is reported once and then forgotten by the engine.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        self._revalidate_graphs()
        return [self._snapshot(r) for r in self._step(progress=True)]

    def step_updates(self) -> list[TokenUpdate]:
        """Run one engine step and report only what changed (for token streaming).

        Like :meth:`step`, but instead of a full snapshot of every request that progressed
        (prompt and all tokens copied at every step) each update holds the tokens generated
        since the request's previous update; the full result comes once, when it finishes.

        Returns:
            One update per request that got a token or finished (or failed) in this step.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        self._revalidate_graphs()
        updates = []
        for request in self._step(progress=True):
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

    def _revalidate_graphs(self) -> None:
        # Once per public call, not per step: weights cannot move while the engine runs.
        if self._graphs is not None:
            self._graphs.drop_if_weights_moved()

    def _step(self, *, progress: bool) -> list[Request]:
        """One step; returns the finished requests, plus the ones that got a token if ``progress``."""
        reports, self._unreported = self._unreported, []
        assert self.scheduler is not None
        self.scheduler.admit()
        batch = self.scheduler.schedule()
        if not batch and self._ep is None:
            return reports
        try:
            sampled = self._forward_and_sample(batch)
        except Exception as exc:  # a failed step fails its requests, never the engine
            if not batch:  # an idle EP rank's padding forward failed: nothing to fail but it
                self._unreported = reports + self._unreported
                raise
            message = f"step failed: {type(exc).__name__}: {exc}"
            for request, _ in batch:
                self._finish(request, FinishReason.ERROR, error=message)
            if self.kv_cache is not None:
                self.kv_cache.clear_step()
            reports += self._unreported
            self._unreported = []
            return reports
        for request, count in batch:
            request.num_computed += count
        stops = self._stops
        for request, token, logprob in sampled:
            output = request.output
            output.append(token)
            if logprob is not None:
                request.logprobs.append(logprob)
            criteria = stops[request.request_id]
            reason = criteria.check(output) if criteria.active else None
            if reason is None and len(output) >= request.max_new_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(request, reason)
            elif progress:
                reports.append(request)
        reports += self._unreported
        self._unreported = []
        return reports

    @torch.no_grad()
    def _forward_and_sample(
        self, batch: list[tuple[Request, int]]
    ) -> list[tuple[Request, int, float | None]]:
        assert self.kv_cache is not None and self.scheduler is not None
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        for request, count in batch:
            start = request.num_computed
            end = start + count
            prompt, output = request.prompt, request.output
            num_tokens = len(prompt) + len(output)
            if end == num_tokens and count == 1:  # decode: feed the newest token
                tokens.append(output[-1] if output else prompt[-1])
                positions.append(start)
                slots.append(request.slot)
            else:
                tokens.extend((prompt + output)[start:end])
                positions.extend(range(start, end))
                slots.extend([request.slot] * count)
            if end == num_tokens:
                sample_rows.append(len(tokens) - 1)
                sampling.append(request)
        device = self.device
        graphs = self._graphs
        use_graphs = graphs is not None and len(tokens) == len(batch) <= graphs.max_batch_size
        num_real = len(tokens)
        pad_to = num_real
        if self._ep is not None:
            agreement = self._ep.agree(
                num_real, graphs.batch_sizes if use_graphs and graphs is not None else None
            )
            if agreement.max_tokens == 0:
                return []
            use_graphs = agreement.use_graphs
            if use_graphs or self._ep.needs_equal_tokens:
                pad_to = agreement.max_tokens
            else:
                pad_to = max(num_real, 1)
            if pad_to > num_real:
                # Padding rows: token 0 at position 0 through the scratch-block table row.
                padding = pad_to - num_real
                tokens.extend([0] * padding)
                positions.extend([0] * padding)
                slots.extend([self.scheduler.padding_row] * padding)
        # array('q') converts the lists in C; torch.tensor over nested lists is several times slower.
        packed = array("q", tokens)
        packed.extend(positions)
        packed.extend(slots)
        inputs = torch.frombuffer(packed, dtype=torch.long).view(3, len(tokens)).to(device)
        logits = None
        if use_graphs and graphs is not None:
            try:
                logits = graphs.run(inputs)[:num_real]
            except Exception as exc:
                # A model that cannot be captured still serves, eagerly; the warning says why.
                warnings.warn(
                    f"CUDA graph decode failed ({type(exc).__name__}: {exc}); the engine "
                    "decodes eagerly from now on",
                    RuntimeWarning,
                    stacklevel=2,
                )
                graphs.close()
                self._graphs = None
        if logits is None:
            self.kv_cache.prepare_step(
                self.scheduler.block_tables, inputs[1], inputs[2], max_context=max(positions) + 1
            )
            try:
                hidden = self.model(
                    inputs[0][None], inputs[1][None], kv_cache=self.kv_cache, return_hidden=True
                )
            finally:
                self.kv_cache.clear_step()
            if not sampling:
                return []
            rows = torch.tensor(sample_rows, dtype=torch.long, device=device)
            logits = self.model.compute_logits(hidden[0].index_select(0, rows))
        elif not sampling:  # an idle EP rank replayed a padding-only graph
            return []
        params = [r.params for r in sampling]
        uniforms = [
            sampling_uniform(r.seed, len(r.output)) if p.temperature else 0.0
            for r, p in zip(sampling, params)
        ]
        new_tokens = sample_tokens(logits, params, uniforms)
        logprob_rows = [i for i, p in enumerate(params) if p.return_logprobs]
        logprobs: dict[int, float] = {}
        if logprob_rows:
            index = torch.tensor(logprob_rows, dtype=torch.long, device=device)
            temperatures = torch.tensor(
                [params[i].temperature or 1.0 for i in logprob_rows], device=device
            )
            # logprobs of the sampling distribution at the request's temperature (greedy: 1).
            values = token_logprobs(
                logits.index_select(0, index).float() / temperatures[:, None],
                new_tokens.index_select(0, index),
            )
            assert isinstance(values, torch.Tensor)
            logprobs = dict(zip(logprob_rows, values.tolist()))
        token_list = new_tokens.tolist()
        return [(r, token_list[i], logprobs.get(i)) for i, r in enumerate(sampling)]

    # ---------------------------------------------------------------------------- generation

    def _params_list(
        self, count: int, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams | None]:
        if params is None or isinstance(params, SamplingParams):
            return [params] * count
        params_list = list(params)
        if len(params_list) != count:
            raise InvalidRequestError(
                f"params has {len(params_list)} entries; expected one per prompt ({count})"
            )
        return list(params_list)

    def _drive(
        self, request_ids: list[int], *, progress: bool
    ) -> Generator[list[Request], None, None]:
        pending = set(request_ids)
        others: list[Request] = []
        # Under expert parallelism a rank steps (at least once) until no EP rank has work,
        # so every rank runs the same number of forwards and returns at the same step.
        synced = self._ep is not None
        try:
            while pending or synced:
                if pending and not self.has_unfinished():
                    raise RuntimeError(f"requests {sorted(pending)} were lost by the engine")
                mine = []
                for request in self._step(progress=progress):
                    if request.request_id in pending:
                        mine.append(request)
                        if request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
                            pending.discard(request.request_id)
                    elif request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
                        others.append(request)
                yield mine
                if synced and not pending and not self.group_has_work:
                    break
        finally:
            # Requests added through add_request by the caller keep their final report.
            self._unreported.extend(others)
            if pending and not self._closed:
                self._drop(pending)

    def _drop(self, request_ids: set[int]) -> None:
        # The caller left before these requests ended (a stream closed early, an exception):
        # nobody will read them, so they must not keep KV blocks and run on in later steps.
        assert self.scheduler is not None
        for request_id in request_ids:
            request = self.scheduler.find(request_id)
            if request is not None:
                self._finish(request, FinishReason.ABORTED)
        self._unreported = [r for r in self._unreported if r.request_id not in request_ids]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt and wait until all are done.

        Under expert parallelism this is collective over the EP group: every EP rank calls it
        (with its own prompts, possibly none) and it returns when no rank has work left.

        Args:
            prompts: Prompt token ids, one list per request.
            params: One SamplingParams for all, one per prompt, or None for the defaults.

        Returns:
            One result per prompt, in the order of ``prompts``. Invalid requests come back
            FAILED with a message; the others are unaffected.

        Raises:
            EngineClosedError: If the engine is closed.
            InvalidRequestError: If ``params`` is a list whose length differs from ``prompts``.
        """
        self._check_open()
        self._revalidate_graphs()
        params_list = self._params_list(len(prompts), params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        finals: dict[int, GenerationResult] = {}
        with closing(self._drive(ids, progress=False)) as steps:
            for updated in steps:
                for request in updated:
                    if request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
                        finals[request.request_id] = self._snapshot(request)
        return [finals[i] for i in ids]

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[GenerationResult]:
        """Generate for every prompt, yielding a snapshot whenever a request changes.

        Under expert parallelism this is collective over the EP group, like :meth:`generate`.

        Args:
            prompts: Prompt token ids, one list per request.
            params: One SamplingParams for all, one per prompt, or None for the defaults.

        Yields:
            A result snapshot of a request after each new token; its last snapshot has
            ``done`` True. Requests are identified by ``request_id``, in the order of
            ``prompts`` starting at the first id returned. Closing the iterator early (a
            ``break`` out of the loop) aborts the unfinished requests and frees their blocks.

        Raises:
            EngineClosedError: If the engine is closed.
            InvalidRequestError: If ``params`` is a list whose length differs from ``prompts``.
        """
        self._check_open()
        self._revalidate_graphs()
        params_list = self._params_list(len(prompts), params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        with closing(self._drive(ids, progress=True)) as steps:
            for updated in steps:
                for request in updated:
                    yield self._snapshot(request)
