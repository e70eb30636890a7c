"""The server's engine process (``mcore_inference.serve.engine_process``) without HTTP: results
equal ``engine.generate`` in this process, aborts free blocks in the child, stop and the death
of the server end the child, a checkpoint that does not load is reported; the child's loop
holds arrivals for its admission window."""

import asyncio
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _serve_helpers import alive, gone

from mcore_inference import InferenceConfig, InferenceEngine, RequestStatus, SamplingParams
from mcore_inference.serve.engine_process import EngineProcess, EngineProcessError, EngineSpec
from mcore_inference.serve.engine_worker import _serve
from mcore_inference.testing import write_tiny_hf_checkpoint
from mcore_models import GPTConfig, GPTModel

CONFIG = InferenceConfig(max_batch_size=2, max_sequence_length=256, block_size=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_process_ckpt"), seed=5)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the child


def _spec(directory):
    return EngineSpec(model=str(directory), device="cpu", dtype=None, engine=CONFIG)


async def _until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_results_equal_engine_generate_and_abort_frees_the_blocks(checkpoint):
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=6, return_logprobs=True)
    with InferenceEngine(GPTModel.from_hf(checkpoint).eval(), CONFIG) as engine:
        expected = engine.generate(prompts, params)
        capacity = engine.allocator.capacity
    process = EngineProcess(_spec(checkpoint), max_waiting_requests=8)
    info = process.launch(timeout=120)
    assert info.pid == process.pid != os.getpid()
    assert info.kv_blocks == capacity and info.vocab_size == 160 and info.num_layers == 2

    async def run():
        process.start()
        handles = process.submit([(p, params) for p in prompts], asyncio.Event())
        await _until(lambda: all(h.finished for h in handles))
        long = process.submit([([1, 2], SamplingParams(max_tokens=200))] * 3, asyncio.Event())
        await _until(lambda: long[0].tokens and process.stats.num_running == 2)
        assert process.stats.kv_blocks_used > 0 and process.num_waiting == 1
        for handle in long:
            process.abort(handle)
        await _until(lambda: process.stats.kv_blocks_used == 0 and process.stats.num_waiting == 0)
        await asyncio.to_thread(process.stop, 30)
        return handles, long

    try:
        handles, long = asyncio.run(run())
    finally:
        process.stop(30)
    assert [h.tokens for h in handles] == [e.tokens for e in expected]
    assert [h.result.tokens for h in handles] == [e.tokens for e in expected]
    for handle, reference in zip(handles, expected):
        assert handle.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
        assert handle.result.finish_reason == reference.finish_reason
    assert all(h.finished and h.result is None for h in long)  # aborted: no result
    assert process.stats.generation_tokens_total >= sum(len(e.tokens) for e in expected)
    assert not alive(info.pid) and not process.running


def test_stop_fails_the_open_requests_and_ends_the_child(checkpoint):
    process = EngineProcess(_spec(checkpoint), max_waiting_requests=8)
    pid = process.launch(timeout=120).pid
    # A terminal's Ctrl-C (or a TERM sent to the whole group) is the server's to handle.
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)

    async def run():
        process.start()
        (handle,) = process.submit([([3, 4], SamplingParams(max_tokens=250))], asyncio.Event())
        await _until(lambda: handle.tokens)
        assert alive(pid) and process.running  # the signals did not end it
        await asyncio.to_thread(process.stop, 30)
        await _until(lambda: handle.finished)
        return handle

    handle = asyncio.run(run())
    assert handle.result.status == RequestStatus.FAILED
    assert "shutting down" in handle.result.error
    assert not alive(pid)


_SERVER = textwrap.dedent(
    """
    import sys
    import time

    from mcore_inference import InferenceConfig
    from mcore_inference.serve.engine_process import EngineProcess, EngineSpec

    config = InferenceConfig(max_batch_size=2, max_sequence_length=256, block_size=4)
    spec = EngineSpec(model=sys.argv[1], device="cpu", dtype=None, engine=config)
    process = EngineProcess(spec, max_waiting_requests=8)
    print(process.launch(timeout=120).pid, flush=True)
    time.sleep(600)
    """
)


def test_the_child_dies_with_a_killed_server(checkpoint):
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(checkpoint)], stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(server.stdout.readline())
        assert alive(pid)
        server.send_signal(signal.SIGKILL)  # no shutdown code runs in the server
        server.wait(10)
        assert gone([pid], timeout=20), "the engine process outlived the server"
    finally:
        server.kill()
        server.wait()


def test_a_checkpoint_that_does_not_load_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    process = EngineProcess(_spec(tmp_path), max_waiting_requests=8)
    with pytest.raises(EngineProcessError, match=f"loading '{tmp_path}' failed"):
        process.launch(timeout=120)
    assert not alive(process.pid)


class _Messages:
    """The child's message pipe, in this process: what ``_serve`` sends, in order."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def steps(self):
        """Every step message as its list of ``(key, new_tokens, new_logprobs, result)``."""
        unpacked = []
        for message in self.sent:
            if message[0] != "step":
                continue
            _, keys, tokens, updates, _ = message
            singles = zip(memoryview(keys).cast("q"), memoryview(tokens).cast("q"))
            unpacked.append([(k, [t], None, None) for k, t in singles] + list(updates))
        return unpacked


def _run_serve(window, commands_before, commands_during):
    """``_serve`` on a thread over a CPU engine: one long request, then more commands."""
    model = GPTModel(GPTConfig.from_name("tiny", seed=3)).eval()
    engine = InferenceEngine(model, CONFIG)
    commands, messages = queue.SimpleQueue(), _Messages()
    thread = threading.Thread(target=_serve, args=(engine, commands, messages, window))
    thread.start()
    for command in commands_before:
        commands.put(command)
    deadline = time.monotonic() + 30
    while not any(messages.steps()):  # the long one decodes
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for command in commands_during:
        commands.put(command)
    while engine.has_unfinished() or not commands.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)
    commands.put(None)
    thread.join(30)
    engine.close()
    return messages.steps()


def test_admission_window_holds_arrivals_and_admits_them_together():
    # Long enough to still run when the others arrive (multi-step decode: 8 tokens a step).
    long = SamplingParams(temperature=0.0, max_tokens=64)
    short = SamplingParams(temperature=0.0, max_tokens=3)
    before = [("add", 0, [1, 2, 3], long)]
    during = [("add", k, [4, 5, k], short) for k in (1, 2, 3)] + [("abort", 2)]
    for window, joins_while_running in ((0.0, True), (60.0, False)):
        steps = _run_serve(window, before, during)
        finals = {key: result for m in steps for key, _, _, result in m if result is not None}
        first = {
            k: next(i for i, m in enumerate(steps) if any(u[0] == k for u in m)) for k in (1, 3)
        }
        long_done = next(i for i, m in enumerate(steps) if 0 in {u[0] for u in m if u[3]})
        # Held for a minute: admitted only once the engine ran dry, both in the same step.
        assert (first[1] < long_done) == joins_while_running
        if not joins_while_running:
            assert first[1] == first[3]
        assert set(finals) == {0, 1, 3}  # 2 was aborted (held or running): no result
        assert all(len(finals[k].tokens) == 3 for k in (1, 3))
        assert len(finals[0].tokens) == 64
