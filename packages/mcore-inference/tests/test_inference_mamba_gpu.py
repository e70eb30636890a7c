"""GPU only: hybrid (Mamba) models under CUDA graphs for decode and non-decode steps.

Graph replay equals eager execution (tokens and log-probs) for pure prefill, mixed and decode
steps; ``close()`` returns the graphs' and state slots' memory; bf16 stays close to float32.
"""

import gc

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.testing import random_prompts
from mcore_models.mamba import HybridModel, hybrid_preset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(dtype=torch.float32):
    config = hybrid_preset(
        "tiny-hybrid",
        hidden_size=128,
        layer_pattern="M*M-M*",
        mamba_num_heads=8,
        mamba_head_dim=32,
        mamba_num_groups=2,
        ssm_state_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        chunk_size=32,
        dtype=dtype,
        seed=3,
    )
    return HybridModel(config, device="cuda").eval()


def _prompts(count, seed=0):
    return random_prompts(count, seed=seed, max_len=50)


def _config(**overrides):
    fields = dict(
        max_batch_size=8,
        max_sequence_length=160,
        block_size=16,
        max_tokens_per_step=64,
        prefill_chunk_size=24,
        attention_split_size=32,
    )
    fields.update(overrides)
    return InferenceConfig(**fields)


def _run(model, prompts, **config):
    params = SamplingParams(temperature=0, max_tokens=12, return_logprobs=True)
    with InferenceEngine(model, _config(**config)) as engine:
        results = engine.generate(prompts, params)
        graphs = engine._runner.hybrid_graphs if engine._runner is not None else None
        captured = graphs.captured if graphs is not None else ()
    return results, captured


def test_graph_replay_equals_eager_for_decode_and_non_decode_steps():
    model = _model()
    prompts = _prompts(6)
    eager, _ = _run(model, prompts, use_cuda_graphs=False)
    graphed, captured = _run(model, prompts, use_cuda_graphs=True)
    kinds = {kind for kind, _ in captured}
    assert kinds == {"decode", "mixed"}, captured
    for a, b in zip(eager, graphed, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_decode_only_graphs_when_non_decode_graphs_are_off():
    model = _model()
    prompts = _prompts(4, seed=1)
    eager, _ = _run(model, prompts, use_cuda_graphs=False)
    graphed, captured = _run(model, prompts, cuda_graph_prefill_token_counts=())
    assert {kind for kind, _ in captured} == {"decode"}
    assert [r.tokens for r in eager] == [r.tokens for r in graphed]


def test_close_returns_graph_and_state_memory():
    model = _model()
    prompts = _prompts(5, seed=2)
    params = SamplingParams(temperature=0, max_tokens=6)
    # A first engine compiles kernels and creates library workspaces that live for the process.
    with InferenceEngine(model, _config()) as engine:
        engine.generate(prompts, params)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = InferenceEngine(model, _config())
    engine.generate(prompts, params)
    assert torch.cuda.memory_allocated() > before
    engine.close()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_bf16_engine_logprobs_stay_close_to_float32():
    model32 = _model(torch.float32)
    model16 = _model(torch.bfloat16)
    with torch.no_grad():
        for p16, p32 in zip(model16.parameters(), model32.parameters(), strict=True):
            p16.copy_(p32)
    prompts = _prompts(4, seed=3)
    ids = torch.tensor([prompts[0]], device="cuda")
    with torch.no_grad():
        logits32 = model32(ids)
        logits16 = model16(ids)
    scale = logits32.abs().max()
    assert (logits16 - logits32).abs().max() / scale < 0.05
    params = SamplingParams(temperature=0, max_tokens=1, return_logprobs=True)
    with InferenceEngine(model16, _config()) as engine:
        first16 = engine.generate(prompts, params)
    with InferenceEngine(model32, _config()) as engine:
        first32 = engine.generate(prompts, params)
    for a, b in zip(first16, first32, strict=True):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.1
