"""Serving benchmark: ``mcore-inference serve`` under 1..256 concurrent streaming clients against
the engine's direct Python throughput, on the same weights, in one run.

Workload: a Qwen2.5-0.5B-shaped GPT with random bf16 weights (``--preset``), written as a
Hugging Face checkpoint with a word-level tokenizer over its whole vocabulary (every token is
one word, so every generated token shows up as text), ``--prompt-len`` random prompt tokens,
``--new-tokens`` greedy tokens per request, end-of-sequence ignored (every request generates
exactly ``--new-tokens``). For each concurrency C:

- direct: ``InferenceEngine.generate`` on C prompts in this process (same engine config as the
  server): generated tokens per second;
- server: the server runs in a subprocess; C asyncio clients (httpx, one connection each) send
  one streaming ``/v1/completions`` request each at the same moment. Throughput is all tokens
  over the wall time from the first request to the last ``[DONE]``; TTFT is the time from
  sending a request to its first token; inter-token latency (ITL) is the gap between two
  chunks of a stream, divided evenly among the tokens of the later chunk (a server that falls
  behind sends several tokens per chunk). p50/p99 over all requests or tokens.

The overhead of the server is ``1 - server tok/s / direct tok/s`` (target: <= 10% at 64 clients).

On the GPU machine (no internet): it has torch, transformers, tokenizers, httpx, anyio, h11,
click, jinja2 and uvloop, but not starlette and uvicorn. Carry those two wheels (pure Python)::

    python3 -m pip download --no-deps --only-binary=:all: -d .whl starlette==1.10.0 uvicorn==0.54.0

and run from the repository root on one GPU::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_serve.py --out $OUT/serve

Check on a CPU (a tiny model, a few clients and tokens)::

    python3 packages/mcore-inference/benchmarks/bench_serve.py --out /tmp/serve --device cpu --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models import GPTConfig, GPTModel


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _write_checkpoint(model: GPTModel, directory: Path) -> None:
    """The model as a Hugging Face checkpoint plus a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.to_hf(directory)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))


def _engine_config(args: argparse.Namespace) -> InferenceConfig:
    return InferenceConfig(
        max_batch_size=max(args.concurrency),
        max_sequence_length=args.prompt_len + args.new_tokens + 16,
        block_size=16,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _direct(
    model: GPTModel, prompts: list[list[int]], args: argparse.Namespace
) -> dict[int, float]:
    """Tokens per second of engine.generate for each concurrency."""
    device = next(model.parameters()).device
    rates = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    with InferenceEngine(model, _engine_config(args)) as engine:
        for clients in args.concurrency:
            batch = prompts[:clients]
            engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
            _sync(device)
            start = time.perf_counter()
            results = engine.generate(batch, params)
            _sync(device)
            seconds = time.perf_counter() - start
            rates[clients] = sum(len(r.tokens) for r in results) / seconds
            print(f"direct {clients:>4} clients: {rates[clients]:.0f} tok/s", flush=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


async def _stream_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    sent = time.perf_counter()
    first, last, tokens, gaps = None, sent, 0, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            count = len(json.loads(line[6:])["choices"][0]["text"].split())
            if not count:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps += [(now - last) / count] * count
            last, tokens = now, tokens + count
    assert first is not None, "the stream held no token"
    return {"ttft": first - sent, "gaps": gaps, "tokens": tokens, "end": last}


async def _serve_round(
    url: str, prompts: list[list[int]], new_tokens: int, model_name: str
) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                _stream_one(
                    client,
                    url,
                    {
                        "model": model_name,
                        "prompt": prompt,
                        "max_tokens": new_tokens,
                        "temperature": 0,
                        "stream": True,
                        "ignore_eos": True,
                    },
                )
                for prompt in prompts
            )
        )
    wall = max(r["end"] for r in results) - start
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * _percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * _percentile(ttfts, 99),
        "itl_p50_ms": 1e3 * _percentile(gaps, 50),
        "itl_p99_ms": 1e3 * _percentile(gaps, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
    }


def _start_server(directory: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    config = _engine_config(args)
    command = [
        sys.executable,
        "-m",
        "mcore_inference.cli",
        "serve",
        "--model",
        str(directory),
        "--served-model-name",
        "bench",
        "--port",
        "0",
        "--device",
        args.device,
        "--max-batch-size",
        str(config.max_batch_size),
        "--max-sequence-length",
        str(config.max_sequence_length),
        "--block-size",
        str(config.block_size),
        "--max-waiting-requests",
        str(4 * config.max_batch_size),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        print(line.rstrip(), flush=True)
        if "listening on" in line:
            return process, line.split("listening on ")[1].split()[0]
    raise RuntimeError(f"the server exited with status {process.wait()} before listening")


def main() -> None:
    """Run the benchmark and write ``serve.json`` and ``serve.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model, few clients and tokens")
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--concurrency", default="1,4,16,64,128,256")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.concurrency, args.new_tokens = "tiny", "1,4,16", 32
        args.prompt_len = min(args.prompt_len, 16)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = GPTConfig.from_name(args.preset, dtype=dtype)
    model = GPTModel(config, device=device).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        0, config.vocab_size, (max(args.concurrency), args.prompt_len), generator=generator
    ).tolist()
    directory = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    _write_checkpoint(model, directory)
    direct = _direct(model, prompts, args)
    del model
    gc.collect()

    process, url = _start_server(directory, args)
    rows = []
    try:
        for clients in args.concurrency:
            batch = prompts[:clients]
            asyncio.run(_serve_round(url, batch, 8, "bench"))  # warm-up
            row: dict[str, Any] = {"clients": clients}
            row.update(asyncio.run(_serve_round(url, batch, args.new_tokens, "bench")))
            row["direct_tokens_per_s"] = direct[clients]
            row["server_over_direct"] = row["tokens_per_s"] / direct[clients]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        process.terminate()
        process.wait(timeout=120)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "benchmark": "serve",
        "device": name,
        "torch": torch.__version__,
        "preset": args.preset,
        "dtype": dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Serving, {args.preset} shape (random {dtype} weights), "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens per streaming client, greedy; "
        f"{name}.",
        "",
        "| clients | server tok/s | direct tok/s | server / direct | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['clients']} | {row['tokens_per_s']:.0f} | {row['direct_tokens_per_s']:.0f} "
            f"| {100 * row['server_over_direct']:.0f}% | {row['ttft_p50_ms']:.1f} "
            f"| {row['ttft_p99_ms']:.1f} | {row['itl_p50_ms']:.2f} | {row['itl_p99_ms']:.2f} |"
        )
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
