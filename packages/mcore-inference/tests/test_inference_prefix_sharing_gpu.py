"""GPU: shared prompt prefixes with CUDA graphs, bf16, in the batch-invariant mode bit for bit."""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models.gpt.config import GPTConfig
from mcore_models.gpt.model import GPTModel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _groups(lengths, samples, seed=0):
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        prompt = torch.randint(0, 256, (n,), generator=generator).tolist()
        prompts += [prompt] * samples
    return prompts


def _generate(model, prompts, share):
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=24, return_logprobs=True)
        for i in range(len(prompts))
    ]
    config = InferenceConfig(
        max_batch_size=32,
        max_sequence_length=256,
        block_size=16,
        use_cuda_graphs=True,
        share_prompt_prefixes=share,
    )
    with InferenceEngine(model, config) as engine:
        results = engine.generate(prompts, params)
        assert engine.allocator.num_free == engine.allocator.capacity
    return results


def test_gpu_batch_invariant_shared_prefixes_equal_unshared_bitwise():
    config = GPTConfig.from_name(
        "tiny", vocab_size=256, seed=7, batch_invariant=True, dtype=torch.bfloat16
    )
    model = GPTModel(config, device="cuda").eval()
    prompts = _groups([40, 100, 17, 9], 6, seed=1)
    shared = _generate(model, prompts, True)
    unshared = _generate(model, prompts, False)
    for a, b in zip(shared, unshared, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == b.logprobs
