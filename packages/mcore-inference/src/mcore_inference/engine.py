"""InferenceEngine: continuous batching with chunked prefill over a paged KV cache, on any layout."""

from __future__ import annotations

import gc
import logging
import random
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any

import torch

from mcore_inference.batch import Microbatch
from mcore_inference.config import InferenceConfig, SamplingParams
from mcore_inference.describe import describe_engine, release_symmetric_memory
from mcore_inference.distributed import EngineGroups
from mcore_inference.engine_cache import build_engine_cache
from mcore_inference.engine_step import _StepLoop, build_stage_runner
from mcore_inference.errors import InvalidRequestError, UnsupportedModelError
from mcore_inference.fused_decode import FusedDecoder, build_fused_decoder
from mcore_inference.kv_cache import PagedKVCache
from mcore_inference.mamba_state import MambaStateCache, has_mamba_layers
from mcore_inference.multi_step import RunBuffers
from mcore_inference.readback import DeferredSamples, SampleReadback
from mcore_inference.request import (
    FinishReason,
    GenerationResult,
    Request,
    RequestStatus,
    TokenUpdate,
)
from mcore_inference.scheduler import Scheduler
from mcore_inference.stage import StageRunner
from mcore_inference.stopping import StopCriteria
from mcore_inference.tokenizer import load_tokenizer
from mcore_inference.warmup import warm_up_engine
from mcore_inference.weights import WeightSource, update_weights_in_place, whole_model_names

if TYPE_CHECKING:
    from mcore_parallel.state import ParallelState

__all__ = ["InferenceEngine"]

logger = logging.getLogger("mcore_inference")


