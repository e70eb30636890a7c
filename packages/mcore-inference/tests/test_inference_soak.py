"""A 2000-request random soak: continuous arrivals, aborts and bad requests on a small cache."""

import random

from mcore_inference import (
    FinishReason,
    InferenceConfig,
    InferenceEngine,
    RequestStatus,
    SamplingParams,
)
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel

NUM_REQUESTS = 2000


def _random_request(rng):
    """A random prompt and params; about 3% are invalid in one of several ways."""
    kind = rng.random()
    prompt = [rng.randrange(64) for _ in range(rng.randint(1, 12))]
    if kind < 0.01:
        return [], SamplingParams()
    if kind < 0.02:
        return [*prompt, 100_000], SamplingParams()
    if kind < 0.03:
        return list(range(40)), SamplingParams()  # longer than max_sequence_length
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        seed=rng.randrange(10**6),
        max_tokens=rng.randint(0, 8),
        stop_token_ids=tuple(rng.sample(range(64), 2)),
        stop_words=((rng.randrange(64), rng.randrange(64)),),
        return_logprobs=rng.random() < 0.5,
    )
    return prompt, params


def test_random_soak_every_request_ends_with_a_status_and_all_blocks_return():
    model = GPTModel(GPTConfig.from_name("tiny", vocab_size=64, num_layers=1, seed=7)).eval()
    config = InferenceConfig(
        max_batch_size=32,
        max_sequence_length=32,
        block_size=4,
        num_blocks=48,
        max_tokens_per_step=48,
        prefill_chunk_size=8,
    )
    rng = random.Random(0)
    submitted: dict[int, tuple[list[int], SamplingParams]] = {}
    finals = {}
    aborted = set()
    with InferenceEngine(model, config) as engine:
        while len(submitted) < NUM_REQUESTS or engine.has_unfinished():
            for _ in range(rng.randint(0, 12)):
                if len(submitted) < NUM_REQUESTS:
                    prompt, params = _random_request(rng)
                    submitted[engine.add_request(prompt, params)] = (prompt, params)
            if submitted and rng.random() < 0.05:
                victim = rng.choice(list(submitted))
                if engine.abort(victim):
                    aborted.add(victim)
            for result in engine.step():
                if result.done:
                    assert result.request_id not in finals, "a request was reported twice"
                    finals[result.request_id] = result
            held = sum(len(r.blocks) for r in engine.scheduler.active)
            assert engine.allocator.num_free + held == engine.allocator.capacity
        assert engine.num_active == engine.num_waiting == 0
        assert engine.allocator.num_free == engine.allocator.capacity

    assert set(finals) == set(submitted)
    assert aborted, "the soak should exercise aborts"
    for request_id, result in finals.items():
        prompt, params = submitted[request_id]
        if result.status == RequestStatus.FAILED:
            assert result.finish_reason == FinishReason.ERROR and result.error
            continue
        assert result.status == RequestStatus.FINISHED
        assert len(result.tokens) <= params.max_tokens
        assert all(0 <= t < 64 for t in result.tokens)
        if params.return_logprobs:
            assert len(result.logprobs) == len(result.tokens)
            assert all(lp <= 0.0 for lp in result.logprobs)
        if result.finish_reason == FinishReason.ABORTED:
            assert request_id in aborted
        elif result.finish_reason == FinishReason.STOP_TOKEN:
            assert result.tokens[-1] in params.stop_token_ids
        elif result.finish_reason == FinishReason.STOP_WORD:
            assert tuple(result.tokens[-2:]) == params.stop_words[0]
        else:
            assert result.finish_reason == FinishReason.LENGTH
            assert len(result.tokens) == min(params.max_tokens, 32 - len(prompt))
    assert sum(r.status == RequestStatus.FAILED for r in finals.values()) >= 0.02 * NUM_REQUESTS
