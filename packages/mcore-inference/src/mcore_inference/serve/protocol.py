"""Request side of the OpenAI protocol: parse and validate ``/v1/completions`` and
``/v1/chat/completions`` bodies into plain dataclasses.

Validation is strict, as OpenAI's own API is: an unknown field, a wrong type or a value out of
range raises :class:`ProtocolError` naming the field (``param``), which the server answers with
status 400 in OpenAI's error shape. Fields that change the output in ways the engine cannot
honour (``echo``, penalties, ``logit_bias``, tools, top log-probabilities) are refused the same
way instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "GenerationOptions",
    "ProtocolError",
    "error_body",
    "parse_chat_request",
    "parse_completion_request",
]

MAX_N = 128
"""Most choices one request may ask for."""
MAX_STOP_STRINGS = 4
"""Most stop strings one request may give (OpenAI's limit)."""

_ROLES = ("system", "developer", "user", "assistant", "tool")

# Accepted and ignored: they do not change what is generated.
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_SHARED_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
    *_IGNORED,
)
_COMPLETION_FIELDS = frozenset((*_SHARED_FIELDS, "prompt", "logprobs", "echo", "suffix", "best_of"))
_CHAT_FIELDS = frozenset(
    (
        *_SHARED_FIELDS,
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
    )
)


