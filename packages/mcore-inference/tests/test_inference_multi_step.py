"""Multi-step decode (``InferenceConfig.multi_step_decode``): several decode steps per host round
trip give exactly the tokens, log-probs and finish reasons of one step per round trip."""

from __future__ import annotations

import random

import pytest
import torch

from mcore_inference import FinishReason, InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.batch import build_microbatch
from mcore_inference.multi_step import plan_run, run_length
from mcore_inference.request import Request
from mcore_inference.sample_step import SamplingPlan, _row_logprobs
from mcore_inference.sampling import sample_tokens, sampling_uniform, sampling_uniforms
from mcore_models import GPTConfig, GPTModel


@pytest.fixture(scope="module")
def model() -> GPTModel:
    return GPTModel(GPTConfig.from_name("tiny", vocab_size=64, seed=23)).eval()


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 64, (int(length),), generator=generator).tolist()
        for length in torch.randint(1, 12, (count,), generator=generator)
    ]


def _mixed_params(count: int, **extra) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8 + 0.1 * (i % 3),
            top_k=0 if i % 3 else 9,
            top_p=0.9 if i % 4 == 1 else 1.0,
            seed=100 + i,
            max_tokens=3 + 3 * i,
            return_logprobs=i != 2,
            **extra,
        )
        for i in range(count)
    ]


def _config(steps: int, max_batch_size: int = 8) -> InferenceConfig:
    return InferenceConfig(
        max_batch_size=max_batch_size,
        max_sequence_length=64,
        block_size=4,
        prefill_chunk_size=5,
        multi_step_decode=steps,
    )


def _run(model, prompts, params, *, steps: int, max_batch_size: int = 8):
    with InferenceEngine(model, _config(steps, max_batch_size)) as engine:
        results = engine.generate(prompts, params)
        assert engine.allocator.num_free == engine.allocator.capacity
        assert not engine.has_unfinished()
        assert engine.scheduler is not None and not engine.scheduler.active
    return [(r.tokens, r.logprobs, r.finish_reason) for r in results]


@pytest.mark.parametrize("steps", [2, 5, 8])
def test_multi_step_generates_exactly_what_single_steps_do(model, steps):
    # Greedy and seeded sampling with top-k/top-p, log-probs for some, lengths 3 to 21.
    prompts = _prompts(7, seed=1)
    params = _mixed_params(len(prompts))
    expected = _run(model, prompts, params, steps=1)
    assert _run(model, prompts, params, steps=steps) == expected


def test_multi_step_with_admission_midway_matches_single_steps(model):
    # More requests than slots: requests finishing by length free slots for the waiting ones
    # at the same step as with single steps (a run never passes a length limit).
    prompts = _prompts(9, seed=4)
    params = _mixed_params(len(prompts))
    expected = _run(model, prompts, params, steps=1, max_batch_size=3)
    assert _run(model, prompts, params, steps=8, max_batch_size=3) == expected


def test_stop_tokens_and_stop_words_inside_a_run_end_requests_where_single_steps_do(model):
    prompts = _prompts(5, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    free = _run(model, prompts, [greedy] * len(prompts), steps=1)
    # Tokens that requests produce mid-way: a stop token, and a two-token stop word.
    stop_token = free[0][0][6]
    stop_word = free[1][0][9:11]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=7 + i,
            max_tokens=20,
            stop_token_ids=[stop_token],
            stop_words=[stop_word],
            return_logprobs=True,
        )
        for i in range(len(prompts))
    ]
    expected = _run(model, prompts, params, steps=1)
    reasons = {reason for _, _, reason in expected}
    assert FinishReason.STOP_TOKEN in reasons or FinishReason.STOP_WORD in reasons
    for batch_size in (8, 2):
        actual = _run(model, prompts, params, steps=8, max_batch_size=batch_size)
        # A stop frees the blocks up to a run later, so the batch shapes of later steps may
        # differ: tokens and reasons equal, log-probs up to the GEMM's batch-shape rounding.
        for (tokens, logprobs, reason), (e_tokens, e_logprobs, e_reason) in zip(
            actual, expected, strict=True
        ):
            assert tokens == e_tokens and reason == e_reason
            torch.testing.assert_close(logprobs, e_logprobs, atol=1e-5, rtol=0)


def test_step_updates_bring_a_run_s_tokens_at_once(model):
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=13, return_logprobs=True)
    with InferenceEngine(model, _config(8)) as engine:
        ids = engine.add_requests(prompts, [params] * len(prompts))
        streamed: dict[int, list[int]] = {i: [] for i in ids}
        counts: list[int] = []
        finals = {}
        while engine.has_unfinished():
            for update in engine.step_updates():
                streamed[update.request_id] += update.new_tokens
                counts.append(len(update.new_tokens))
                if update.result is not None:
                    finals[update.request_id] = update.result
    assert max(counts) > 1  # several tokens per host round trip
    expected = _run(model, prompts, [params] * len(prompts), steps=1)
    for request_id, (tokens, logprobs, reason) in zip(ids, expected, strict=True):
        assert streamed[request_id] == tokens == finals[request_id].tokens
        assert finals[request_id].logprobs == logprobs
        assert finals[request_id].finish_reason == reason


