"""Streaming clients of ``bench_serve.py``, run as worker processes (no torch import).

One Python process cannot drive hundreds of streaming clients without becoming the bottleneck
itself (every chunk costs the client an HTTP parse and a JSON decode), so the benchmark spreads
its clients over several of these workers. Each reads one job per line on stdin (JSON: url,
model, prompts, max_tokens, start time), waits until the start time (``time.time``, shared by
all workers), streams one ``/v1/completions`` request per prompt at once and writes one line of
JSON results per job on stdout: per request its send time, time to first token, inter-token
gaps and end time (``time.time`` seconds).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


async def _stream_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    sent = time.time()
    first, last, tokens, gaps = None, sent, 0, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            # The benchmark's tokenizer maps every token to one word.
            count = len(json.loads(line[6:])["choices"][0]["text"].split())
            if not count:
                continue
            now = time.time()
            if first is None:
                first = now
            else:
                gaps += [(now - last) / count] * count
            last, tokens = now, tokens + count
    if first is None:
        raise RuntimeError("a stream held no token")
    return {"sent": sent, "ttft": first - sent, "gaps": gaps, "tokens": tokens, "end": last}


async def _run(job: dict[str, Any]) -> list[dict[str, Any]]:
    import httpx

    prompts = job["prompts"]
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await asyncio.sleep(max(0.0, job["start"] - time.time()))
        return await asyncio.gather(
            *(
                _stream_one(
                    client,
                    job["url"],
                    {
                        "model": job["model"],
                        "prompt": prompt,
                        "max_tokens": job["max_tokens"],
                        "temperature": 0,
                        "stream": True,
                        "ignore_eos": True,
                    },
                )
                for prompt in prompts
            )
        )


def main() -> None:
    """Serve jobs from stdin until it closes."""
    import httpx  # noqa: F401  (imported before the first job's start time)

    for line in sys.stdin:
        job = json.loads(line)
        results = asyncio.run(_run(job)) if job["prompts"] else []
        sys.stdout.write(json.dumps(results) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
