"""Sampled tokens read back one step late (``async_token_readback``): the same results as the
synchronous engine, with continuing requests fed their token on the device."""

from __future__ import annotations

import pytest
import torch

from mcore_inference import (
    FinishReason,
    InferenceConfig,
    InferenceEngine,
    RequestStatus,
    SamplingParams,
)
from mcore_models import GPTConfig, GPTModel


@pytest.fixture(scope="module")
def model() -> GPTModel:
    return GPTModel(GPTConfig.from_name("tiny", vocab_size=64, seed=21)).eval()


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 64, (int(length),), generator=generator).tolist()
        for length in torch.randint(1, 12, (count,), generator=generator)
    ]


def _run(model, prompts, params, *, readback: bool, max_batch_size: int = 3):
    config = InferenceConfig(
        max_batch_size=max_batch_size,
        max_sequence_length=48,
        block_size=4,
        prefill_chunk_size=5,
        async_token_readback=readback,
    )
    with InferenceEngine(model, config) as engine:
        assert (engine._readback is not None) == readback
        results = engine.generate(prompts, params)
        assert engine.allocator.num_free == engine.allocator.capacity
        assert not engine.has_unfinished()
    return [(r.tokens, r.logprobs, r.finish_reason) for r in results]


def test_deferred_readback_generates_exactly_what_the_synchronous_engine_does(model):
    # More requests than slots (admission mid-run), chunked prefill, greedy and seeded sampling
    # with top-k/top-p, different lengths.
    prompts = _prompts(7, seed=1)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            top_k=0 if i % 3 else 9,
            top_p=0.9 if i == 5 else 1.0,
            seed=100 + i,
            max_tokens=3 + 2 * i,
            return_logprobs=True,
        )
        for i in range(len(prompts))
    ]
    expected = _run(model, prompts, params, readback=False)
    assert _run(model, prompts, params, readback=True) == expected


def test_stop_token_found_one_step_late_gives_the_same_results(model):
    prompts = _prompts(4, seed=2)
    free_run = _run(model, prompts, SamplingParams(temperature=0.0, max_tokens=12), readback=False)
    # A token each request produces mid-way: it then stops there, a step after it was decoded.
    stop = free_run[0][0][4]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[stop], return_logprobs=True
    )
    expected = _run(model, prompts, params, readback=False)
    assert expected[0][2] == FinishReason.STOP_TOKEN and len(expected[0][0]) <= 5
    # A stop frees the blocks a step later, so later admissions (and batch shapes) may shift:
    # tokens and reasons are equal, logprobs equal up to the GEMM's batch-shape rounding.
    for batch_size in (3, 1):
        actual = _run(model, prompts, params, readback=True, max_batch_size=batch_size)
        for (tokens, logprobs, reason), (e_tokens, e_logprobs, e_reason) in zip(actual, expected):
            assert tokens == e_tokens and reason == e_reason
            torch.testing.assert_close(logprobs, e_logprobs, atol=1e-5, rtol=0)


def test_continuing_request_is_fed_its_unread_token_on_the_device(model):
    # Single steps (multi-step decode would run the rest of the request in one call).
    config = InferenceConfig(
        max_batch_size=2, max_sequence_length=32, block_size=4, multi_step_decode=1
    )
    with InferenceEngine(model, config) as engine:
        request_id = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6))
        engine.step()  # prefill: samples the first token, read back later
        assert engine._deferred is not None
        request = engine.scheduler.find(request_id)
        assert request is not None and request.output == [] and request.deferred_index == 0
        engine.step()  # decodes that token from the device, then reads it
        assert len(request.output) == 1 and request.num_computed == 4
        while engine.has_unfinished():
            engine.step()
    synchronous_config = InferenceConfig(
        max_batch_size=2, max_sequence_length=32, block_size=4, async_token_readback=False
    )
    with InferenceEngine(model, synchronous_config) as synchronous:
        expected = synchronous.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6))
    assert request.output == expected[0].tokens
    assert request.status == RequestStatus.FINISHED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deferred_readback_with_graphs_on_gpu_matches_the_synchronous_engine():
    gpu_model = GPTModel(GPTConfig.from_name("tiny", vocab_size=64, seed=21)).eval().cuda()
    prompts = _prompts(7, seed=3)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=4 + i, return_logprobs=True
        )
        for i in range(len(prompts))
    ]
    expected = _run(gpu_model, prompts, params, readback=False)
    assert _run(gpu_model, prompts, params, readback=True) == expected
