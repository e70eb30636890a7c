"""MLA models in the engine: greedy generation over the paged latent cache (absorbed weights)
equals transformers' DeepseekV3ForCausalLM ``generate`` and the engine with an up-projected
(MHA-equivalent) cache; the latent cache holds kv_lora_rank + qk_rope_head_dim channels per
token and layer; a tp=2 engine running the Triton kernel (interpreter) equals the single-rank
torch reference."""

import pytest
import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.errors import KVCacheStepError
from mcore_inference.latent_kv_cache import PagedLatentKVCache
from mcore_models import GPTConfig, GPTModel, parallelize
from mcore_parallel import initialize
from mcore_parallel.testing import run_distributed

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [250]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny-mla-moe preset (DeepSeek-V3 layout, YaRN) with decisive random weights."""
    directory = tmp_path_factory.mktemp("deepseek_v3_tiny")
    model = GPTModel(GPTConfig.from_name("tiny-mla-moe", init_std=0.1, seed=3)).eval()
    model.to_hf(directory)
    return directory, model


def _config(latent: bool) -> InferenceConfig:
    return InferenceConfig(
        max_batch_size=4,
        max_sequence_length=32,
        block_size=4,
        max_tokens_per_step=8,
        prefill_chunk_size=4,
        attention_split_size=8,
        mla_latent_kv_cache=latent,
    )


def _generate(model: GPTModel, latent: bool) -> tuple[list[list[int]], InferenceEngine]:
    engine = InferenceEngine(model, _config(latent))
    with engine:
        results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
        return [r.tokens for r in results], engine


def test_latent_cache_greedy_equals_transformers_generate(checkpoint):
    directory, model = checkpoint
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    tokens, _ = _generate(model, latent=True)
    for prompt, generated in zip(PROMPTS, tokens):
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        assert generated == expected


def test_latent_and_up_projected_caches_generate_alike_and_bytes_per_token(checkpoint):
    _, model = checkpoint
    latent_tokens, latent_engine = _generate(model, latent=True)
    heads_tokens, heads_engine = _generate(model, latent=False)
    assert latent_tokens == heads_tokens
    config = model.config
    mla = config.mla
    latent_cache, heads_cache = latent_engine.kv_cache, heads_engine.kv_cache
    assert latent_cache is None and heads_cache is None  # released on close
    slots = (_config(True).max_batch_size * _config(True).max_blocks_per_sequence + 1) * 4
    # Measured on fresh engines: bytes of the cache storage per token slot.
    for latent, channels in (
        (True, mla.kv_lora_rank + mla.qk_rope_head_dim),
        (False, 2 * config.num_attention_heads * mla.qk_head_dim),
    ):
        engine = InferenceEngine(model, _config(latent))
        cache = engine.kv_cache
        assert isinstance(cache, PagedLatentKVCache) == latent
        assert cache.nbytes == slots * config.num_layers * channels * 4
        engine.close()


def test_latent_cache_refuses_per_head_keys():
    cache = PagedLatentKVCache(
        num_layers=1,
        num_blocks=2,
        block_size=4,
        latent_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        split_size=4,
    )
    with pytest.raises(KVCacheStepError, match="attend_latent"):
        cache.attend(0, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), scale=1.0)


def _greedy_with_logprobs(tp: int = 1, max_tokens: int = 6) -> list[tuple[list[int], list[float]]]:
    torch.set_num_threads(1)
    model = GPTModel(GPTConfig.from_name("tiny-mla", init_std=0.1, seed=3)).eval()
    state = None
    if tp > 1:
        state = initialize(tp=tp)
        model = parallelize(model, state).eval()
    with InferenceEngine(model, _config(True), state=state) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, return_logprobs=True)
        results = engine.generate(PROMPTS[:2], params)
    return [(r.tokens, list(r.logprobs)) for r in results]


def test_tp2_engine_with_the_triton_kernel_equals_the_single_rank_torch_reference(monkeypatch):
    # Three tokens (prefill plus two interpreted decode steps) keep the interpreter affordable.
    expected = _greedy_with_logprobs(1, 3)
    # Triton decides at import whether it interprets: the Triton run needs fresh processes.
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for actual in run_distributed(_greedy_with_logprobs, 2, 2, 3, timeout=400):
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(actual, expected):
            assert tokens == ref_tokens
            torch.testing.assert_close(
                torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0
            )
