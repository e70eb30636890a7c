"""A tensor-parallel (tp=2, gloo) hybrid Mamba model in the engine generates what one process does."""

import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models import parallelize
from mcore_models.mamba import HybridModel, hybrid_preset
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

CONFIG = hybrid_preset("tiny-hybrid", seed=13)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [35, 8], [97, 93, 23, 84, 62, 64]]


def _generate(model, state=None):
    config = InferenceConfig(
        max_batch_size=4, max_sequence_length=64, prefill_chunk_size=4, max_tokens_per_step=8
    )
    params = SamplingParams(temperature=0, max_tokens=6, return_logprobs=True)
    with InferenceEngine(model, config, state=state) as engine:
        results = engine.generate(PROMPTS, params)
        assert engine.mamba_states is not None and engine.mamba_states.allocator.num_free == 4
    return [(r.tokens, r.logprobs) for r in results]


def _tensor_parallel():
    torch.set_num_threads(1)
    state = initialize(tp=2)
    model = parallelize(HybridModel(CONFIG).eval(), state)
    assert model.mamba_layers[0].num_heads == CONFIG.mamba_num_heads // 2
    return _generate(model, state)


def test_tensor_parallel_engine_generates_like_one_process():
    expected = _generate(HybridModel(CONFIG).eval())
    for rank_results in run_distributed(_tensor_parallel, 2):
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(
            rank_results, expected, strict=True
        ):
            assert tokens == ref_tokens
            torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)
