"""The HTTP routes: an ASGI application (Starlette) over the engine loop.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or server-sent events),
``GET /v1/models``, ``GET /health`` and ``GET /metrics``. Every error is answered in OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``: 400 for an invalid request (``param``
names the field), 404 for an unknown model or route, 503 when the queue is full or the engine
is down, 500 for anything else.

A client that disconnects aborts its request at once, which frees its KV blocks: for a stream,
Starlette cancels the response when the connection closes; for a plain request, the handler
races the generation against the connection's ``http.disconnect`` message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from mcore_inference.errors import TokenizerUnavailableError
from mcore_inference.serve.engine_loop import EngineLoopStoppedError, LoopFrontend, QueueFullError
from mcore_inference.serve.engine_process import EngineInfo
from mcore_inference.serve.generation import GenerationError, GenerationJob, ModelLimits, Tokenizer
from mcore_inference.serve.metrics import CONTENT_TYPE, ServerMetrics
from mcore_inference.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    ProtocolError,
    error_body,
    parse_chat_request,
    parse_completion_request,
)
from mcore_inference.serve.responses import (
    ChoiceDelta,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_chunk,
)

__all__ = ["ServerState", "build_app"]


@dataclass(kw_only=True, slots=True)
class ServerState:
    """Everything the routes share."""

    loop: LoopFrontend
    """The engine's loop, on a thread or in a child process (started and stopped with the
    application)."""
    tokenizer: Tokenizer
    """The checkpoint's tokenizer and chat template."""
    model_name: str
    """Name clients send in ``model``."""
    limits: ModelLimits
    """Sizes requests are checked against."""
    metrics: ServerMetrics
    """Counters shown by ``/metrics``."""
    shutdown_timeout: float = 60.0
    """Seconds the application's shutdown waits for the engine thread."""
    created: int = field(default_factory=lambda: int(time.time()))
    """Unix time the server started (``/v1/models``)."""
    engine_info: EngineInfo | None = None
    """Sizes of the engine and its model (the startup line), when known."""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _event(value: Any) -> str:
    return f"data: {_dumps(value)}\n\n"


