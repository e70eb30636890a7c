"""The server's engine thread (``mcore_inference.serve.engine_loop``) without HTTP: results equal
``engine.generate``, aborts free blocks, back-pressure refuses whole submissions, shutdown fails
what is left and closes the engine."""

import asyncio

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, RequestStatus, SamplingParams
from mcore_inference.serve.engine_loop import EngineLoop, EngineLoopStoppedError, QueueFullError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return GPTModel(GPTConfig.from_name("tiny", seed=3)).eval()


def _engine(model):
    config = InferenceConfig(max_batch_size=2, max_sequence_length=256, block_size=4)
    return InferenceEngine(model, config)


async def _until(condition, timeout=20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_results_equal_engine_generate(model):
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=6, return_logprobs=True)
    with _engine(model) as engine:
        expected = engine.generate(prompts, params)

    async def run():
        loop = EngineLoop(_engine(model), max_waiting_requests=8)
        loop.start()
        notify = asyncio.Event()
        handles = loop.submit([(p, params) for p in prompts], notify)
        await _until(lambda: all(h.finished for h in handles))
        await asyncio.to_thread(loop.stop)
        return [h.latest for h in handles], loop

    results, loop = asyncio.run(run())
    assert [r.tokens for r in results] == [e.tokens for e in expected]
    for result, reference in zip(results, expected):
        assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert loop.stats.generation_tokens_total == sum(len(e.tokens) for e in expected)
    assert loop.engine.closed


def test_abort_frees_blocks_of_running_and_queued_requests(model):
    long = SamplingParams(temperature=0.0, max_tokens=200)

    async def run():
        loop = EngineLoop(_engine(model), max_waiting_requests=8)
        loop.start()
        handles = loop.submit([([1, 2], long)] * 3, asyncio.Event())
        await _until(lambda: handles[0].latest is not None and loop.stats.num_running == 2)
        assert loop.stats.kv_blocks_used > 0 and loop.num_waiting == 1
        for handle in handles:
            loop.abort(handle)
        await _until(lambda: loop.stats.kv_blocks_used == 0 and loop.stats.num_waiting == 0)
        assert loop.num_waiting == 0
        await asyncio.to_thread(loop.stop)
        return handles

    handles = asyncio.run(run())
    assert all(h.finished for h in handles)
    assert all(h.latest is None or not h.latest.done for h in handles)


def test_submission_beyond_max_waiting_is_refused_whole(model):
    async def run():
        loop = EngineLoop(_engine(model), max_waiting_requests=2)
        loop.start()
        params = SamplingParams(max_tokens=4)
        with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
            loop.submit([([1], params)] * 3, asyncio.Event())
        assert loop.num_waiting == 0
        handles = loop.submit([([1], params)] * 2, asyncio.Event())
        await _until(lambda: all(h.finished for h in handles))
        await asyncio.to_thread(loop.stop)
        with pytest.raises(EngineLoopStoppedError):
            loop.submit([([1], params)], asyncio.Event())

    asyncio.run(run())


def test_stop_fails_the_open_requests_and_closes_the_engine(model):
    async def run():
        loop = EngineLoop(_engine(model), max_waiting_requests=8)
        loop.start()
        notify = asyncio.Event()
        (handle,) = loop.submit([([3, 4], SamplingParams(max_tokens=250))], notify)
        await _until(lambda: handle.latest is not None)
        await asyncio.to_thread(loop.stop)
        await _until(lambda: handle.finished)
        return handle, loop

    handle, loop = asyncio.run(run())
    assert handle.latest.status == RequestStatus.FAILED
    assert "shutting down" in handle.latest.error
    assert loop.engine.closed and not loop.running
