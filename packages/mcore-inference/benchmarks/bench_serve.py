"""Serving benchmark: ``mcore-inference serve`` under 1..256 concurrent streaming clients against
the engine's direct Python throughput, on the same weights, in one run.

Workload: a Qwen2.5-0.5B-shaped GPT with random bf16 weights (``--preset``), written as a
Hugging Face checkpoint with a word-level tokenizer over its whole vocabulary (every token is
one word, so every generated token shows up as text), ``--prompt-len`` random prompt tokens,
``--new-tokens`` greedy tokens per request, end-of-sequence ignored (every request generates
exactly ``--new-tokens``). For each concurrency C:

- direct: ``InferenceEngine.generate`` on C prompts in this process (same engine config as the
  server, every decode CUDA graph captured first as the server does): generated tokens per
  second, and the time to the first token of ``engine.stream`` (the engine's own share of a
  server's TTFT);
- server: the server runs in a subprocess, with the engine in its child process (``process``,
  the default of ``serve``) or on a thread (``thread``); ``--modes`` picks which, in turn. C
  streaming clients (one connection each; ``--client raw``, the default, speaks HTTP/1.1 over
  asyncio streams itself, ``--client httpx`` uses httpx, ``--client raw,httpx`` measures both
  on every server), spread over ``--client-procs`` worker
  processes (``_serve_clients.py``: one Python process driving hundreds of streams is a
  bottleneck of its own), send one streaming ``/v1/completions`` request each at the same
  moment. Throughput is all tokens over the wall time from the first request to the last
  ``[DONE]``; TTFT is the time from sending a request to its first token (the server's own
  view, submission to first token, comes from ``/metrics``); inter-token latency (ITL) is the
  gap between two chunks of a stream, divided evenly among the tokens of the later chunk (a
  server that falls behind sends several tokens per chunk). p50/p99 over all requests or
  tokens. The CPU share of the HTTP process and of the engine process over each round is
  recorded too, and ``--profile C`` samples the server (both processes) with py-spy at C
  clients (raw collapsed stacks, ``profile_<mode>_<C>.txt``).

The overhead of the server is ``1 - server tok/s / direct tok/s`` (target: <= 10% at 64 clients).

A ``-tp<N>`` suffix (``process-tp2``) serves the model tensor-parallel over ``N`` GPUs
(``serve --tp N``); the direct column stays the single-GPU engine. Before the clients of a
server, ``--greedy-check K`` sends ``K`` prompts one at a time (greedy, 32 tokens each) and
compares the answers with the same prompts generated alone by a direct engine of the same
tensor-parallel size (the same kernels, so equal token for token; for ``N > 1`` a ``tp = N``
engine over ``N`` ranks, ``_serve_tp_reference.py``) and with the single-GPU engine (in
bfloat16 a different reduction order may flip a near-tie, so this is a count, not a check).

On the GPU machine (no internet, torch and transformers installed) carry the pure-Python wheels
of the server and the clients (py-spy too, for ``--profile``)::

    python3 -m pip download --no-deps --only-binary=:all: -d .whl starlette==1.10.0 \
        uvicorn==0.54.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 \
        sniffio==1.3.1 idna==3.20 certifi==2026.10.18 click==8.5.1 typing_extensions==4.16.0

and run from the repository root on one GPU (about 90 s on an H100)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_serve.py --out $OUT/serve \
        --concurrency 1,16,64,256 --new-tokens 128 --modes process,process-eager \
        --client raw,httpx

and, on two GPUs, the tensor-parallel server against the single-GPU one::

    python3 packages/mcore-inference/benchmarks/bench_serve.py --out $OUT/serve-tp \
        --concurrency 1,16,64 --new-tokens 128 --modes process,process-tp2 --greedy-check 4

Check on a CPU (a tiny model, a few clients and tokens)::

    python3 packages/mcore-inference/benchmarks/bench_serve.py --out /tmp/serve --device cpu --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.serve.config import ServeConfig
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
    """The server's engine configuration (the direct baseline runs the same)."""
    return InferenceConfig(
        max_batch_size=max(args.concurrency),
        max_sequence_length=args.prompt_len + args.new_tokens + 16,
        block_size=16,
        cuda_graph_mixed_steps=ServeConfig(model="-").cuda_graph_mixed_steps,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


_CHECK_TOKENS = 32
"""Greedy tokens per prompt of ``--greedy-check``."""


def _direct(
    model: GPTModel, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[int, dict[str, float]], list[list[int]]]:
    """Tokens per second of engine.generate for each concurrency, and the time to the first
    token of ``engine.stream`` (the engine's own share of a server's TTFT); and the greedy
    tokens of the ``--greedy-check`` prompts, each generated alone."""
    device = next(model.parameters()).device
    rates = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    with InferenceEngine(model, _engine_config(args)) as engine:
        engine.capture_graphs()  # as the server does at startup
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # compile
        check = SamplingParams(temperature=0.0, max_tokens=_CHECK_TOKENS)
        alone = [engine.generate([p], check)[0].tokens for p in prompts[: args.greedy_check]]
        for clients in args.concurrency:
            batch = prompts[:clients]
            _sync(device)
            start = time.perf_counter()
            stream = engine.stream(batch, warm)
            next(stream)
            first = time.perf_counter() - start
            for _ in stream:
                pass
            _sync(device)
            start = time.perf_counter()
            results = engine.generate(batch, params)
            _sync(device)
            seconds = time.perf_counter() - start
            rate = sum(len(r.tokens) for r in results) / seconds
            rates[clients] = {"tokens_per_s": rate, "ttft_ms": 1e3 * first}
            print(f"direct {clients:>4} clients: {rate:.0f} tok/s, TTFT {1e3 * first:.1f} ms")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates, alone


def _tp_size(mode: str) -> int:
    """The ``-tp<N>`` part of a mode (1 without one)."""
    return next((int(p[2:]) for p in mode.split("-")[1:] if p.startswith("tp")), 1)


def _server_greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt sent alone (non-streamed, greedy); the answers' token ids (``t<i>`` words)."""
    import urllib.request

    answers = []
    for prompt in prompts:
        body = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": _CHECK_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        answers.append([int(word[1:]) for word in text.split()])
    return answers


def _greedy_check(
    url: str,
    mode: str,
    directory: Path,
    prompts: list[list[int]],
    single: list[list[int]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The server's greedy answers against direct engines of the same and of one GPU."""
    tp = _tp_size(mode)
    served = _server_greedy(url, prompts)
    same = single
    if tp > 1:
        from _serve_tp_reference import direct_tokens

        from mcore_parallel.testing import run_distributed

        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        config = _engine_config(args)
        same = run_distributed(
            direct_tokens,
            tp,
            str(directory),
            prompts,
            config,
            _CHECK_TOKENS,
            backend=backend,
            timeout=300,
        )[0]
    equal_tokens = sum(
        next((i for i, (a, b) in enumerate(zip(s, r)) if a != b), len(r))
        for s, r in zip(served, single)
    )
    check = {
        "engine": mode,
        "tp": tp,
        "prompts": len(prompts),
        "tokens_per_prompt": _CHECK_TOKENS,
        "equal_to_direct_same_tp": sum(s == r for s, r in zip(served, same)),
        "equal_to_direct_one_gpu": sum(s == r for s, r in zip(served, single)),
        "leading_tokens_equal_to_one_gpu": equal_tokens,
    }
    print("greedy check: " + json.dumps(check), flush=True)
    return check


class _Clients:
    """Worker processes that run the streaming clients (``_serve_clients.py``)."""

    def __init__(self, count: int) -> None:
        script = Path(__file__).with_name("_serve_clients.py")
        self.workers = [
            subprocess.Popen(
                [sys.executable, str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]

    def round(
        self,
        url: str,
        prompts: list[list[int]],
        new_tokens: int,
        model_name: str,
        client: str = "raw",
    ) -> dict[str, Any]:
        """All prompts at once, spread over the workers; throughput, TTFT and ITL."""
        start = time.time() + 0.2
        shares = [prompts[w :: len(self.workers)] for w in range(len(self.workers))]
        for worker, share in zip(self.workers, shares):
            job = {
                "url": url,
                "model": model_name,
                "prompts": share,
                "max_tokens": new_tokens,
                "start": start,
                "client": client,
            }
            assert worker.stdin is not None
            worker.stdin.write(json.dumps(job) + "\n")
            worker.stdin.flush()
        results = []
        for worker in self.workers:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError("a client worker died")
            results += json.loads(line)
        wall = max(r["end"] for r in results) - min(r["sent"] for r in results)
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

    def close(self) -> None:
        for worker in self.workers:
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait(30)


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_pid(process: subprocess.Popen) -> int:
    """The engine process of a server (its only child), or the server itself (engine thread)."""
    try:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    except OSError:
        children = []
    return int(children[0]) if children else process.pid


def _server_ttft(url: str) -> tuple[float, int]:
    """Sum and count of the server's time-to-first-token histogram (``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("mcore_inference_time_to_first_token_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("mcore_inference_time_to_first_token_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, int(count)


def _start_server(
    directory: Path, args: argparse.Namespace, mode: str
) -> tuple[subprocess.Popen, str]:
    """Start the server; ``mode`` is ``process`` or ``thread`` (where the engine runs), with
    ``-plain`` appended for asyncio and h11 even where uvloop and httptools are installed,
    ``-w<ms>`` for an admission window (``ServeConfig.admission_window_ms``) and ``-eager`` for
    steps that prefill run eagerly (``ServeConfig.cuda_graph_mixed_steps=False``)."""
    parts = mode.split("-")
    config = _engine_config(args)
    options = {
        "model": str(directory),
        "served_model_name": "bench",
        "port": 0,
        "device": args.device,
        "max_batch_size": config.max_batch_size,
        "max_sequence_length": config.max_sequence_length,
        "block_size": config.block_size,
        "max_waiting_requests": 4 * config.max_batch_size,
        "engine_process": parts[0] == "process",
        "cuda_graph_mixed_steps": config.cuda_graph_mixed_steps and "eager" not in parts[1:],
        "admission_window_ms": next((float(p[1:]) for p in parts[1:] if p[:1] == "w"), 0.0),
        "tp": _tp_size(mode),
    }
    launcher = Path(__file__).with_name("_serve_launch.py")
    command = [sys.executable, str(launcher), json.dumps(options)]
    if "plain" in parts[1:]:
        command.append("--plain-http")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        print(line.rstrip(), flush=True)
        if "listening on" in line:
            return process, line.split("listening on ")[1].split()[0]
    raise RuntimeError(f"the server exited with status {process.wait()} before listening")


def _profile(
    process: subprocess.Popen,
    clients: _Clients,
    url: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    out: Path,
) -> None:
    """Sample the server's threads (and its engine process) with py-spy while it serves."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("profile: py-spy not found", flush=True)
        return
    target = out / f"profile_{args.current_mode}_{len(prompts)}.txt"
    command = [
        py_spy,
        "record",
        "-p",
        str(process.pid),
        "--subprocesses",
        "--threads",
        "-r",
        "250",
        "-f",
        "raw",
        "-d",
        str(args.profile_seconds),
        "-o",
        str(target),
    ]
    spy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rounds = 0
    while spy.poll() is None and rounds < 50:
        clients.round(url, prompts, args.new_tokens, "bench", args.client[0])
        rounds += 1
    output = spy.communicate(timeout=30)[0]
    print(f"profile: {rounds} rounds, {target.name}: {output.strip()[-300:]}", flush=True)


def main() -> None:
    """Run the benchmark and write ``serve.json`` and ``serve.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model, few clients and tokens")
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--concurrency", default=None, help="client counts (1,4,16,64,128,256)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--modes",
        default="process,thread",
        help="where the server runs the engine: process (default of serve) or thread; "
        "a -plain suffix hides uvloop and httptools from uvicorn, -w<ms> sets an admission "
        "window (process-w5), -eager runs steps that prefill without CUDA graphs",
    )
    parser.add_argument("--client-procs", type=int, default=8, help="client worker processes")
    parser.add_argument(
        "--client",
        default="raw",
        help="streaming clients, comma-separated, each measured on every server: raw (HTTP/1.1 "
        "over asyncio, the least client-side work) and/or httpx",
    )
    parser.add_argument(
        "--profile", default="", help="client counts at which py-spy samples the server"
    )
    parser.add_argument("--profile-seconds", type=int, default=3)
    parser.add_argument(
        "--greedy-check",
        type=int,
        default=0,
        help="prompts each server answers alone, compared with direct engines (0: none)",
    )
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.new_tokens = "tiny", 32
        args.concurrency = args.concurrency or "1,4,16"
        args.prompt_len = min(args.prompt_len, 16)
    args.concurrency = args.concurrency or "1,4,16,64,128,256"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = args.modes.split(",")
    args.client = args.client.split(",")
    for kind in args.client:
        if kind not in ("raw", "httpx"):
            parser.error(f"--client {kind!r}; expected raw and/or httpx")
    args.profile = [int(c) for c in args.profile.split(",") if c]
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
    direct, single = _direct(model, prompts, args)
    del model
    gc.collect()

    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    clients = _Clients(args.client_procs)
    try:
        for mode in args.modes:
            args.current_mode = mode
            started = time.perf_counter()
            process, url = _start_server(directory, args, mode)
            print(f"{mode}: server up in {time.perf_counter() - started:.1f} s", flush=True)
            engine_pid = _engine_pid(process)
            try:
                if args.greedy_check:
                    check_prompts = prompts[: args.greedy_check]
                    checks.append(_greedy_check(url, mode, directory, check_prompts, single, args))
                    _write(out, rows, args, device, dtype, checks)
                for count, kind in [(c, k) for c in args.concurrency for k in args.client]:
                    batch = prompts[:count]
                    clients.round(url, batch, 8, "bench", kind)  # warm-up
                    row: dict[str, Any] = {"engine": mode, "client": kind, "clients": count}
                    before = _server_ttft(url)
                    cpu = [_cpu_seconds(pid) for pid in (process.pid, engine_pid)]
                    row.update(clients.round(url, batch, args.new_tokens, "bench", kind))
                    # Busy share of one core from the first request to the last token (the
                    # HTTP process and, when it runs apart, the engine process).
                    wall = row["tokens"] / row["tokens_per_s"]
                    row["http_cpu"] = (_cpu_seconds(process.pid) - cpu[0]) / wall
                    if engine_pid != process.pid:
                        row["engine_cpu"] = (_cpu_seconds(engine_pid) - cpu[1]) / wall
                    after = _server_ttft(url)
                    # Submission to the handler's first token, inside the server (no HTTP).
                    row["server_ttft_mean_ms"] = (
                        1e3 * (after[0] - before[0]) / max(1, after[1] - before[1])
                    )
                    row["direct_tokens_per_s"] = direct[count]["tokens_per_s"]
                    row["direct_ttft_ms"] = direct[count]["ttft_ms"]
                    row["server_over_direct"] = row["tokens_per_s"] / row["direct_tokens_per_s"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    _write(out, rows, args, device, dtype, checks)
                    if count in args.profile and kind == args.client[0]:
                        _profile(process, clients, url, batch, args, out)
            finally:
                process.terminate()
                process.wait(timeout=120)
    finally:
        clients.close()
    _write(out, rows, args, device, dtype, checks)
    print((out / "serve.md").read_text())


def _write(
    out: Path,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    device: torch.device,
    dtype: str,
    checks: list[dict[str, Any]],
) -> None:
    """Write serve.json and serve.md (after every row: a cut-short run keeps what it measured)."""
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
        "greedy_checks": checks,
    }
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Serving, {args.preset} shape (random {dtype} weights), "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens per streaming client, greedy; "
        f"{name}.",
        "",
        "| engine | client | clients | server tok/s | direct tok/s | server / direct | TTFT p50 ms "
        "| TTFT p99 ms | in-server TTFT mean ms | direct TTFT ms | ITL p50 ms | ITL p99 ms "
        "| HTTP CPU | engine CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        engine = f"{100 * row['engine_cpu']:.0f}%" if "engine_cpu" in row else "-"
        lines.append(
            f"| {row['engine']} | {row['client']} | {row['clients']} | {row['tokens_per_s']:.0f} | {row['direct_tokens_per_s']:.0f} "
            f"| {100 * row['server_over_direct']:.0f}% | {row['ttft_p50_ms']:.1f} "
            f"| {row['ttft_p99_ms']:.1f} | {row['server_ttft_mean_ms']:.1f} "
            f"| {row['direct_ttft_ms']:.1f} "
            f"| {row['itl_p50_ms']:.2f} | {row['itl_p99_ms']:.2f} "
            f"| {100 * row['http_cpu']:.0f}% | {engine} |"
        )
    if checks:
        lines += [
            "",
            f"Greedy check: prompts answered alone by the server, {_CHECK_TOKENS} tokens each, "
            "against direct engines.",
            "",
            "| engine | tp | prompts | equal to direct, same tp | equal to direct, one GPU "
            "| leading tokens equal to one GPU |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for check in checks:
            total = check["prompts"] * check["tokens_per_prompt"]
            lines.append(
                f"| {check['engine']} | {check['tp']} | {check['prompts']} "
                f"| {check['equal_to_direct_same_tp']}/{check['prompts']} "
                f"| {check['equal_to_direct_one_gpu']}/{check['prompts']} "
                f"| {check['leading_tokens_equal_to_one_gpu']}/{total} |"
            )
    (out / "serve.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