class InferenceEngine(_StepLoop):
    """Serves generation requests on a ``GPTModel`` with continuous batching, on any layout.

    Each :meth:`step` admits waiting requests whose whole KV footprint (prompt plus
    ``max_tokens``) fits in free blocks, so an admitted request never runs out of cache; gives
    decoding requests one token; then fills the rest of the token budget with prefill chunks;
    runs one forward over all those tokens flattened in one row; samples the requests whose
    tokens are all computed; and retires the finished ones. Requests join and leave between
    steps.

    The engine owns the KV cache, the decode CUDA graphs and their memory pool; the model is
    only called (its modules are never changed). Weights may be updated in place between calls
    (:meth:`update_weights`; graphs see the new values); if they are re-allocated (offloaded and
    reloaded), the graphs are dropped and recaptured at the next call. :meth:`close` (or leaving
    the ``with`` block) releases all of it, symmetric-memory buffers included.

    **Parallel layouts.** Pass the ``state`` the model was parallelized with
    (``mcore_models.parallelize``). The ranks of one model replica (``tp x pp``) serve the same
    requests with the same schedule: every rank of the replica calls the same methods with the
    same arguments; new requests are validated on every rank and fail on all of them when they
    fail on one (or differ between ranks); tokens are sampled on tensor rank 0 of the last
    pipeline stage and broadcast. The KV cache holds only this rank's key/value heads (TP) and
    layers (PP). Under pipeline parallelism each step moves every stage's microbatch one stage
    on: the decoding requests are split into ``pp`` groups that follow each other through the
    stages, so every stage works in every step (see docs/user-guide/inference.md). Under data
    parallelism (``state.dp_size > 1``) :meth:`generate` is collective over the DP group: every
    replica is given the same prompts, serves those of index ``i`` with ``i % dp == dp_rank``
    and every rank returns all results in input order.

    Under expert parallelism (MoE layers with an EP group of more than one rank, and an ETP
    group) every step is collective over the EP (and ETP) groups: the ranks agree on the step in
    one small all-reduce, a rank without work runs a padding-only forward (token 0 at position
    0 in the scratch block, touching no request's cache) while a peer still has tokens, and
    :meth:`generate` returns on all of them at the first step in which no rank has work. Every
    EP rank must therefore call :meth:`generate` (possibly with no prompts) or :meth:`stream`
    the same number of times. Decode CUDA graphs are replayed only when every rank can and all
    have the same graph batch sizes, with the bucket of the largest batch.

    Args:
        model: A ``mcore_models.GPTModel`` (or any module with the same forward,
            ``compute_logits``, ``layers`` and ``config``), whole or this rank's pipeline
            stage, possibly parallelized.
        config: Engine configuration (default: ``InferenceConfig()``).
        state: The ``mcore_parallel.ParallelState`` the model was parallelized with; needed
            for pipeline and data parallelism. None serves a single-rank, tensor- or
            expert-parallel model with each rank's own requests (no data-parallel split).

    Raises:
        InferenceConfigError: If the config is invalid or differs between the ranks of a
            replica.
        UnsupportedModelError: If the layout cannot be served (sequence or context
            parallelism, virtual pipeline stages, a stage without ``state``).
        TokenizerUnavailableError: If ``config.tokenizer_path`` cannot be loaded.
    """

    def __init__(
        self,
        model: Any,
        config: InferenceConfig | None = None,
        *,
        state: ParallelState | None = None,
    ) -> None:
        if getattr(model, "sequence_parallel_size", 1) > 1:
            raise UnsupportedModelError(
                f"model={type(model).__name__} is parallelized with sequence parallelism; "
                "expected parallelize(..., sequence_parallel=False) for inference (steps have "
                "any token count)"
            )
        self.model = model
        self.config = config = config if config is not None else InferenceConfig()
        model_config = model.config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.vocab_size: int = model_config.vocab_size
        self.groups = groups = EngineGroups(model, state, self.device)
        self.allocator, kv_cache = build_engine_cache(model, config, groups, self.device)
        self.kv_cache: PagedKVCache | None = kv_cache
        self.scheduler: Scheduler | None = Scheduler(config, self.allocator, self.device)
        # Batch-invariant numerics must be those of the training forward: the model's own.
        invariant = config.batch_invariant or getattr(model_config, "batch_invariant", False)
        self._decoder: FusedDecoder | None = build_fused_decoder(
            model,
            config.fused_decode and not invariant,
            pdl=config.decode_pdl,
            max_positions=config.max_sequence_length,
        )
        self.mamba_states: MambaStateCache | None = None
        """Conv/SSM state slots of the Mamba layers (hybrid models only)."""
        if has_mamba_layers(model):
            self.mamba_states = MambaStateCache(model, config.max_batch_size, self.device)
            self.scheduler.share_prefixes = False  # the Mamba state is not in the blocks
            self.scheduler.on_admit.append(self._admit_mamba_state)
            self.scheduler.on_free.append(self._release_mamba_state)
        self._runner: StageRunner | None
        self._runner, self._ep = build_stage_runner(
            model, config, groups, kv_cache, self.scheduler, self._decoder, self.mamba_states
        )
        self.tokenizer: Any = (
            load_tokenizer(config.tokenizer_path) if config.tokenizer_path is not None else None
        )
        self._seed_source = random.Random(config.seed)
        self._next_id = 0
        self._unreported: list[Request] = []
        self._stops: dict[int, StopCriteria] = {}
        self._pipeline: deque[Microbatch | None] = deque()
        # One rank per replica, one stage, no EP lockstep: sampled tokens are read one step late.
        self._readback: SampleReadback | None = (
            SampleReadback(self.device)
            if config.async_token_readback
            and groups.pp_size == 1
            and groups.replica_group is None
            and self._ep is None
            else None
        )
        self._deferred: DeferredSamples | None = None
        # Multi-step decode runs where the readback is one step late and no Mamba state moves.
        self._multi_step = (
            config.multi_step_decode
            if self._readback is not None and self.mamba_states is None
            else 1
        )
        self._run_buffers = RunBuffers(self.device)
        self._stage_input: torch.Tensor | None = None
        self._weight_names: set[str] | None = None
        self._closed = False
        self._description = describe_engine(self)
        logger.info("InferenceEngine: %s", self._description)

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
        """Under expert parallelism, whether any EP rank had work in the last step.

        Always False without expert parallelism. A loop over :meth:`step` under expert
        parallelism runs until neither :meth:`has_unfinished` nor this is true, after at least
        one step.
        """
        return self._ep is not None and self._ep.group_has_work

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, active, in the pipeline, or not yet reported.

        Returns:
            True if :meth:`step` has work to do or results to report.
        """
        return bool(
            self.num_waiting or self.num_active or self._unreported or self._pipeline_busy()
        )

    def describe(self) -> dict[str, Any]:
        """How this engine runs: layout, cache, CUDA graphs and the TP communication path.

        Returns:
            A dict (also logged at INFO on the ``mcore_inference`` logger at construction)
            with keys ``tp``, ``pp``, ``dp``, ``ep``, ``etp``, ``kv_cache``, ``cuda_graphs``,
            ``tp_communication`` (``"fused_rs_add_rmsnorm_ag (symmetric memory)"``,
            ``"fused_rs_add_rmsnorm_ag (NCCL collectives: <reason>)"``, ``"all-reduce
            (<reason>)"`` or ``"none"``) and ``pipeline_schedule``.
        """
        return dict(self._description)

    def close(self) -> None:
        """Abort every request and release the KV cache, CUDA graphs and their memory pool.

        Idempotent. Afterwards weak references to the cache and graph objects die at the next
        ``gc.collect()`` and the engine's device memory is back with the allocator; the
        symmetric-memory buffers of the fused TP collective are released too (a later fused
        call, e.g. by another engine on the same group, builds them again).
        """
        if self._closed:
            return
        self._closed = True
        self._unreported.clear()
        self._stops.clear()
        self._pipeline.clear()
        self._deferred = None
        self._stage_input = None
        self._sample_buffers = None
        self._run_buffers = RunBuffers(self.device)  # the old buffers' memory goes back
        self._ep = None
        self._decoder = None
        if self._runner is not None:
            if self._runner.graphs is not None:
                self._runner.graphs.close()
            self._runner.close()
            self._runner = None
        if self.kv_cache is not None:
            self.kv_cache.clear_step()
            self.kv_cache = None
        if self.mamba_states is not None:
            self.mamba_states.close()
            self.mamba_states = None
        if self.scheduler is not None:
            self.scheduler.clear()
            self.scheduler = None
        if self.device.type == "cuda" and self.groups.tp_group is not None:
            release_symmetric_memory(self.groups.tp_group)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------- weights

    def update_weights(self, weights: WeightSource) -> int:
        """Copy new weights into the live model in place (same storages: graphs stay valid).

        Weights may come in any layout: each entry is keyed by the parameter's canonical name
        in the whole model (``"layers.3.mlp.up_proj.weight"``) and is a full tensor, a
        ``mcore_parallel.sharding.ShardedTensor`` (a block with its global offset), or a list
        of such blocks (e.g. the shards of every rank of a trainer with another TP layout).
        Each local parameter (this rank's block of its global tensor) receives the intersection
        with every given block. Everything is checked before the first copy: unknown names,
        global shapes, dtypes, and that the blocks cover every local parameter entirely; on
        any mismatch a :class:`~mcore_inference.errors.WeightUpdateError` is raised and the
        old weights are intact. Names of parameters held by other pipeline stages or expert
        ranks are accepted and skipped.

        Call it between steps (not while a pipeline step runs on another rank of the replica);
        it is local (no collective).

        Args:
            weights: A mapping or iterable of ``(name, tensor | ShardedTensor | list)``.

        Returns:
            The number of local parameters updated (all of them).

        Raises:
            EngineClosedError: If the engine is closed.
            WeightUpdateError: If the weights do not fit the model (nothing is copied).
        """
        self._check_open()
        if self._weight_names is None:
            self._weight_names = whole_model_names(self.model)
        updated = update_weights_in_place(self.model, weights, known_names=self._weight_names)
        if self._decoder is not None:
            self._decoder.refresh_now()
        return updated

    # ------------------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request.

        An invalid request (empty prompt, token ids outside the vocabulary, a prompt longer
        than ``max_sequence_length``, invalid parameters, a footprint larger than the whole
        cache) does not raise: it is recorded as FAILED with finish reason ``error`` and a
        message, and reported by the next :meth:`step`, so the other requests go on. On a
        model replica of several ranks this is collective: every rank adds the same request.

        Args:
            prompt: Prompt token ids (a list, tuple or 1-D integer tensor).
            params: Sampling parameters (default: ``SamplingParams()``).

        Returns:
            The request id.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        return self._add_requests([prompt], [params])[0]

    def add_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams | None]
    ) -> list[int]:
        """Queue several requests at once, as :meth:`add_request` does one by one.

        The same ids, seeds and queue order as successive :meth:`add_request` calls; on a model
        replica of several ranks the ranks agree on all of them in one collective.

        Args:
            prompts: Prompt token ids of each request.
            params: Sampling parameters of each request (None: ``SamplingParams()``).

        Returns:
            The request ids, in order.

        Raises:
            EngineClosedError: If the engine is closed.
            InvalidRequestError: If ``prompts`` and ``params`` differ in length.
        """
        self._check_open()
        if len(prompts) != len(params):
            raise InvalidRequestError(
                f"params has {len(params)} entries; expected one per prompt ({len(prompts)})"
            )
        return self._add_requests(list(prompts), list(params))

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or active request and free its blocks.

        Its final result (status FINISHED, finish reason ``aborted``) is reported by the next
        :meth:`step`. On a model replica of several ranks, call it on every rank between the
        same steps. Blocks still written by a microbatch in the pipeline are freed when it
        leaves the last stage.

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

    # --------------------------------------------------------------------------------- steps

    def step(self) -> list[GenerationResult]:
        """Run one engine step.

        Collective over the model replica (every rank calls it) and, under expert
        parallelism, over the EP group: every EP rank calls it, also without work of its own,
        until no rank has any (see :attr:`group_has_work`).

        Returns:
            Snapshots of the requests that got a token or finished (or failed) in this step;
            a finished request is reported once and then forgotten by the engine.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        self._revalidate_graphs(per_step=True)
        return [self._snapshot(r) for r in self._step(progress=True)]

    def step_updates(self, *, check_weights: bool = True) -> list[TokenUpdate]:
        """Run one engine step and report only what changed (for token streaming).

        Like :meth:`step`, but instead of a full snapshot of every request that progressed
        (prompt and all tokens copied at every step) each update holds the tokens generated
        since the request's previous update; the full result comes once, when it finishes.

        Args:
            check_weights: Look for changed or moved weights before the step (one pass over
                every parameter, a measurable share of a small model's step). A serving loop
                that owns the model and never changes it passes False after its first step.

        Returns:
            One update per request that got a token or finished (or failed) in this step.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        if check_weights:
            self._revalidate_graphs(per_step=True)
        return self._token_updates(self._step(progress=True))

    def capture_graphs(self) -> int:
        """Capture every decode CUDA graph now rather than at the first step that needs it.

        For a server (``mcore-inference serve`` does it at startup): requests arriving one by
        one make the decode batch size pass through many buckets, and each lazy capture stalls
        every running request. With ``cuda_graph_mixed_steps`` the graphs that steps which
        prefill replay are captured too, where they are not the decode graphs (buckets of
        ``fused_decode.ROTARY_IN_ATTENTION_MIN_ROWS`` rows and more). A hybrid (Mamba) model
        captures its decode and non-decode graphs. Then, on a CUDA device, :meth:`warm_up` runs
        every kernel variant of the eager steps. Collective over the model replica like
        :meth:`step` (and over the expert-parallel group).

        Returns:
            The number of graphs captured (0 without graphs: on the CPU, with
            ``use_cuda_graphs=False``, or on a hybrid model's pipeline stage).

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        self._revalidate_graphs()
        graphs = self._graphs
        # Steps that prefill replay the decode graphs where the runner lets them.
        mixed = self._runner is not None and self._runner.graph_mixed_steps
        captured = graphs.capture_all(mixed_steps=mixed) if graphs is not None else 0
        hybrid = self._runner.hybrid_graphs if self._runner is not None else None
        if hybrid is not None:
            captured += hybrid.capture_all()
        if self.device.type == "cuda":
            self.warm_up()
        return captured

    def warm_up(self) -> int:
        """Run every kernel variant of the eager steps and of the sampler once.

        Triton compiles a kernel per specialisation (see :mod:`mcore_inference.warmup`); a
        compile in a step stalls every running request. :meth:`capture_graphs` calls it on a
        CUDA device, after capturing the graphs (which compile their own variants).

        Every layout is warmed (see :mod:`mcore_inference.warmup`): pipeline stages, hybrid
        (Mamba) models, expert-parallel ranks. Collective like :meth:`step`: every rank of the
        model replica and of the expert-parallel group calls it.

        Returns:
            The number of forwards this rank ran.

        Raises:
            EngineClosedError: If the engine is closed.
        """
        self._check_open()
        return warm_up_engine(self)

    # ---------------------------------------------------------------------------- generation

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

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt and wait until all are done.

        Collective over the model replica (every rank passes the same prompts). Under data
        parallelism (an engine built with a ``state`` of ``dp_size > 1``) collective over the
        DP group too: every replica passes the same prompts, serves its share and returns all
        results. Under expert parallelism without data-parallel sharing, every EP rank calls
        it (with its own prompts, possibly none) and it returns when no rank has work left.

        Args:
            prompts: Prompt token ids, one list per request.
            params: One SamplingParams for all, one per prompt, or None for the defaults.

        Returns:
            One result per prompt, in the order of ``prompts``. Invalid requests come back
            FAILED with a message; the others are unaffected. Under data parallelism the
            ``request_id`` of a result is the one of the replica that served it.

        Raises:
            EngineClosedError: If the engine is closed.
            InvalidRequestError: If ``params`` is a list whose length differs from ``prompts``.
        """
        self._check_open()
        self._revalidate_graphs()
        ids = self._add_share(prompts, params)
        finals: dict[int, GenerationResult] = {}
        with closing(self._drive(ids, progress=False)) as steps:
            for updated in steps:
                for request in updated:
                    if request.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
                        finals[request.request_id] = self._snapshot(request)
        return self.groups.gather_over_data_parallel([finals[i] for i in ids], len(prompts))

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[GenerationResult]:
        """Generate for every prompt, yielding a snapshot whenever a request changes.

        Collective like :meth:`generate`; under data parallelism each replica yields the
        snapshots of its own share (prompts of index ``i % dp == dp_rank``).

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
        ids = self._add_share(prompts, params)
        yielded: dict[int, int] = {}
        with closing(self._drive(ids, progress=True)) as steps:
            for updated in steps:
                for request in updated:
                    # A multi-step run brings several tokens at once: one snapshot per token.
                    start = yielded.get(request.request_id, 0)
                    yielded[request.request_id] = len(request.output)
                    for count in range(start + 1, len(request.output)):
                        yield self._partial_snapshot(request, count)
                    yield self._snapshot(request)

    def _partial_snapshot(self, request: Request, count: int) -> GenerationResult:
        """A running request's snapshot as it was with its first ``count`` tokens."""
        tokens = request.output[:count]
        return GenerationResult(
            request_id=request.request_id,
            prompt=list(request.prompt),
            tokens=tokens,
            logprobs=request.logprobs[:count] if request.params.return_logprobs else None,
            finish_reason=None,
            status=RequestStatus.ACTIVE,
            text=self._decode(tokens) if self.tokenizer is not None else None,
        )
