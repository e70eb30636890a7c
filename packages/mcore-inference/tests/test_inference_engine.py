"""InferenceEngine on a tiny GPT against independent references (a full-forward loop, a training
forward, single-request runs)."""

import gc
import weakref

import pytest
import torch
from _engine_configs import engine_config

from mcore_inference import (
    EngineClosedError,
    FinishReason,
    InferenceEngine,
    InvalidRequestError,
    RequestStatus,
    SamplingParams,
)
from mcore_kernels import token_logprobs
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


@pytest.fixture(scope="module")
def model():
    return GPTModel(GPTConfig.from_name("tiny", seed=1234)).eval()


def _prompts(lengths, seed=0, vocab=256):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def _naive_greedy(model, prompt, max_tokens):
    """Re-run the full forward over the whole sequence for every token and take the argmax."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_generation_equals_naive_argmax_loop(model):
    prompts = _prompts([1, 5, 9, 17, 30])
    with InferenceEngine(model, engine_config()) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, result in zip(prompts, results):
        assert result.status == RequestStatus.FINISHED
        assert result.finish_reason == FinishReason.LENGTH
        assert result.tokens == _naive_greedy(model, prompt, 12)


def test_results_independent_of_arrival_order_and_batch_composition(model):
    prompts = _prompts([3, 11, 6, 20, 2, 14], seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, return_logprobs=True),
        SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=8, return_logprobs=True),
        SamplingParams(temperature=1.1, top_p=0.8, seed=6, max_tokens=8, return_logprobs=True),
    ] * 2
    with InferenceEngine(model, engine_config()) as engine:
        together = engine.generate(prompts, params)
        reversed_order = engine.generate(prompts[::-1], params[::-1])[::-1]
        alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    for a, b, c in zip(together, reversed_order, alone):
        assert a.tokens == b.tokens == c.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.logprobs, c.logprobs, atol=1e-5, rtol=0)


def test_chunked_prefill_equals_one_shot_prefill(model):
    prompts = _prompts([23, 40, 7], seed=2)
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=10, return_logprobs=True)
    with InferenceEngine(
        model, engine_config(prefill_chunk_size=64, max_tokens_per_step=128)
    ) as one:
        one_shot = one.generate(prompts, params)
    with InferenceEngine(
        model, engine_config(prefill_chunk_size=3, max_tokens_per_step=8)
    ) as chunked:
        pieces = chunked.generate(prompts, params)
    for a, b in zip(one_shot, pieces):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_logprobs_equal_a_training_forward_at_the_sampling_temperature(model):
    prompts = _prompts([6, 13], seed=3)
    temperature = 0.6
    with InferenceEngine(model, engine_config()) as engine:
        results = engine.generate(
            prompts,
            SamplingParams(temperature=temperature, seed=2, max_tokens=9, return_logprobs=True),
        )
    model.train()
    try:
        for prompt, result in zip(prompts, results):
            sequence = torch.tensor([prompt + result.tokens])
            logits = model(sequence)[0, len(prompt) - 1 : -1]
            expected = token_logprobs(
                logits, torch.tensor(result.tokens), temperature=temperature
            ).detach()
            torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    finally:
        model.eval()


def test_greedy_logprobs_are_at_temperature_one(model):
    prompt = _prompts([5], seed=4)[0]
    with InferenceEngine(model, engine_config()) as engine:
        (result,) = engine.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=4, return_logprobs=True)
        )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.tokens]))[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(result.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible_across_engines(model):
    prompts = _prompts([4, 8], seed=5)
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12)
    with InferenceEngine(model, engine_config()) as engine:
        first = [r.tokens for r in engine.generate(prompts, params)]
    with InferenceEngine(model, engine_config(max_batch_size=2)) as engine:
        second = [r.tokens for r in engine.generate(prompts, params)]
    with InferenceEngine(model, engine_config()) as engine:
        other_seed = [
            r.tokens for r in engine.generate(prompts, SamplingParams(seed=43, max_tokens=12))
        ]
    assert first == second
    assert first != other_seed


def test_multi_token_stop_word_stops_only_when_all_tokens_appear_consecutively(model):
    prompt = _prompts([7], seed=6)[0]
    free_run = _naive_greedy(model, prompt, 10)
    stop_word = tuple(free_run[3:5])
    # A decoy that shares the first token but not the second must not stop the request.
    decoy = (free_run[3], (free_run[4] + 1) % 256)
    with InferenceEngine(model, engine_config()) as engine:
        (result,) = engine.generate(
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=10, stop_words=(decoy, stop_word)),
        )
    first_end = next(
        i + 2 for i in range(len(free_run) - 1) if tuple(free_run[i : i + 2]) == stop_word
    )
    assert result.finish_reason == FinishReason.STOP_WORD
    assert result.tokens == free_run[:first_end]


def test_stop_token_is_kept_and_ends_the_request(model):
    prompt = _prompts([9], seed=7)[0]
    free_run = _naive_greedy(model, prompt, 6)
    with InferenceEngine(model, engine_config()) as engine:
        (result,) = engine.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(free_run[2],))
        )
    assert result.finish_reason == FinishReason.STOP_TOKEN
    assert result.tokens == free_run[: free_run.index(free_run[2]) + 1]


def test_max_tokens_zero_and_one(model):
    prompts = _prompts([5, 5], seed=8)
    with InferenceEngine(model, engine_config()) as engine:
        zero, one = engine.generate(
            prompts,
            [
                SamplingParams(temperature=0.0, max_tokens=0, return_logprobs=True),
                SamplingParams(temperature=0.0, max_tokens=1, return_logprobs=True),
            ],
        )
        assert engine.allocator.num_free == engine.allocator.capacity
    assert zero.status == RequestStatus.FINISHED and zero.finish_reason == FinishReason.LENGTH
    assert zero.tokens == [] and zero.logprobs == []
    assert one.tokens == _naive_greedy(model, prompts[1], 1) and len(one.logprobs) == 1


def test_generation_stops_at_max_sequence_length(model):
    prompt = _prompts([60], seed=9)[0]
    with InferenceEngine(model, engine_config()) as engine:
        (result,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50))
    assert result.finish_reason == FinishReason.LENGTH
    assert result.tokens == _naive_greedy(model, prompt, 4)


def test_bad_requests_fail_alone_with_a_message(model):
    good = _prompts([5, 6], seed=10)
    prompts = [good[0], [], [3, 999], list(range(65)), good[1], [1, 2]]
    params = [SamplingParams(temperature=0.0, max_tokens=5)] * 5 + [
        SamplingParams(stop_words=("text",))
    ]
    with InferenceEngine(model, engine_config()) as engine:
        results = engine.generate(prompts, params)
    assert [r.status for r in results] == [RequestStatus.FINISHED] + [RequestStatus.FAILED] * 3 + [
        RequestStatus.FINISHED,
        RequestStatus.FAILED,
    ]
    assert "non-empty" in results[1].error
    assert "999" in results[2].error and "[0, 256)" in results[2].error
    assert "prompt length 65" in results[3].error
    assert "tokenizer_path" in results[5].error
    assert all(r.finish_reason == FinishReason.ERROR for r in results if r.error)
    assert results[0].tokens == _naive_greedy(model, good[0], 5)
    assert results[4].tokens == _naive_greedy(model, good[1], 5)


def test_request_larger_than_the_whole_cache_fails_alone(model):
    with InferenceEngine(model, engine_config(num_blocks=4)) as engine:
        small, huge = engine.generate(
            _prompts([3, 30], seed=11), SamplingParams(temperature=0.0, max_tokens=4)
        )
    assert small.status == RequestStatus.FINISHED
    assert huge.status == RequestStatus.FAILED and "KV blocks" in huge.error


def test_admission_waits_for_free_blocks_instead_of_overcommitting(model):
    prompts = _prompts([8] * 6, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    # Each request needs 4 blocks of 4 tokens; 9 usable blocks admit two at a time.
    with InferenceEngine(model, engine_config(num_blocks=9)) as engine:
        for prompt in prompts:
            engine.add_request(prompt, params)
        finished = {}
        while engine.has_unfinished():
            for result in engine.step():
                if result.done:
                    finished[result.request_id] = result
            assert engine.num_active <= 2
            assert engine.allocator.num_free >= 0
        assert engine.allocator.num_free == engine.allocator.capacity
    for index, prompt in enumerate(prompts):
        assert finished[index].tokens == _naive_greedy(model, prompt, 8)


def test_abort_frees_blocks_and_reports_aborted(model):
    prompts = _prompts([10, 10, 10], seed=13)
    with InferenceEngine(model, engine_config()) as engine:
        ids = [
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in prompts
        ]
        engine.step()
        engine.step()
        held = engine.allocator.capacity - engine.allocator.num_free
        assert held > 0
        assert engine.abort(ids[1])
        assert not engine.abort(ids[1])
        assert engine.allocator.capacity - engine.allocator.num_free < held
        reports = {r.request_id: r for r in engine.step()}
        assert reports[ids[1]].finish_reason == FinishReason.ABORTED
        assert reports[ids[1]].status == RequestStatus.FINISHED
        engine.abort(ids[0])
        engine.abort(ids[2])
        while engine.has_unfinished():
            engine.step()
        assert engine.allocator.num_free == engine.allocator.capacity


def test_stream_yields_growing_snapshots_ending_with_the_generate_result(model):
    prompts = _prompts([4, 9], seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    with InferenceEngine(model, engine_config()) as engine:
        snapshots = list(engine.stream(prompts, params))
        final = engine.generate(prompts, params)
    for index, expected in enumerate(final):
        mine = [s for s in snapshots if s.request_id == index]
        assert [len(s.tokens) for s in mine] == [1, 2, 3, 4, 5]
        assert mine[-1].done and mine[-1].tokens == expected.tokens


def test_closing_a_stream_early_aborts_its_requests_and_frees_their_blocks(model):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    with InferenceEngine(model, engine_config()) as engine:
        stream = engine.stream(_prompts([4, 9], seed=18), params)
        first = next(stream)
        assert not first.done
        assert engine.allocator.num_free < engine.allocator.capacity
        stream.close()
        assert not engine.has_unfinished()
        assert engine.allocator.num_free == engine.allocator.capacity
        prompt = _prompts([6], seed=19)[0]
        (after,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))
    assert after.tokens == _naive_greedy(model, prompt, 3)


class _FailingOnceModel(torch.nn.Module):
    """Delegates to a real model but raises in one chosen forward call (fault injection)."""

    def __init__(self, inner, fail_at):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return self.inner(*args, **kwargs)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


def test_failed_step_fails_its_requests_and_the_engine_goes_on(model):
    prompts = _prompts([5, 7], seed=15)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with InferenceEngine(_FailingOnceModel(model, fail_at=2), engine_config()) as engine:
        failed = engine.generate(prompts, params)
        assert engine.allocator.num_free == engine.allocator.capacity
        later = engine.generate(prompts, params)
    assert all(r.status == RequestStatus.FAILED and "injected failure" in r.error for r in failed)
    assert [r.tokens for r in later] == [_naive_greedy(model, p, 4) for p in prompts]


def test_close_releases_the_cache_and_refuses_new_work(model):
    engine = InferenceEngine(model, engine_config())
    engine.generate(_prompts([4]), SamplingParams(max_tokens=2))
    cache_ref = weakref.ref(engine.kv_cache)
    keys_ref = weakref.ref(engine.kv_cache.keys)
    engine.close()
    gc.collect()
    assert cache_ref() is None and keys_ref() is None
    with pytest.raises(EngineClosedError):
        engine.add_request([1, 2], SamplingParams())
    engine.close()


def test_model_modules_weights_mode_and_hooks_are_unchanged_by_generation(model):
    modules = [(name, type(m)) for name, m in model.named_modules()]
    weights = {name: p.detach().clone() for name, p in model.state_dict().items()}
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    training = [m.training for m in model.modules()]
    with InferenceEngine(model, engine_config()) as engine:
        engine.generate(_prompts([5]), SamplingParams(max_tokens=3))
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    assert all(torch.equal(t, weights[name]) for name, t in model.state_dict().items())
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks
    assert [m.training for m in model.modules()] == training


def test_params_list_length_mismatch_raises(model):
    with (
        InferenceEngine(model, engine_config()) as engine,
        pytest.raises(InvalidRequestError, match="2 entries"),
    ):
        engine.generate(_prompts([3, 3, 3]), [SamplingParams()] * 2)


def test_add_requests_equals_successive_add_request(model):
    """The server's batched adds: the same ids, seeds and results as one add_request each."""
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4]]
    params = [SamplingParams(temperature=0.8, max_tokens=6), None, SamplingParams(max_tokens=4)]

    def run(batched):
        with InferenceEngine(model, engine_config(max_batch_size=4, seed=3)) as engine:
            if batched:
                ids = engine.add_requests(prompts, params)
            else:
                ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
            final = {}
            while engine.has_unfinished():
                for result in engine.step():
                    final[result.request_id] = result.tokens
            with pytest.raises(InvalidRequestError, match="params has 1 entries"):
                engine.add_requests(prompts[:2], params[:1])
        return ids, final

    assert run(batched=True) == run(batched=False)


def test_moe_model_greedy_generation_equals_naive_argmax_loop():
    moe = {"num_experts": 4, "top_k": 2}
    moe_model = GPTModel(GPTConfig.from_name("tiny", num_layers=2, moe=moe, seed=9)).eval()
    prompts = _prompts([4, 11], seed=16)
    with InferenceEngine(moe_model, engine_config()) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    for prompt, result in zip(prompts, results):
        assert result.tokens == _naive_greedy(moe_model, prompt, 6)


def test_tensor_prompt_is_served_like_a_list(model):
    prompt = _prompts([6], seed=17)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    with InferenceEngine(model, engine_config()) as engine:
        as_list, as_tensor = engine.generate([prompt, torch.tensor(prompt)], params)
    assert as_tensor.status == RequestStatus.FINISHED
    assert as_tensor.tokens == as_list.tokens == _naive_greedy(model, prompt, 3)
