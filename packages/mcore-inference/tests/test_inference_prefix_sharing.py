"""Shared prompt prefixes (``InferenceConfig.share_prompt_prefixes``): the KV blocks of identical
prompt prefixes are computed once and shared, and every request's tokens and log-probs equal
those of the engine without sharing."""

import pytest
import torch

import mcore_inference.engine_step as engine_step
from mcore_inference import (
    BlockAllocator,
    BlockAllocatorError,
    FinishReason,
    InferenceConfig,
    InferenceConfigError,
    InferenceEngine,
    SamplingParams,
)
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel


@pytest.fixture(scope="module")
def model():
    return GPTModel(GPTConfig.from_name("tiny", seed=99)).eval()


def _config(share: bool, **overrides):
    fields = dict(
        max_batch_size=16,
        max_sequence_length=64,
        block_size=4,
        max_tokens_per_step=40,
        prefill_chunk_size=16,
        share_prompt_prefixes=share,
    )
    fields.update(overrides)
    return InferenceConfig(**fields)


def _groups(lengths, samples, seed=0):
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        prompt = torch.randint(0, 256, (n,), generator=generator).tolist()
        prompts += [prompt] * samples
    return prompts


def _params(count):
    kinds = [
        SamplingParams(temperature=1.0, max_tokens=7, return_logprobs=True),
        SamplingParams(temperature=0.0, max_tokens=5, return_logprobs=True),
        SamplingParams(temperature=0.8, top_k=30, max_tokens=9, return_logprobs=True),
    ]
    return [kinds[i % len(kinds)] for i in range(count)]


def _fed_tokens(monkeypatch):
    counted = []
    original = engine_step.build_microbatch

    def build(batch):
        microbatch = original(batch)
        counted.append(microbatch)  # its steps are known after the build (multi-step decode)
        return microbatch

    monkeypatch.setattr(engine_step, "build_microbatch", build)
    return counted


def test_shared_prefixes_give_the_tokens_and_logprobs_of_the_unshared_engine(model, monkeypatch):
    # Prompts of 3 (no full block before its last token), 9, 17 and 30 tokens, 3 samples each.
    prompts = _groups([3, 9, 17, 30], 3)
    params = _params(len(prompts))
    with InferenceEngine(model, _config(False)) as engine:
        expected = engine.generate(prompts, params)
    fed = _fed_tokens(monkeypatch)
    with InferenceEngine(model, _config(True)) as engine:
        results = engine.generate(prompts, params)
        assert engine.allocator.num_free == engine.allocator.capacity
    for got, want in zip(results, expected):
        assert got.finish_reason == FinishReason.LENGTH
        assert got.tokens == want.tokens
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    # Each group's full blocks before its last prompt token are fed once, not three times:
    # 2, 4 and 7 blocks of 4 tokens saved twice each.
    generated = sum(p.max_tokens - 1 for p in params)
    fed_tokens = sum(microbatch.num_tokens * microbatch.steps for microbatch in fed)
    assert fed_tokens == sum(len(p) for p in prompts) - 2 * 4 * (2 + 4 + 7) + generated


def test_followers_share_the_blocks_and_wait_for_them(model):
    prompts = _groups([17], 3, seed=1)
    with InferenceEngine(model, _config(True, max_batch_size=8, max_tokens_per_step=8)) as engine:
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4))
        engine.step()
        leader, *followers = engine.scheduler.active
        # 4 full blocks before the block of the last prompt token, held by all three.
        assert all(f.blocks[:4] == leader.blocks[:4] for f in followers)
        assert [engine.allocator.holders(b) for b in leader.blocks[:4]] == [3] * 4
        assert all(f.blocks[4:] != leader.blocks[4:] for f in followers)
        # The budget of 8 went to the leader; the followers wait for its 16 shared tokens.
        assert leader.num_computed == 8
        assert [f.num_computed for f in followers] == [0, 0]
        while engine.has_unfinished():
            engine.step()
        assert engine.allocator.num_free == engine.allocator.capacity


def test_aborting_the_leader_before_its_prefix_is_computed_hands_it_to_a_follower(model):
    prompts = _groups([30], 3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with InferenceEngine(model, _config(False)) as engine:
        (expected,) = engine.generate(prompts[:1], params)
    with InferenceEngine(model, _config(True, max_batch_size=8, max_tokens_per_step=8)) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()
        assert engine.abort(ids[0])
        finals = {}
        while engine.has_unfinished():
            for result in engine.step():
                if result.done:
                    finals[result.request_id] = result
        assert engine.allocator.num_free == engine.allocator.capacity
    assert [finals[i].tokens for i in ids[1:]] == [expected.tokens] * 2


def test_later_requests_reuse_the_computed_blocks_of_a_running_one(model):
    prompt = _groups([21], 1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with InferenceEngine(model, _config(False)) as engine:
        (expected,) = engine.generate([prompt], params)
    with InferenceEngine(model, _config(True)) as engine:
        first = engine.add_request(prompt, params)
        engine.step()
        engine.step()
        second = engine.add_request(prompt, params)
        engine.step()
        late = next(r for r in engine.scheduler.active if r.request_id == second)
        assert late.shared_tokens == 20 and late.prefix_source is None
        finals = {}
        while engine.has_unfinished():
            for result in engine.step():
                if result.done:
                    finals[result.request_id] = result
    assert finals[first].tokens == finals[second].tokens == expected.tokens


def test_block_allocator_frees_a_shared_block_after_its_last_holder():
    allocator = BlockAllocator(5)
    blocks = allocator.allocate(2)
    allocator.share(blocks[:1])
    assert allocator.holders(blocks[0]) == 2 and allocator.holders(blocks[1]) == 1
    allocator.free(blocks)
    assert allocator.num_free == 3 and allocator.holders(blocks[0]) == 1
    allocator.free(blocks[:1])
    assert allocator.num_free == 4 and allocator.holders(blocks[0]) == 0
    with pytest.raises(BlockAllocatorError, match="not allocated"):
        allocator.share(blocks[:1])


def test_share_prompt_prefixes_must_be_a_bool():
    with pytest.raises(InferenceConfigError, match="share_prompt_prefixes"):
        InferenceConfig(share_prompt_prefixes="yes")  # type: ignore[arg-type]
