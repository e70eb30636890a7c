"""GPU only: ``cuda_graph_mixed_steps`` runs prefill and mixed steps in the decode CUDA graphs with
the results of the eager engine, also for requests that arrive while others decode."""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, RequestStatus, SamplingParams
from mcore_inference.testing import random_prompts
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model():
    config = GPTConfig.from_name(
        "tiny",
        vocab_size=512,
        hidden_size=128,
        num_layers=3,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=256,
        seed=5,
    )
    return GPTModel(config, device="cuda").eval()


def _prompts(count, seed=0):
    return random_prompts(count, seed=seed)


def _params(count):
    return [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            top_p=0.9,
            seed=i,
            max_tokens=6 + 3 * i,
            return_logprobs=True,
        )
        for i in range(count)
    ]


def _config(**overrides):
    fields = dict(
        max_batch_size=64,
        max_sequence_length=128,
        block_size=16,
        max_tokens_per_step=64,
        prefill_chunk_size=24,
        attention_split_size=32,
        cuda_graph_batch_sizes=(4, 16, 64),
    )
    fields.update(overrides)
    return InferenceConfig(**fields)


def _count_eager_steps(engine):
    runner = engine._runner
    eager = runner._eager
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[2])  # the step's token count
        return eager(*args, **kwargs)

    runner._eager = counted
    return calls


def _staggered(engine, prompts, params):
    """Add one request before each of the first steps (a server's arrivals); run to the end."""
    finals = {}
    pending = list(zip(prompts, params))
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(*pending.pop(0))
        for update in engine.step_updates():
            if update.result is not None:
                finals[update.request_id] = update.result
    return [finals[i] for i in sorted(finals)]


def _assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.status == RequestStatus.FINISHED and len(a.tokens) > 0
        assert a.tokens == e.tokens
        torch.testing.assert_close(a.logprobs, e.logprobs, atol=1e-4, rtol=0)


def test_generate_runs_every_step_in_a_graph_with_eager_results(model):
    prompts, params = _prompts(10), _params(10)
    with InferenceEngine(model, _config(use_cuda_graphs=False)) as eager:
        expected = eager.generate(prompts, params)
    with InferenceEngine(model, _config(cuda_graph_mixed_steps=True)) as graphed:
        eager_steps = _count_eager_steps(graphed)
        actual = graphed.generate(prompts, params)
        assert graphed._graphs is not None and 64 in graphed._graphs.captured
    _assert_same(actual, expected)
    assert eager_steps == []  # every step (prefill, mixed, decode) fit the 64-token bucket


def test_arrivals_between_steps_match_the_eager_engine(model):
    prompts, params = _prompts(12, seed=1), _params(12)
    with InferenceEngine(model, _config(use_cuda_graphs=False)) as eager:
        expected = _staggered(eager, prompts, params)
    with InferenceEngine(model, _config(cuda_graph_mixed_steps=True)) as graphed:
        eager_steps = _count_eager_steps(graphed)
        actual = _staggered(graphed, prompts, params)
    _assert_same(actual, expected)
    assert eager_steps == []


def test_steps_larger_than_the_largest_bucket_stay_eager(model):
    prompts, params = _prompts(6, seed=2), _params(6)
    config = _config(cuda_graph_mixed_steps=True, cuda_graph_batch_sizes=(4, 8))
    with InferenceEngine(model, _config(use_cuda_graphs=False)) as eager:
        expected = eager.generate(prompts, params)
    with InferenceEngine(model, config) as graphed:
        eager_steps = _count_eager_steps(graphed)
        actual = graphed.generate(prompts, params)
    _assert_same(actual, expected)
    assert eager_steps and all(count > 8 for count in eager_steps)


def test_single_token_prompt_chunks_next_to_a_full_graph_sample_the_right_rows(model):
    # 7 requests decode in the 8-token graph when the 8th arrives: its 12-token prompt goes one
    # token per step, so every entry of those steps is one token but only the decodes sample.
    generator = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(0, 512, (2 if i < 7 else 12,), generator=generator).tolist() for i in range(8)
    ]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=24, return_logprobs=True
        )
        for i in range(8)
    ]
    config = dict(max_batch_size=8, max_tokens_per_step=8, cuda_graph_batch_sizes=(8,))
    with InferenceEngine(model, _config(use_cuda_graphs=False, **config)) as eager:
        expected = _staggered(eager, prompts, params)
    with InferenceEngine(model, _config(**config)) as graphed:
        eager_steps = _count_eager_steps(graphed)
        runner, shapes = graphed._runner, []
        run = runner.run

        def recorded(microbatch, received, *, has_work):
            if microbatch is not None:
                shapes.append((microbatch.num_tokens, len(microbatch.sample_rows)))
            return run(microbatch, received, has_work=has_work)

        runner.run = recorded
        actual = _staggered(graphed, prompts, params)
    _assert_same(actual, expected)
    assert eager_steps == []
    assert (8, 7) in shapes  # seven decodes and one prompt token, in the graph
