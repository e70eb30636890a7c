"""Streaming clients of ``bench_serve.py``, run as worker processes (no torch import).

One Python process cannot drive hundreds of streaming clients without becoming the bottleneck
itself (every chunk costs the client an HTTP parse and a JSON decode), so the benchmark spreads
its clients over several of these workers. Each reads one job per line on stdin (JSON: url,
model, prompts, max_tokens, start time, client kind), waits until the start time
(``time.time``, shared by all workers), streams one ``/v1/completions`` request per prompt at
once and writes one line of JSON results per job on stdout: per request its send time, time to
first token, inter-token gaps and end time (``time.time`` seconds).

Two kinds of client: ``raw`` (the default) speaks HTTP/1.1 over asyncio streams itself (one
connection per request, chunked transfer decoding, server-sent events), the least client-side
work per chunk, so that what is measured is the server; ``httpx`` uses the httpx library (as
the official ``openai`` client does), several times more Python per request and chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit


class _Stream:
    """Per-request timing: first token, gaps between chunks (split evenly among their tokens)."""

    def __init__(self) -> None:
        self.sent = time.time()
        self.first: float | None = None
        self.last = self.sent
        self.tokens = 0
        self.gaps: list[float] = []

    def event(self, payload: str) -> None:
        # The benchmark's tokenizer maps every token to one word.
        count = len(json.loads(payload)["choices"][0]["text"].split())
        if not count:
            return
        now = time.time()
        if self.first is None:
            self.first = now
        else:
            self.gaps += [(now - self.last) / count] * count
        self.last, self.tokens = now, self.tokens + count

    def result(self) -> dict[str, Any]:
        if self.first is None:
            raise RuntimeError("a stream held no token")
        return {
            "sent": self.sent,
            "ttft": self.first - self.sent,
            "gaps": self.gaps,
            "tokens": self.tokens,
            "end": self.last,
        }


async def _raw_one(host: str, port: int, body: bytes) -> dict[str, Any]:
    stream = _Stream()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (host.encode(), port, len(body), body)
        )
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status {status!r}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        if not chunked:
            raise RuntimeError("expected a chunked event stream")
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            pending += await reader.readexactly(size)
            await reader.readexactly(2)
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    stream.event(event[6:].decode())
    finally:
        writer.close()
    return stream.result()


async def _httpx_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    stream = _Stream()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stream.event(line[6:])
    return stream.result()


async def _run(job: dict[str, Any]) -> list[dict[str, Any]]:
    prompts = job["prompts"]
    bodies = [
        {
            "model": job["model"],
            "prompt": prompt,
            "max_tokens": job["max_tokens"],
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        for prompt in prompts
    ]
    if job.get("client", "raw") == "raw":
        address = urlsplit(job["url"])
        host, port = address.hostname or "127.0.0.1", address.port or 80
        encoded = [json.dumps(body).encode() for body in bodies]
        await asyncio.sleep(max(0.0, job["start"] - time.time()))
        return await asyncio.gather(*(_raw_one(host, port, body) for body in encoded))
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await asyncio.sleep(max(0.0, job["start"] - time.time()))
        return await asyncio.gather(*(_httpx_one(client, job["url"], body) for body in bodies))


def main() -> None:
    """Serve jobs from stdin until it closes."""
    # Imported before the first job's start time; without it only the raw client runs.
    with contextlib.suppress(ImportError):
        import httpx  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)
        results = asyncio.run(_run(job)) if job["prompts"] else []
        sys.stdout.write(json.dumps(results) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