async def _wait_for_disconnect(receive: Callable[[], Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Routes:
    """Route handlers bound to one :class:`ServerState` (framework classes passed in)."""

    def __init__(self, state: ServerState, responses: Any) -> None:
        self.state = state
        self.responses = responses

    def _json(self, body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
        content = _dumps(body).encode("utf-8")
        return self.responses.Response(
            content, status_code=status, media_type="application/json", headers=headers
        )

    def _error(self, endpoint: str, exc: ProtocolError) -> Any:
        self.state.metrics.responses[(endpoint, exc.status)] += 1
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return self._json(exc.body(), exc.status, headers)

    async def health(self, request: Any) -> Any:
        loop = self.state.loop
        if loop.running:
            return self._json({"status": "ok"})
        reason = loop.failure or "the engine loop is not running"
        return self._json(error_body(reason, "service_unavailable"), 503)

    async def models(self, request: Any) -> Any:
        state = self.state
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "mcore-inference",
            "max_model_len": state.limits.max_sequence_length,
        }
        return self._json({"object": "list", "data": [card]})

    async def metrics(self, request: Any) -> Any:
        return self.responses.Response(self.state.metrics.render(), media_type=CONTENT_TYPE)

    async def completions(self, request: Any) -> Any:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Any) -> Any:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------------ generation

    async def _generate(self, request: Any, *, chat: bool) -> Any:
        state = self.state
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            body = await self._read_json(request)
            parsed = parse_chat_request(body) if chat else parse_completion_request(body)
            if parsed.model != state.model_name:
                raise ProtocolError(
                    f"model={parsed.model!r} is not served here; expected {state.model_name!r}",
                    param="model",
                    status=404,
                    code="model_not_found",
                )
            if isinstance(parsed, ChatRequest):
                prompts = self._chat_prompt(parsed)
            else:
                prompts = self._completion_prompts(parsed)
            job = GenerationJob(
                loop=state.loop,
                tokenizer=state.tokenizer,
                prompts=prompts,
                options=parsed.options,
                limits=state.limits,
                prompt_param="messages" if chat else "prompt",
                on_first_token=state.metrics.observe_first_token,
            )
            job.start()
        except ProtocolError as exc:
            return self._error(endpoint, exc)
        except QueueFullError as exc:
            message = f"the server is at capacity, retry later: {exc}"
            error = ProtocolError(message, param=None, status=503, error_type="server_overloaded")
            return self._error(endpoint, error)
        except EngineLoopStoppedError as exc:
            error = ProtocolError(
                f"the engine is not serving: {exc}",
                param=None,
                status=503,
                error_type="service_unavailable",
            )
            return self._error(endpoint, error)
        state.metrics.prompt_tokens += job.prompt_tokens
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if parsed.options.stream:
            state.metrics.responses[(endpoint, 200)] += 1
            return self.responses.StreamingResponse(
                self._events(job, request_id, created, chat=chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._complete(request, job, request_id, created, endpoint, chat=chat)

    @staticmethod
    async def _read_json(request: Any) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(
                f"the request body is not valid JSON ({exc}); expected a JSON object", param=None
            ) from None

    def _completion_prompts(self, parsed: CompletionRequest) -> list[list[int]]:
        tokenizer = self.state.tokenizer
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in parsed.prompts]

    def _chat_prompt(self, parsed: ChatRequest) -> list[list[int]]:
        messages = [{"role": m.role, "content": m.content} for m in parsed.messages]
        try:
            ids = self.state.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except TokenizerUnavailableError as exc:
            raise ProtocolError(
                f"the conversation cannot be rendered with this model's chat template: {exc}",
                param="messages",
            ) from None
        assert isinstance(ids, list)
        return [ids]

    def _record_finish(self, job: GenerationJob) -> None:
        for reason in job.finish_reasons:
            self.state.metrics.finished[reason] += 1

    async def _events(
        self, job: GenerationJob, request_id: str, created: int, *, chat: bool
    ) -> AsyncIterator[str]:
        options = job.options
        model = self.state.model_name
        started: set[int] = set()
        try:
            async for deltas in job.deltas():
                chunks = []
                for delta in deltas:
                    if chat:
                        chunk = chat_chunk(
                            request_id=request_id,
                            created=created,
                            model=model,
                            delta=delta,
                            logprobs=options.logprobs,
                            include_usage=options.include_usage,
                            first=delta.index not in started,
                        )
                        started.add(delta.index)
                    else:
                        chunk = completion_chunk(
                            request_id=request_id,
                            created=created,
                            model=model,
                            delta=delta,
                            logprobs=options.logprobs,
                            include_usage=options.include_usage,
                        )
                    chunks.append(_event(chunk))
                yield "".join(chunks)
            if options.include_usage:
                usage = usage_chunk(
                    request_id=request_id, created=created, model=model, chat=chat, usage=job.usage
                )
                yield _event(usage)
            yield "data: [DONE]\n\n"
        except GenerationError as exc:
            yield _event(error_body(str(exc), "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            job.abort()
            self._record_finish(job)

    async def _complete(
        self,
        request: Any,
        job: GenerationJob,
        request_id: str,
        created: int,
        endpoint: str,
        *,
        chat: bool,
    ) -> Any:
        merged: dict[int, ChoiceDelta] = {}

        async def collect() -> None:
            async for deltas in job.deltas():
                for delta in deltas:
                    if delta.index in merged:
                        merged[delta.index].merge(delta)
                    else:
                        merged[delta.index] = delta

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: stop generating for it
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, GenerationError):
                    await work
                self.state.metrics.responses[(endpoint, 499)] += 1
                return self.responses.Response(status_code=499)
            work.result()
        except GenerationError as exc:
            error = ProtocolError(str(exc), param=None, status=500, error_type="server_error")
            return self._error(endpoint, error)
        finally:
            gone.cancel()
            job.abort()
            self._record_finish(job)
        choices = [merged[i] for i in sorted(merged)]
        build = chat_response if chat else completion_response
        body = build(
            request_id=request_id,
            created=created,
            model=self.state.model_name,
            choices=choices,
            usage=job.usage,
            logprobs=job.options.logprobs,
        )
        self.state.metrics.responses[(endpoint, 200)] += 1
        return self._json(body)


def build_app(state: ServerState) -> Any:
    """Build the ASGI application (needs the ``serve`` extra: starlette).

    The application's lifespan starts the engine loop and, at shutdown (after the HTTP server
    has finished or cancelled the in-flight requests), stops it and closes the engine.

    Args:
        state: Engine loop, tokenizer, limits and metrics of the server.

    Returns:
        A ``starlette.applications.Starlette`` application.
    """
    from starlette import responses
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    routes = _Routes(state, responses)

    async def http_error(request: Any, exc: Any) -> Any:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return routes._json(error_body(message, error_type), exc.status_code)

    async def server_error(request: Any, exc: Exception) -> Any:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return routes._json(error_body(message, "server_error"), 500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.loop.stop, state.shutdown_timeout)

    return Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
