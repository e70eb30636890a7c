"""The server's engine thread (``mcore_inference.serve.engine_loop``) without HTTP: results equal
``engine.generate``, aborts free blocks, back-pressure refuses whole submissions, shutdown fails
what is left and closes the engine."""

import asyncio

import pytest

from mcore_inference import InferenceConfig, InferenceEngine, RequestStatus, SamplingParams
from mcore_inference.serve.engine_loop import EngineLoop, EngineLoopStoppedError, QueueFullError
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


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
        return handles, loop

    handles, loop = asyncio.run(run())
    # The streamed tokens add up to the final results, and both equal engine.generate.
    assert [h.tokens for h in handles] == [e.tokens for e in expected]
    assert [h.result.tokens for h in handles] == [e.tokens for e in expected]
    for handle, reference in zip(handles, expected):
        assert handle.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
        assert handle.result.finish_reason == reference.finish_reason
    assert loop.stats.generation_tokens_total == sum(len(e.tokens) for e in expected)
    assert loop.engine.closed


def test_abort_frees_blocks_of_running_and_queued_requests(model):
    long = SamplingParams(temperature=0.0, max_tokens=200)

    async def run():
        loop = EngineLoop(_engine(model), max_waiting_requests=8)
        loop.start()
        handles = loop.submit([([1, 2], long)] * 3, asyncio.Event())
        await _until(lambda: handles[0].tokens and loop.stats.num_running == 2)
        assert loop.stats.kv_blocks_used > 0 and loop.num_waiting == 1
        for handle in handles:
            loop.abort(handle)
        await _until(lambda: loop.stats.kv_blocks_used == 0 and loop.stats.num_waiting == 0)
        assert loop.num_waiting == 0
        await asyncio.to_thread(loop.stop)
        return handles

    handles = asyncio.run(run())
    assert all(h.finished for h in handles)
    assert all(h.result is None for h in handles)  # aborted: no result is handed out


def test_submission_beyond_max_waiting_is_refused_whole(model):
    async def run():
        loop = EngineLoop(_engine(model), max_waiting_requests=2)
        loop.start()
        params = SamplingParams(max_tokens=4)
        # Two batch slots and two waiting places: five requests are one too many ...
        with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
            loop.submit([([1], params)] * 5, asyncio.Event())
        assert loop.num_waiting == 0
        # ... four fit, submitted at once before the engine thread picks any of them up.
        handles = loop.submit([([1], params)] * 4, asyncio.Event())
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
        await _until(lambda: handle.tokens)
        await asyncio.to_thread(loop.stop)
        await _until(lambda: handle.finished)
        return handle, loop

    handle, loop = asyncio.run(run())
    assert handle.result.status == RequestStatus.FAILED
    assert "shutting down" in handle.result.error
    assert loop.engine.closed and not loop.running


def test_step_updates_add_up_to_the_generate_results(model):
    """The engine hook the loop runs on: new tokens per step, the result once, at the end."""
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5]]
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=7, return_logprobs=True)
    with _engine(model) as engine:
        expected = engine.generate(prompts, params)
    with _engine(model) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        bad = engine.add_request([], params)
        aborted = engine.add_request([1, 2], SamplingParams(max_tokens=50))
        tokens = {i: [] for i in [*ids, bad, aborted]}
        logprobs = {i: [] for i in tokens}
        results = {}
        while engine.has_unfinished():
            for update in engine.step_updates():
                assert update.request_id not in results, "an update after the result"
                tokens[update.request_id] += update.new_tokens
                if update.new_logprobs is not None:
                    logprobs[update.request_id] += update.new_logprobs
                if update.result is not None:
                    results[update.request_id] = update.result
            if len(tokens[aborted]) >= 2 and aborted not in results:
                engine.abort(aborted)
    for request_id, reference in zip(ids, expected):
        assert tokens[request_id] == reference.tokens == results[request_id].tokens
        assert logprobs[request_id] == pytest.approx(reference.logprobs, abs=1e-5)
    assert results[bad].status == RequestStatus.FAILED and tokens[bad] == []
    assert results[aborted].finish_reason.value == "aborted"
    assert tokens[aborted] == results[aborted].tokens and 0 < len(tokens[aborted]) < 50
