"""Shared by the ``serve`` test files: a tiny checkpoint with varied greedy text, starting
``mcore-inference serve`` in a subprocess, the engine reference, and watching processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mcore_inference import FinishReason
from mcore_inference.testing import write_tiny_hf_checkpoint
from mcore_models import GPTModel

MODEL = "tiny-tp"
MAX_BATCH = 8
CONTEXT = 2048


def varied_checkpoint(directory, seed=1):
    """A tiny Qwen2 checkpoint (4 heads, 2 KV heads) with weights large enough for varied text.

    Args:
        directory: Where to write it.
        seed: Seed of the weights.

    Returns:
        The checkpoint directory.
    """
    directory = write_tiny_hf_checkpoint(directory, hidden_size=64, intermediate_size=128)
    model = GPTModel.from_hf(directory)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                scale = 2.0 / parameter.shape[-1] ** 0.5
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.to_hf(directory)
    return directory


def serve_command(checkpoint, *options, model=MODEL):
    """The ``mcore-inference serve`` command line of the tests (CPU, a free port, ``options``)."""
    return [
        sys.executable,
        "-m",
        "mcore_inference.cli",
        "serve",
        "--model",
        str(checkpoint),
        "--served-model-name",
        model,
        "--port",
        "0",
        "--device",
        "cpu",
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-sequence-length",
        str(CONTEXT),
        "--timeout-graceful-shutdown",
        "2",
        *options,
    ]


def start(checkpoint, log, *options, model=MODEL):
    """Start ``serve`` in a new session and wait until it listens.

    Returns:
        The process, its base URL and its startup lines.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            serve_command(checkpoint, *options, model=model),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    lines = []
    while True:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"the server exited before listening: {Path(log).read_text()}")
        lines.append(line.strip())
        if "listening on" in line:
            break
    return process, line.split("listening on ")[1].split()[0], lines


def launch(checkpoint, log, *options):
    """Start ``serve`` with several engine ranks; its process, URL, rank pids and startup lines."""
    process, url, lines = start(checkpoint, log, *options)
    summary = next(line for line in lines if "parameters" in line)
    pids = [int(p) for p in summary.split("engine in processes ")[1].split(" (")[0].split(", ")]
    return process, url, pids, lines


def reference(engine, tokenizer, prompts, params):
    """engine.generate, then each result's text, OpenAI finish reason and result."""
    results = engine.generate(prompts, params)
    return [
        (
            tokenizer.decode(r.tokens),
            "stop" if r.finish_reason == FinishReason.STOP_TOKEN else "length",
            r,
        )
        for r in results
    ]


def alive(pid):
    """True while the process exists and is not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def cpu_seconds(pid):
    """User plus system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gone(pids, timeout=20.0):
    """Wait until none of ``pids`` runs; False if one still does after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop(process):
    """Kill a server still running (test cleanup)."""
    if process.poll() is None:
        process.kill()
        process.wait(30)


def long_stream_body(n=1):
    """A streamed completion of ``n`` choices that runs for a long while (end of sequence ignored)."""
    return {
        "model": MODEL,
        "prompt": "Compute",
        "max_tokens": 1900,
        "n": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
