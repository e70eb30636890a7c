"""One HTTP request's generation: its prompts checked and submitted, its choices followed.

:class:`GenerationJob` knows nothing of HTTP: it turns validated options into engine requests
(one per prompt and choice), then yields what each choice gained whenever the engine loop
posts new tokens, applying stop strings and detokenizing on the way. The routes turn those
deltas into JSON bodies or server-sent events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mcore_inference.config import SamplingParams
from mcore_inference.request import FinishReason, RequestStatus
from mcore_inference.serve.engine_loop import LoopFrontend, RequestHandle
from mcore_inference.serve.protocol import GenerationOptions, ProtocolError
from mcore_inference.serve.responses import ChoiceDelta, Usage
from mcore_inference.serve.text import TextStream

__all__ = ["GenerationError", "GenerationJob", "ModelLimits", "Tokenizer"]


class Tokenizer(Protocol):
    """What the server needs of a tokenizer (``mcore_inference.hf_tokenizer.HFTokenizer``)."""

    eos_token_ids: tuple[int, ...]
    """Ids that end a completion."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids.

        Args:
            text: The text.
            add_special_tokens: Whether to add the tokenizer's special tokens (a BOS).

        Returns:
            The token ids.
        """
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids to text.

        Args:
            ids: The token ids.
            skip_special_tokens: Whether to leave special tokens out of the text.

        Returns:
            The text.
        """
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render a conversation with the checkpoint's chat template.

        Args:
            messages: The conversation, ``{"role", "content"}`` mappings.
            add_generation_prompt: Whether to end with the start of an assistant turn.
            tokenize: Whether to return token ids instead of text.

        Returns:
            The rendered text, or its token ids if ``tokenize``.
        """
        ...


class GenerationError(RuntimeError):
    """The engine failed a request after it was accepted (an engine error or a shutdown)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelLimits:
    """Sizes the server checks requests against before they reach the engine."""

    vocab_size: int
    """Token ids must be below this."""
    max_sequence_length: int
    """Most tokens of one request, prompt plus completion."""
    block_size: int
    """Tokens per KV block."""
    kv_blocks: int
    """KV blocks of the whole cache (a request must fit in it)."""

    def blocks_needed(self, prompt_tokens: int, new_tokens: int) -> int:
        """KV blocks of a request's footprint (the engine's own rule).

        Args:
            prompt_tokens: Prompt length.
            new_tokens: Tokens it may generate.

        Returns:
            The number of blocks.
        """
        positions = prompt_tokens + max(new_tokens, 1) - 1
        return -(-positions // self.block_size)


@dataclass(kw_only=True, slots=True, eq=False)
class _Choice:
    index: int
    prompt_tokens: int
    stream: TextStream
    handle: RequestHandle | None = None
    consumed: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None


class GenerationJob:
    """The choices of one request, from submission to their last token.

    Args:
        loop: The server's engine loop.
        tokenizer: Decodes the generated tokens.
        prompts: Prompt token ids, one list per prompt.
        options: Validated request options.
        limits: Model and cache sizes to check the prompts against.
        prompt_param: Name of the request field holding the prompts (for error messages).
        on_first_token: Called with the time to first token of each choice, in seconds.

    Raises:
        ProtocolError: If a prompt is empty, holds an id outside the vocabulary, or does not
            fit the context or the KV cache with ``max_tokens``.
    """

    def __init__(
        self,
        *,
        loop: LoopFrontend,
        tokenizer: Tokenizer,
        prompts: Sequence[list[int]],
        options: GenerationOptions,
        limits: ModelLimits,
        prompt_param: str,
        on_first_token: Callable[[float], None] | None = None,
    ) -> None:
        self._loop = loop
        self._tokenizer = tokenizer
        self.options = options
        self._on_first_token = on_first_token
        self._notify = asyncio.Event()
        self._requests: list[tuple[list[int], SamplingParams]] = []
        self._choices: list[_Choice] = []
        self.prompt_tokens = 0
        """Prompt tokens of the request (each prompt counted once)."""
        self.failed = False
        """True once the engine failed one of the choices."""
        stop_ids = () if options.ignore_eos else tuple(tokenizer.eos_token_ids)
        for p, prompt in enumerate(prompts):
            param = prompt_param if len(prompts) == 1 else f"{prompt_param}[{p}]"
            max_tokens = self._check_prompt(prompt, options.max_tokens, limits, param)
            self.prompt_tokens += len(prompt)
            for i in range(options.n):
                seed = None if options.seed is None else options.seed + i
                params = SamplingParams(
                    temperature=options.temperature,
                    top_k=options.top_k,
                    top_p=options.top_p,
                    seed=seed,
                    max_tokens=max_tokens,
                    stop_token_ids=stop_ids,
                    return_logprobs=options.logprobs,
                )
                self._requests.append((prompt, params))
                stream = TextStream(self._decode_skipping_special, prompt[-8:], options.stop)
                index = p * options.n + i
                self._choices.append(_Choice(index=index, prompt_tokens=len(prompt), stream=stream))

    @staticmethod
    def _check_prompt(
        prompt: list[int], max_tokens: int | None, limits: ModelLimits, param: str
    ) -> int:
        if not prompt:
            raise ProtocolError(f"{param} encodes to no tokens; expected some text", param=param)
        bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ProtocolError(
                f"{param} holds token id {bad}; expected ids in [0, {limits.vocab_size})",
                param=param,
            )
        context = limits.max_sequence_length
        if len(prompt) >= context:
            raise ProtocolError(
                f"{param} has {len(prompt)} tokens; the model's context is {context} tokens "
                "(prompt plus completion), so the prompt must be shorter",
                param=param,
            )
        if max_tokens is None:
            # Fill the context, as far as the KV cache holds one request.
            fits = limits.kv_blocks * limits.block_size - len(prompt) + 1
            return max(0, min(context - len(prompt), fits))
        if len(prompt) + max_tokens > context:
            raise ProtocolError(
                f"max_tokens={max_tokens} with a prompt of {len(prompt)} tokens exceeds the "
                f"model's context of {context} tokens; expected max_tokens <= "
                f"{context - len(prompt)}",
                param="max_tokens",
            )
        needed = limits.blocks_needed(len(prompt), max_tokens)
        if needed > limits.kv_blocks:
            raise ProtocolError(
                f"max_tokens={max_tokens} with a prompt of {len(prompt)} tokens needs {needed} "
                f"KV blocks; the whole cache has {limits.kv_blocks}",
                param="max_tokens",
            )
        return max_tokens

    def _decode_skipping_special(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, all choices together (up to each one's stop)."""
        return sum(choice.consumed for choice in self._choices)

    @property
    def usage(self) -> Usage:
        """Token counts so far."""
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

    @property
    def finish_reasons(self) -> list[str]:
        """Finish reason of every choice: ``stop``, ``length``, ``error`` (the engine failed
        it) or ``abort`` (ended early, e.g. by a disconnect)."""
        unfinished = "error" if self.failed else "abort"
        return [choice.finish_reason or unfinished for choice in self._choices]

    def start(self) -> None:
        """Submit every choice to the engine loop (call it on the event loop).

        Raises:
            QueueFullError: If the engine's queue is full (nothing is submitted).
            EngineLoopStoppedError: If the loop is not running.
        """
        handles = self._loop.submit(self._requests, self._notify)
        for choice, handle in zip(self._choices, handles):
            choice.handle = handle

    def abort(self) -> None:
        """Abort every unfinished choice (client gone, or an error); frees their KV blocks."""
        for choice in self._choices:
            if choice.handle is not None:
                self._loop.abort(choice.handle)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Wait for new tokens and yield what the choices gained, until all have finished.

        Yields:
            The non-empty deltas of one wake-up, in choice order.

        Raises:
            GenerationError: If the engine failed a choice (the others are aborted).
        """
        pending = [c for c in self._choices if c.finish_reason is None]
        while pending:
            await self._notify.wait()
            self._notify.clear()
            deltas = []
            for choice in pending:
                delta = self._advance(choice)
                if delta is not None:
                    deltas.append(delta)
            pending = [c for c in pending if c.finish_reason is None]
            if deltas:
                yield deltas

    def _advance(self, choice: _Choice) -> ChoiceDelta | None:
        handle = choice.handle
        assert handle is not None
        result = handle.result
        if result is not None and result.status == RequestStatus.FAILED:
            self.failed = True
            self.abort()
            raise GenerationError(result.error or "the engine failed the request")
        tokens = handle.tokens
        if choice.consumed == len(tokens) and result is None:
            return None
        if choice.first_token_at is None and tokens:
            choice.first_token_at = time.perf_counter()
            if self._on_first_token is not None:
                self._on_first_token(choice.first_token_at - handle.submitted_at)
        delta = ChoiceDelta(index=choice.index)
        stream = choice.stream
        logprobs = self.options.logprobs
        text = []
        while choice.consumed < len(tokens):
            token = tokens[choice.consumed]
            offset = stream.length
            text.append(stream.push(token))
            if logprobs:
                delta.logprobs.append(handle.logprobs[choice.consumed])
                delta.token_texts.append(self._tokenizer.decode([token], skip_special_tokens=False))
                delta.text_offsets.append(offset)
            choice.consumed += 1
            if stream.stopped:
                choice.finish_reason = "stop"
                self._loop.abort(handle)
                break
        if choice.finish_reason is None and result is not None:
            text.append(stream.finish())
            length = result.finish_reason == FinishReason.LENGTH and not stream.stopped
            choice.finish_reason = "length" if length else "stop"
        delta.text = "".join(text)
        delta.finish_reason = choice.finish_reason
        if not (delta.text or delta.logprobs or delta.finish_reason):
            return None
        return delta
