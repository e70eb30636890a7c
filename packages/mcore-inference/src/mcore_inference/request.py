"""Request lifecycle: status, finish reasons, the engine's per-request state and its result."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mcore_inference.config import SamplingParams

__all__ = ["FinishReason", "GenerationResult", "Request", "RequestStatus", "TokenUpdate"]


class RequestStatus(str, enum.Enum):
    """Where a request is in its lifecycle (values are the upper-case names)."""

    WAITING = "WAITING"
    """Queued: no KV blocks yet."""
    ACTIVE = "ACTIVE"
    """Holding KV blocks: prefilling or decoding."""
    FINISHED = "FINISHED"
    """Done (length, stop token, stop word or aborted); its blocks are free."""
    FAILED = "FAILED"
    """Rejected or broken by an error; ``GenerationResult.error`` says why."""


class FinishReason(str, enum.Enum):
    """Why a request stopped (values are the lower-case names, e.g. ``"stop_word"``)."""

    LENGTH = "length"
    """``max_tokens`` generated or ``max_sequence_length`` reached."""
    STOP_TOKEN = "stop_token"
    """A token of ``stop_token_ids`` was generated (and kept)."""
    STOP_WORD = "stop_word"
    """The generated tokens end with a stop word (kept)."""
    ABORTED = "aborted"
    """:meth:`mcore_inference.InferenceEngine.abort` was called."""
    ERROR = "error"
    """The request was invalid or its step failed."""


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """Output of one request (a snapshot while it runs, final once finished or failed)."""

    request_id: int
    """Identifier returned by ``add_request``."""
    prompt: list[int]
    """The prompt token ids."""
    tokens: list[int]
    """Generated token ids (stop tokens and stop words included)."""
    logprobs: list[float] | None
    """Log-probability of each generated token (see SamplingParams), or None if not asked."""
    finish_reason: FinishReason | None
    """Why it stopped, None while it runs."""
    status: RequestStatus
    """Lifecycle status."""
    error: str | None = None
    """Message of the error when the status is FAILED."""
    text: str | None = None
    """Decoded generated text when the engine has a tokenizer."""

    @property
    def done(self) -> bool:
        """True once the request is finished or failed."""
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)


@dataclass(kw_only=True, slots=True)
class TokenUpdate:
    """What one request gained in one step (see ``InferenceEngine.step_updates``)."""

    request_id: int
    """Identifier returned by ``add_request``."""
    new_tokens: list[int]
    """Tokens generated since the request's previous update (usually one, possibly none)."""
    new_logprobs: list[float] | None
    """Their log-probabilities, or None if not asked."""
    result: GenerationResult | None = None
    """The final result once the request finished or failed, else None."""


@dataclass(kw_only=True, slots=True, eq=False)
class Request:
    """The engine's mutable state of one request (internal; users see GenerationResult)."""

    request_id: int
    """Identifier returned by ``add_request``."""
    prompt: list[int]
    """Prompt token ids."""
    params: SamplingParams
    """Sampling parameters."""
    seed: int
    """Seed of the sampling noise (the request's own or drawn by the engine)."""
    max_new_tokens: int
    """Tokens to generate at most, ``max_tokens`` capped by the sequence length."""
    status: RequestStatus = RequestStatus.WAITING
    """Lifecycle status."""
    output: list[int] = field(default_factory=list)
    """Generated tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probabilities of the generated tokens (when asked)."""
    blocks: list[int] = field(default_factory=list)
    """Physical KV blocks held (allocated for the whole sequence at admission)."""
    slot: int = -1
    """Row of the engine's block table while active."""
    num_computed: int = 0
    """Tokens whose keys and values are in the cache or on their way through the pipeline."""
    awaiting_token: bool = False
    """Its last scheduled tokens are still in the pipeline and will sample its next token."""
    in_flight: int = 0
    """Microbatches holding its tokens that have not left the last pipeline stage; its blocks
    are freed only when this is 0 (a later stage still writes its keys and values)."""
    finish_reason: FinishReason | None = None
    """Why it stopped."""
    error: str | None = None
    """Error message when failed."""
    num_reported: int = 0
    """Generated tokens already handed out by ``InferenceEngine.step_updates``."""
    shared_tokens: int = 0
    """Prompt tokens whose KV blocks it shares with requests of the same prompt prefix
    (``InferenceConfig.share_prompt_prefixes``); 0 when it computes its whole prompt."""
    prefix_source: Request | None = None
    """The request computing the keys and values of its shared blocks, while it has not yet
    (this request waits until then), else None."""
    deferred_index: int = -1
    """Column of its sampled, not yet read token in the engine's deferred samples (on the
    device), or -1; such a request may decode that token before the host knows it."""
    unread: int = 0
    """Tokens sampled on the device and not read back yet (0 when none; more than 1 after a
    multi-step decode run, see :mod:`mcore_inference.multi_step`). The newest of them is the one
    at ``deferred_index``."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.output)

    def result(self, text: str | None = None) -> GenerationResult:
        """Snapshot the request as a result (lists are copied).

        Args:
            text: Decoded generated text, when a tokenizer is configured.

        Returns:
            The result.
        """
        return GenerationResult(
            request_id=self.request_id,
            prompt=list(self.prompt),
            tokens=list(self.output),
            logprobs=list(self.logprobs) if self.params.return_logprobs else None,
            finish_reason=self.finish_reason,
            status=self.status,
            error=self.error,
            text=text,
        )
