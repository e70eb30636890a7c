"""GPU only: CUDA-graph decode equals eager decode; teardown returns every byte and object."""

import dataclasses
import gc
import warnings
import weakref

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
        seed=3,
    )
    return GPTModel(config, device="cuda").eval()


def _prompts(count, seed=0):
    return random_prompts(count, seed=seed)


def _config(**overrides):
    fields = dict(
        max_batch_size=8,
        max_sequence_length=128,
        block_size=16,
        max_tokens_per_step=64,
        prefill_chunk_size=32,
        attention_split_size=32,
    )
    fields.update(overrides)
    return InferenceConfig(**fields)


def _mixed_params(count):
    return [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            top_p=0.9,
            seed=i,
            max_tokens=10 + 3 * i,
            return_logprobs=True,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("buckets", [(1, 2, 3, 4, 5, 6), (8,)], ids=["exact", "padded"])
def test_cuda_graph_decode_equals_eager(model, buckets):
    prompts, params = _prompts(6), _mixed_params(6)
    with InferenceEngine(model, _config(use_cuda_graphs=False)) as eager:
        expected = eager.generate(prompts, params)
    with InferenceEngine(model, _config(cuda_graph_batch_sizes=buckets)) as graphed:
        actual = graphed.generate(prompts, params)
        assert graphed._graphs is not None and graphed._graphs.captured
    for a, e in zip(actual, expected):
        assert a.status == RequestStatus.FINISHED and len(a.tokens) > 0
        assert a.tokens == e.tokens
        torch.testing.assert_close(a.logprobs, e.logprobs, atol=1e-4, rtol=0)


def _run_engine_and_close(model, prompts, params):
    engine = InferenceEngine(model, _config())
    results = engine.generate(prompts, params)
    refs = [
        weakref.ref(engine.kv_cache),
        weakref.ref(engine.kv_cache.keys),
        weakref.ref(engine.kv_cache.values),
        weakref.ref(engine._graphs),
    ]
    assert engine._graphs.captured
    engine.close()
    return results, refs


def test_close_frees_cache_graphs_and_pool_back_to_the_pre_engine_level(model):
    prompts, params = _prompts(8, seed=1), _mixed_params(8)
    # A first engine compiles kernels and creates library workspaces that live for the process.
    _run_engine_and_close(model, prompts, params)
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    results, refs = _run_engine_and_close(model, prompts, params)
    gc.collect()
    torch.cuda.synchronize()
    assert all(ref() is None for ref in refs)
    assert torch.cuda.memory_allocated() == baseline
    assert all(r.status == RequestStatus.FINISHED for r in results)


def test_five_back_to_back_generate_calls_keep_allocated_memory_flat(model):
    prompts, params = _prompts(8, seed=2), _mixed_params(8)
    with InferenceEngine(model, _config()) as engine:
        levels = []
        first = None
        for _ in range(5):
            results = engine.generate(prompts, params)
            first = first or [r.tokens for r in results]
            assert [r.tokens for r in results] == first
            torch.cuda.synchronize()
            levels.append(torch.cuda.memory_allocated())
    assert levels == [levels[0]] * 5


def test_model_modules_and_parameters_untouched_by_graph_capture(model):
    modules = [(name, type(m)) for name, m in model.named_modules()]
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    with InferenceEngine(model, _config()) as engine:
        engine.generate(_prompts(4, seed=3), _mixed_params(4))
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    assert all(torch.equal(p, params[name]) for name, p in model.named_parameters())


def test_graphs_follow_weights_updated_in_place_and_reallocated(model):
    prompts, params = _prompts(4, seed=4), _mixed_params(4)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        with InferenceEngine(model, _config()) as engine:
            engine.generate(prompts, params)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5)  # in place: the captured graphs read the new values
            in_place = engine.generate(prompts, params)
            # Re-allocate every weight (an offload round trip): graphs must be recaptured.
            model.to("cpu")
            model.to("cuda")
            moved = engine.generate(prompts, params)
        with InferenceEngine(model, _config(use_cuda_graphs=False)) as eager:
            expected = eager.generate(prompts, params)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(original[name])
    assert [r.tokens for r in in_place] == [r.tokens for r in expected]
    assert [r.tokens for r in moved] == [r.tokens for r in expected]


def test_moe_cuda_graph_decode_equals_eager_and_restores_routing_mode():
    from mcore_models.moe import moe_layers

    config = GPTConfig.from_name(
        "tiny", vocab_size=512, num_layers=2, moe={"num_experts": 4, "top_k": 2}, seed=8
    )
    moe_model = GPTModel(config, device="cuda").eval()
    modes = [layer.decode_padding for layer in moe_layers(moe_model)]
    prompts, params = _prompts(5, seed=5), _mixed_params(5)
    with InferenceEngine(moe_model, _config(use_cuda_graphs=False)) as eager:
        expected = eager.generate(prompts, params)
    assert [(r.status, r.error) for r in expected] == [(RequestStatus.FINISHED, None)] * 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with InferenceEngine(moe_model, _config()) as graphed:
            actual = graphed.generate(prompts, params)
            captured = graphed._graphs.captured if graphed._graphs is not None else ()
    assert not [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert [(r.status, r.error) for r in actual] == [(RequestStatus.FINISHED, None)] * 5
    assert captured
    assert [layer.decode_padding for layer in moe_layers(moe_model)] == modes
    assert [r.tokens for r in actual] == [r.tokens for r in expected]


def test_graphs_stay_valid_after_update_weights(model):
    """Captured graphs read the new weights: same storages, no recapture, eager-equal results."""
    config = model.config
    other = GPTModel(dataclasses.replace(config, seed=77), device="cuda").eval()
    weights = {name: p.detach().clone() for name, p in other.named_parameters()}
    prompts = _prompts(6, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, return_logprobs=True)
    target = GPTModel(config, device="cuda").eval()
    with InferenceEngine(target, _config()) as engine:
        engine.generate(prompts, greedy)
        captured = engine._graphs.captured
        graph_runner = engine._graphs
        assert captured
        engine.update_weights(weights)
        updated = engine.generate(prompts, greedy)
        # The same graph objects replayed the new weights (nothing was dropped or recaptured).
        assert engine._graphs is graph_runner and engine._graphs.captured == captured
    with InferenceEngine(other, _config(use_cuda_graphs=False)) as engine:
        expected = engine.generate(prompts, greedy)
    for got, reference in zip(updated, expected, strict=True):
        assert got.tokens == reference.tokens
        assert torch.allclose(
            torch.tensor(got.logprobs), torch.tensor(reference.logprobs), atol=1e-3
        )