def test_abort_between_runs_frees_the_request_and_the_others_go_on(model):
    prompts = _prompts(3, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    with InferenceEngine(model, _config(8)) as engine:
        ids = engine.add_requests(prompts, [params] * len(prompts))
        engine.step()
        engine.step()  # a run
        assert engine.abort(ids[1])
        finals = {}
        while engine.has_unfinished():
            for result in engine.step():
                if result.done:
                    finals[result.request_id] = result
        assert engine.allocator.num_free == engine.allocator.capacity
    assert finals[ids[1]].finish_reason == FinishReason.ABORTED
    expected = _run(model, prompts, [params] * len(prompts), steps=1)
    for index in (0, 2):
        assert finals[ids[index]].tokens == expected[index][0]


def _request(request_id: int, prompt_len: int, computed: int, max_new: int, **params) -> Request:
    request = Request(
        request_id=request_id,
        prompt=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_new, **params),
        seed=request_id,
        max_new_tokens=max_new,
    )
    request.num_computed = computed
    request.output = [7] * (computed - prompt_len + 1)
    return request


def test_run_length_stops_at_the_first_length_limit_and_only_for_pure_decode():
    # Request 0 has 3 tokens left (it samples index 2 of 5 first), request 1 has 9.
    first = _request(0, prompt_len=4, computed=5, max_new=5, temperature=0.0)
    second = _request(1, prompt_len=3, computed=3, max_new=10, temperature=0.0)
    microbatch = build_microbatch([(first, 1), (second, 1)])
    assert first.num_computed == 6 and second.num_computed == 4
    assert run_length(microbatch, 8) == 3
    assert run_length(microbatch, 2) == 2
    assert run_length(microbatch, 1) == 1
    plan_run(microbatch, 3, torch.device("cpu"))
    assert microbatch.steps == 3
    assert first.num_computed == 8 and second.num_computed == 6
    # A prefill chunk in the step: no run.
    prefill = _request(2, prompt_len=6, computed=0, max_new=10, temperature=0.0)
    prefill.output = []
    mixed = build_microbatch([(_request(3, 4, 5, 9, temperature=0.0), 1), (prefill, 6)])
    assert run_length(mixed, 8) == 1


def test_sampling_plan_equals_the_single_step_sampler():
    # Each step of a plan: the tokens of sample_tokens with that step's uniforms and the
    # log-probs of _row_logprobs, bit for bit (the old path's functions).
    generator = torch.Generator().manual_seed(0)
    requests = [
        _request(
            i,
            prompt_len=3,
            computed=3 + i,
            max_new=40,
            temperature=[0.0, 0.7, 1.3, 0.7][i % 4],
            top_k=[0, 5, 0][i % 3],
            top_p=[1.0, 0.8][i % 2],
            return_logprobs=i % 3 != 1,
        )
        for i in range(9)
    ]
    steps = 4
    plan = SamplingPlan(requests, torch.device("cpu"), steps)
    for step in range(steps):
        logits = torch.randn((len(requests), 50), generator=generator).to(torch.bfloat16).float()
        out = torch.full((2, len(requests)), float("nan"), dtype=torch.float64)
        tokens = plan.sample(logits, out, step, logits_dtype=torch.bfloat16)
        uniforms = [
            sampling_uniform(r.seed, r.num_computed - len(r.prompt) + step) for r in requests
        ]
        expected = sample_tokens(logits, [r.params for r in requests], uniforms)
        assert torch.equal(tokens, expected)
        assert out[0].long().tolist() == expected.tolist()
        rows = [i for i, r in enumerate(requests) if r.params.return_logprobs]
        values = _row_logprobs(
            logits[rows],
            expected[rows],
            [requests[i].params.temperature or 1.0 for i in rows],
            torch.bfloat16,
        )
        assert out[1, rows].tolist() == values.double().tolist()
        assert all(v != v for i, v in enumerate(out[1].tolist()) if i not in rows)


def test_vectorized_uniforms_equal_the_scalar_hash():
    rng = random.Random(0)
    seeds = [rng.getrandbits(63) for _ in range(200)] + [0, 1, 2**63, 2**64 - 1, 2**70 + 5]
    first = [rng.randrange(0, 5000) for _ in seeds]
    uniforms = sampling_uniforms(seeds, first, 5)
    for step in range(5):
        for column, (seed, index) in enumerate(zip(seeds, first, strict=True)):
            assert uniforms[step, column].item() == sampling_uniform(seed, index + step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_multi_step_with_graphs_on_gpu_matches_single_steps():
    gpu_model = GPTModel(GPTConfig.from_name("tiny", vocab_size=64, seed=23)).eval().cuda()
    prompts = _prompts(7, seed=3)
    params = _mixed_params(len(prompts))
    expected = _run(gpu_model, prompts, params, steps=1)
    assert _run(gpu_model, prompts, params, steps=8) == expected
    # Stop tokens inside runs, graphs on.
    stop = expected[1][0][3]
    stopping = [
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]) for _ in prompts
    ]
    single = _run(gpu_model, prompts, stopping, steps=1)
    multi = _run(gpu_model, prompts, stopping, steps=8)
    assert [(t, r) for t, _, r in multi] == [(t, r) for t, _, r in single]


