"""Response side of the OpenAI protocol: JSON bodies of completions, chat completions, their
streamed chunks, usage counts and log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChoiceDelta",
    "Usage",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "usage_chunk",
]


@dataclass(kw_only=True, slots=True)
class ChoiceDelta:
    """What one choice gained since the last report."""

    index: int
    """Index of the choice in the response."""
    text: str = ""
    """New text."""
    token_texts: list[str] = field(default_factory=list)
    """Text of each new token, decoded alone."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each new token (when asked)."""
    text_offsets: list[int] = field(default_factory=list)
    """Character offset of each new token in the choice's text."""
    finish_reason: str | None = None
    """``stop`` or ``length`` once the choice ended, else None."""

    def merge(self, later: ChoiceDelta) -> None:
        """Append a later delta of the same choice.

        Args:
            later: The delta that follows this one.
        """
        self.text += later.text
        self.token_texts += later.token_texts
        self.logprobs += later.logprobs
        self.text_offsets += later.text_offsets
        self.finish_reason = later.finish_reason or self.finish_reason


@dataclass(kw_only=True, slots=True, frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    """Prompt tokens (counted once per prompt, not per choice)."""
    completion_tokens: int
    """Generated tokens of all choices."""

    def as_dict(self) -> dict[str, int]:
        """The ``usage`` object.

        Returns:
            ``{"prompt_tokens", "completion_tokens", "total_tokens"}``.
        """
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _completion_logprobs(delta: ChoiceDelta, logprobs: bool) -> dict[str, Any] | None:
    if not logprobs:
        return None
    return {
        "tokens": delta.token_texts,
        "token_logprobs": delta.logprobs,
        "top_logprobs": None,
        "text_offset": delta.text_offsets,
    }


def _chat_logprobs(delta: ChoiceDelta, logprobs: bool) -> dict[str, Any] | None:
    if not logprobs:
        return None
    content = [
        {
            "token": text,
            "logprob": value,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [],
        }
        for text, value in zip(delta.token_texts, delta.logprobs)
    ]
    return {"content": content, "refusal": None}


def _body(
    kind: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    **usage: dict[str, int] | None,
) -> dict[str, Any]:
    """The response object; ``usage`` is empty (no ``usage`` key) or ``{"usage": ...}``."""
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        **usage,
    }


def _null_usage(include_usage: bool) -> dict[str, None]:
    """A streamed chunk's ``usage: null`` when the stream ends with a usage chunk."""
    return {"usage": None} if include_usage else {}


def _choice(
    delta: ChoiceDelta, logprobs: dict[str, Any] | None, /, **content: Any
) -> dict[str, Any]:
    return {
        "index": delta.index,
        **content,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
    }


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[ChoiceDelta],
    usage: Usage,
    logprobs: bool,
) -> dict[str, Any]:
    """Body of a non-streamed ``/v1/completions`` answer.

    Args:
        request_id: ``cmpl-...`` id.
        created: Unix time of the request.
        model: Served model name.
        choices: One merged delta per choice, in index order.
        usage: Token counts.
        logprobs: Whether log-probabilities were asked for.

    Returns:
        The ``text_completion`` object.
    """
    answers = [_choice(c, _completion_logprobs(c, logprobs), text=c.text) for c in choices]
    return _body("text_completion", request_id, created, model, answers, usage=usage.as_dict())


def completion_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    delta: ChoiceDelta,
    logprobs: bool,
    include_usage: bool,
) -> dict[str, Any]:
    """One streamed ``/v1/completions`` event.

    Args:
        request_id: ``cmpl-...`` id.
        created: Unix time of the request.
        model: Served model name.
        delta: What the choice gained.
        logprobs: Whether log-probabilities were asked for.
        include_usage: Whether the stream ends with a usage chunk (then every chunk has
            ``usage: null``).

    Returns:
        The chunk object.
    """
    choice = _choice(delta, _completion_logprobs(delta, logprobs), text=delta.text)
    return _body(
        "text_completion", request_id, created, model, [choice], **_null_usage(include_usage)
    )


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[ChoiceDelta],
    usage: Usage,
    logprobs: bool,
) -> dict[str, Any]:
    """Body of a non-streamed ``/v1/chat/completions`` answer.

    Args:
        request_id: ``chatcmpl-...`` id.
        created: Unix time of the request.
        model: Served model name.
        choices: One merged delta per choice, in index order.
        usage: Token counts.
        logprobs: Whether log-probabilities were asked for.

    Returns:
        The ``chat.completion`` object.
    """
    answers = [
        _choice(c, _chat_logprobs(c, logprobs), message={"role": "assistant", "content": c.text})
        for c in choices
    ]
    return _body("chat.completion", request_id, created, model, answers, usage=usage.as_dict())


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    delta: ChoiceDelta,
    logprobs: bool,
    include_usage: bool,
    first: bool,
) -> dict[str, Any]:
    """One streamed ``/v1/chat/completions`` event.

    Args:
        request_id: ``chatcmpl-...`` id.
        created: Unix time of the request.
        model: Served model name.
        delta: What the choice gained.
        logprobs: Whether log-probabilities were asked for.
        include_usage: Whether the stream ends with a usage chunk.
        first: Whether this is the choice's first chunk (it carries the role).

    Returns:
        The ``chat.completion.chunk`` object.
    """
    message: dict[str, Any] = {"role": "assistant"} if first else {}
    if delta.text or first:
        message["content"] = delta.text
    choice = _choice(delta, _chat_logprobs(delta, logprobs), delta=message)
    return _body(
        "chat.completion.chunk", request_id, created, model, [choice], **_null_usage(include_usage)
    )


def usage_chunk(
    *, request_id: str, created: int, model: str, chat: bool, usage: Usage
) -> dict[str, Any]:
    """The last streamed event when ``stream_options.include_usage`` is set.

    Args:
        request_id: The request's id.
        created: Unix time of the request.
        model: Served model name.
        chat: Whether it is a chat completion stream.
        usage: Token counts.

    Returns:
        A chunk with no choices and the usage.
    """
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _body(kind, request_id, created, model, [], usage=usage.as_dict())
