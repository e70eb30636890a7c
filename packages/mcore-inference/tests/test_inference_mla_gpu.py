"""GPU check of MLA decode: the engine's latent cache (Triton absorbed kernel, CUDA graphs)
generates what transformers' DeepseekV3 ``generate`` does, in fp32 on the same weights."""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models import GPTConfig, GPTModel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 7], list(range(1, 40)), [250]]


def test_latent_cache_greedy_equals_transformers_generate_on_cuda(tmp_path):
    model = GPTModel(GPTConfig.from_name("tiny-mla-moe", init_std=0.1, seed=3), device="cuda")
    model.to_hf(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).cuda().eval()
    config = InferenceConfig(max_batch_size=4, max_sequence_length=128, block_size=16)
    with InferenceEngine(model.eval(), config) as engine:
        results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, result in zip(PROMPTS, results):
        expected = hf_model.generate(
            torch.tensor([prompt], device="cuda"),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        assert result.tokens == expected