class ProtocolError(ValueError):
    """A request the server refuses, with the HTTP status and OpenAI error fields to answer.

    Args:
        message: What is wrong and what was expected.
        param: The offending field (dotted path, e.g. ``messages[1].role``), or None.
        status: HTTP status code of the answer.
        error_type: OpenAI error ``type``.
        code: OpenAI error ``code``, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None,
        status: int = 400,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the answer.

        Returns:
            ``{"error": {"message", "type", "param", "code"}}``.
        """
        return error_body(self.message, self.error_type, param=self.param, code=self.code)


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build an error body in OpenAI's shape.

    Args:
        message: Human-readable explanation.
        error_type: OpenAI error ``type`` (``invalid_request_error``, ``server_error`` ...).
        param: The field at fault, if any.
        code: Machine-readable code, if any.

    Returns:
        ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
    """
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationOptions:
    """Sampling and output options shared by both endpoints (already validated)."""

    max_tokens: int | None
    """Tokens to generate at most per choice; None fills the context."""
    temperature: float
    """Softmax temperature; 0 is greedy."""
    top_p: float
    """Nucleus probability in (0, 1]."""
    top_k: int
    """Top-k cut-off; 0 disables."""
    n: int
    """Choices per prompt."""
    stop: tuple[str, ...]
    """Strings that end a choice (not included in its text)."""
    seed: int | None
    """Seed of choice 0; choice ``i`` uses ``seed + i``."""
    logprobs: bool
    """Return the log-probability of every generated token."""
    ignore_eos: bool
    """Keep generating after the end-of-sequence token."""
    stream: bool
    """Answer with server-sent events."""
    include_usage: bool
    """With ``stream``: send a last chunk holding the usage counts."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request."""

    model: str
    """Requested model name."""
    prompts: tuple[str | tuple[int, ...], ...]
    """One or more prompts, each text or token ids."""
    options: GenerationOptions
    """Sampling and output options."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ChatMessage:
    """One message of a conversation (text content only)."""

    role: str
    """``system``, ``developer``, ``user``, ``assistant`` or ``tool``."""
    content: str
    """The text (content parts joined)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    model: str
    """Requested model name."""
    messages: tuple[ChatMessage, ...]
    """The conversation, oldest first."""
    options: GenerationOptions
    """Sampling and output options."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _fail(param: str, value: Any, expected: str) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProtocolError(f"{param}={shown} ({_type_name(value)}); expected {expected}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_int(body: dict[str, Any], name: str, low: int, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _fail(name, value, f"an integer {bound}")
    return int(value)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise _fail(name, value, f"a number in [{low:g}, {high:g}]")
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(name, value, "true or false")
    return value


def _check_object(body: Any, allowed: frozenset[str], endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError(
            f"the request body is a JSON {_type_name(body)}; expected a JSON object", param=None
        )
    for name in body:
        if name not in allowed:
            raise ProtocolError(
                f"unrecognized request argument {name!r} for {endpoint}; expected one of "
                f"{', '.join(sorted(allowed))}",
                param=name,
            )
    return body


def _model(body: dict[str, Any]) -> str:
    value = body.get("model")
    if not isinstance(value, str) or not value:
        raise _fail("model", value, "the name of the served model (see /v1/models)")
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or value != 0):
            raise _fail(name, value, "0 or null (penalties are not supported by this server)")
    bias = body.get("logit_bias")
    if bias is not None and bias != {}:
        raise _fail("logit_bias", bias, "null or {} (logit bias is not supported by this server)")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or len(strings) > MAX_STOP_STRINGS:
        raise _fail("stop", value, f"a string or a list of at most {MAX_STOP_STRINGS} strings")
    for i, item in enumerate(strings):
        if not isinstance(item, str) or not item:
            raise _fail(f"stop[{i}]" if value is strings else "stop", item, "a non-empty string")
    return tuple(strings)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    value = body.get("stream_options")
    if value is None:
        return False
    if not stream:
        raise _fail("stream_options", value, "null unless stream is true")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise _fail("stream_options", value, 'an object {"include_usage": bool}')
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise _fail("stream_options.include_usage", include, "true or false")
    return include


def _options(body: dict[str, Any], *, max_tokens: int | None, logprobs: bool) -> GenerationOptions:
    _refuse_unsupported(body)
    top_k = _optional_int(body, "top_k", -1, None)
    n = _optional_int(body, "n", 1, MAX_N)
    stream = _bool(body, "stream")
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        n=1 if n is None else n,
        stop=_stop(body),
        seed=_optional_int(body, "seed", 0, 2**63 - 1 - MAX_N),
        logprobs=logprobs,
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def _top_p(body: dict[str, Any]) -> float:
    value = body.get("top_p")
    if value is None:
        return 1.0
    if not _is_number(value) or not 0.0 < value <= 1.0:
        raise _fail("top_p", value, "a number in (0, 1]")
    return float(value)


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    for i, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise _fail(f"{param}[{i}]", token, "a non-negative token id")
    return tuple(value)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    expected = "a string, a list of token ids, or a non-empty list of either"
    if isinstance(value, str):
        prompts: list[str | tuple[int, ...]] = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompts = [_token_ids(value, "prompt")]
    elif isinstance(value, list) and value:
        prompts = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list) and item:
                prompts.append(_token_ids(item, f"prompt[{i}]"))
            else:
                raise _fail(f"prompt[{i}]", item, "a string or a non-empty list of token ids")
    else:
        raise _fail("prompt", value, expected)
    for i, prompt in enumerate(prompts):
        if prompt == "":
            raise _fail("prompt" if len(prompts) == 1 else f"prompt[{i}]", "", "a non-empty prompt")
    return tuple(prompts)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a ``/v1/completions`` JSON body.

    Args:
        body: The decoded JSON body.

    Returns:
        The request.

    Raises:
        ProtocolError: If a field is unknown, of the wrong type, out of range or unsupported;
            ``param`` names it.
    """
    body = _check_object(body, _COMPLETION_FIELDS, "/v1/completions")
    model = _model(body)
    if "prompt" not in body:
        raise ProtocolError("prompt is missing; expected a string or token ids", param="prompt")
    prompts = _prompts(body["prompt"])
    if _bool(body, "echo"):
        raise _fail("echo", True, "false or null (echoing the prompt is not supported)")
    if body.get("suffix") is not None:
        raise _fail("suffix", body["suffix"], "null (suffixes are not supported)")
    logprobs = _optional_int(body, "logprobs", 0, 5)
    if logprobs:
        raise _fail(
            "logprobs",
            logprobs,
            "0 or null: this server returns the log-probability of each sampled token, "
            "not the top alternatives",
        )
    max_tokens = _optional_int(body, "max_tokens", 0, None)
    options = _options(
        body, max_tokens=16 if max_tokens is None else max_tokens, logprobs=logprobs == 0
    )
    best_of = _optional_int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != options.n:
        raise _fail("best_of", best_of, f"null or equal to n={options.n}")
    return CompletionRequest(model=model, prompts=prompts, options=options)


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else part
                raise _fail(f"{param}[{j}].type", kind, "'text' (only text content is supported)")
            text = part.get("text")
            if not isinstance(text, str):
                raise _fail(f"{param}[{j}].text", text, "a string")
            parts.append(text)
        return "".join(parts)
    raise _fail(param, value, "a string or a list of text parts")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise _fail("messages", value, "a non-empty list of {role, content} objects")
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail(param, message, "an object with role and content")
        role = message.get("role")
        if role not in _ROLES:
            raise _fail(f"{param}.role", role, f"one of {', '.join(_ROLES)}")
        extra = set(message) - {"role", "content", "name", "tool_call_id"}
        if extra:
            field = sorted(extra)[0]
            raise _fail(f"{param}.{field}", message[field], "absent (tool calls are not supported)")
        content = message.get("content")
        if content is None:
            raise _fail(f"{param}.content", content, "a string or a list of text parts")
        messages.append(ChatMessage(role=role, content=_content(content, f"{param}.content")))
    return tuple(messages)


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` JSON body.

    Args:
        body: The decoded JSON body.

    Returns:
        The request.

    Raises:
        ProtocolError: If a field is unknown, of the wrong type, out of range or unsupported;
            ``param`` names it.
    """
    body = _check_object(body, _CHAT_FIELDS, "/v1/chat/completions")
    model = _model(body)
    if "messages" not in body:
        raise ProtocolError("messages is missing; expected a list of messages", param="messages")
    messages = _messages(body["messages"])
    for name in ("tools", "functions"):
        if body.get(name):
            raise _fail(name, body[name], "null or [] (tool calling is not supported)")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _fail(name, body[name], "null or 'none' (tool calling is not supported)")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _fail("response_format", response_format, '{"type": "text"} or null')
    top_logprobs = _optional_int(body, "top_logprobs", 0, 20)
    if top_logprobs:
        raise _fail(
            "top_logprobs",
            top_logprobs,
            "0 or null: this server returns the log-probability of each sampled token, "
            "not the top alternatives",
        )
    max_tokens = _optional_int(body, "max_tokens", 0, None)
    max_completion_tokens = _optional_int(body, "max_completion_tokens", 0, None)
    if max_tokens is not None and max_completion_tokens is not None:
        raise _fail("max_completion_tokens", max_completion_tokens, "null when max_tokens is given")
    options = _options(
        body,
        max_tokens=max_tokens if max_tokens is not None else max_completion_tokens,
        logprobs=_bool(body, "logprobs"),
    )
    return ChatRequest(model=model, messages=messages, options=options)
