"""Shared by the ``serve`` test files: a tiny checkpoint with varied greedy text, starting
``mcore-inference serve`` in a subprocess, the engine reference, reading ``/metrics`` and
watching processes."""

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mcore_inference import FinishReason, SamplingParams
from mcore_inference.testing import write_tiny_hf_checkpoint
from mcore_models import GPTModel

MODEL = "tiny"
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


def serve_command(checkpoint, *options, device="cpu", context=CONTEXT):
    """The ``mcore-inference serve`` command line of the tests (a free port, ``options``)."""
    return [
        sys.executable,
        "-m",
        "mcore_inference.cli",
        "serve",
        "--model",
        str(checkpoint),
        "--served-model-name",
        MODEL,
        "--port",
        "0",
        "--device",
        device,
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-sequence-length",
        str(context),
        "--timeout-graceful-shutdown",
        "2",
        *options,
    ]


@dataclasses.dataclass
class Server:
    """A running ``serve`` process as the tests see it."""

    process: subprocess.Popen
    """The server process (stdout still open: it prints "stopped" when it ends)."""
    url: str
    """Its base URL."""
    pids: list[int]
    """The engine's processes, rank 0 first (the server's own pid for an engine thread)."""
    lines: list[str]
    """Its startup lines, up to "listening on"."""

    @property
    def summary(self):
        """The startup line describing the model and where the engine runs."""
        return next(line for line in self.lines if "parameters" in line)


def launch(checkpoint, log, *options, device="cpu", context=CONTEXT):
    """Start ``serve`` in a new session (stderr to ``log``) and wait until it listens.

    Returns:
        The :class:`Server`.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            serve_command(checkpoint, *options, device=device, context=context),
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
    summary = next(line for line in lines if "parameters" in line)
    if "engine in process " in summary:
        pids = [int(summary.split("engine in process ")[1].split()[0])]
    elif "engine in processes " in summary:
        where = summary.split("engine in processes ")[1].split(" (")[0]
        pids = [int(pid) for pid in where.split(", ")]
    else:
        pids = [process.pid]
    return Server(process, line.split("listening on ")[1].split()[0], pids, lines)


def greedy(tokenizer, max_tokens, **fields):
    """Greedy sampling up to the checkpoint's end of sequence, as the server samples ``temperature=0``."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, stop_token_ids=tokenizer.eos_token_ids, **fields
    )


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


def metrics(url):
    """Samples of ``/metrics`` by name, labels other than the model's as a sorted tuple."""
    # Imported here: the GPU test file needs neither (a GPU machine may lack the test group).
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels) if labels else sample.name] = sample.value
    return samples


def aborted(samples):
    """Choices finished by an abort so far."""
    return samples.get(("mcore_inference_request_finished_total", (("finish_reason", "abort"),)), 0)


def rank_blocks(samples, tp):
    """KV blocks held on each of the ``tp`` engine ranks."""
    name = "mcore_inference_rank_kv_cache_blocks_used"
    return [samples[(name, (("rank", str(rank)),))] for rank in range(tp)]


def wait_for(url, condition, what, timeout=30.0):
    """Poll ``/metrics`` until ``condition(samples)`` holds; fail naming ``what`` otherwise.

    Returns:
        The samples that met the condition.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = metrics(url)
        if condition(samples):
            return samples
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; last metrics: {samples}")


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