def test_a_request_takes_one_host_round_trip_per_run(model):
    # Prefill (first token), then runs of 8, 8 and 4 tokens, each read one round trip late
    # (the last one at once, since it ends the request by length): 5 steps for 21 tokens
    # instead of 22.
    params = SamplingParams(temperature=0.0, max_tokens=21)
    with InferenceEngine(model, _config(8)) as engine:
        engine.add_request([3, 4, 5], params)
        sizes = []
        while engine.has_unfinished():
            sizes.append(sum(len(u.new_tokens) for u in engine.step_updates()))
    assert sizes == [0, 1, 8, 8, 4]


def _every_row_draws(truncate: bool, device: torch.device) -> None:
    # Every row samples (no gather) over a large vocabulary; with top-k/top-p most of each
    # row's cumulative sum is flat (zero probabilities), and some targets sit on its steps.
    generator = torch.Generator().manual_seed(1)
    vocab = 20000
    requests = [
        _request(
            i,
            prompt_len=2,
            computed=2 + i,
            max_new=50,
            temperature=[0.6, 1.0, 1.7][i % 3],
            top_k=(7 if i % 2 else 0) if truncate else 0,
            top_p=(0.5 if i % 3 == 1 else 1.0) if truncate else 1.0,
        )
        for i in range(12)
    ]
    plan = SamplingPlan(requests, device, 3)
    for step in range(3):
        logits = 4 * torch.randn((len(requests), vocab), generator=generator)
        logits[:, ::7] = logits[:, :1]  # ties
        # bf16 logits as the fused decoder returns them (the sampler upcasts), or float32.
        logits = logits.to(device, torch.float32 if truncate else torch.bfloat16)
        out = torch.full((2, len(requests)), float("nan"), dtype=torch.float64, device=device)
        tokens = plan.sample(logits, out, step)
        uniforms = [
            sampling_uniform(r.seed, r.num_computed - len(r.prompt) + step) for r in requests
        ]
        assert torch.equal(tokens, sample_tokens(logits, [r.params for r in requests], uniforms))


@pytest.mark.parametrize("truncate", [False, True])
def test_plan_where_every_row_draws_equals_the_single_step_sampler(truncate):
    _every_row_draws(truncate, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("truncate", [False, True])
def test_plan_where_every_row_draws_equals_the_single_step_sampler_on_gpu(truncate):
    _every_row_draws(truncate, torch.device("cuda"))


def test_binary_search_counts_the_entries_below_the_target_like_a_full_comparison():
    generator = torch.Generator().manual_seed(2)
    scaled = 3 * torch.randn((64, 3000), generator=generator)
    scaled[:, 100:2000] = float("-inf")  # a long flat stretch
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    columns = torch.randint(0, 3000, (64,), generator=generator)
    for targets in (
        cdf.gather(1, columns[:, None]).squeeze(1).contiguous(),  # on an entry (or a plateau)
        torch.rand(64, generator=generator) * cdf[:, -1],
        cdf[:, -1].contiguous(),
        cdf[:, 0].contiguous(),
    ):
        expected = (cdf < targets[:, None]).sum(dim=-1)
        assert torch.equal(torch.searchsorted(cdf, targets[:, None]).squeeze(1), expected)


@pytest.mark.parametrize("greedy_feed", [False, True])
@pytest.mark.parametrize("mixed", [False, True], ids=["greedy", "greedy_and_drawing"])
def test_sample_feeds_the_next_step_inputs(monkeypatch, greedy_feed, mixed):
    # feed=: the sampled tokens land in the next step's token row and the positions advance by
    # one, whether the argmax's launch does it (GREEDY_FEED, greedy rows without log-probs) or
    # the copies after it; the tokens and samples are those of a plan without feed.
    from mcore_inference import sample_step

    monkeypatch.setattr(sample_step, "GREEDY_FEED", greedy_feed)
    temperatures = [0.0, 0.8, 0.0] if mixed else [0.0, 0.0, 0.0]
    requests = [
        _request(i, prompt_len=3, computed=3, max_new=8, temperature=t, return_logprobs=False)
        for i, t in enumerate(temperatures)
    ]
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn((3, 40), generator=generator)
    plain = SamplingPlan(requests, torch.device("cpu"), 2)
    fed = SamplingPlan(requests, torch.device("cpu"), 2)
    out = torch.full((2, 3), float("nan"), dtype=torch.float64)
    expected_out = out.clone()
    next_tokens = torch.zeros(3, dtype=torch.int64)
    positions = torch.tensor([5, 9, 2])
    expected = plain.sample(logits, expected_out, 1)
    tokens = fed.sample(logits, out, 1, feed=(next_tokens, positions))
    assert torch.equal(tokens, expected)
    assert torch.equal(out[0], expected_out[0])
    assert torch.equal(next_tokens, expected)
    assert positions.tolist() == [6, 10, 3]
