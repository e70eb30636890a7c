"""Multi-head Latent Attention: config checks, presets, YaRN, the absorbed decode through a
latent KV cache against the non-absorbed forward, and tensor parallelism (tp=2 on gloo equals
tp=1)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_models import (
    ContiguousKVCache,
    ContiguousLatentKVCache,
    GPTConfig,
    GPTModel,
    KVCacheError,
    MLAConfig,
    ModelConfigError,
    YarnScaling,
    parallelize,
)
from mcore_models.gather import gather_full_tensors
from mcore_models.gpt.mla import MLAttention
from mcore_models.gpt.yarn import yarn_inverse_frequencies
from mcore_parallel import initialize
from mcore_parallel.sharding import get_partition_dims
from mcore_parallel.testing import run_distributed

IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def models() -> dict[str, GPTModel]:
    return {
        name: GPTModel(GPTConfig.from_name(name, seed=5)).eval()
        for name in ("tiny-mla", "tiny-mla-moe")
    }


def test_mla_config_rejects_fields_of_grouped_query_attention():
    with pytest.raises(ModelConfigError, match="qk_layernorm"):
        GPTConfig(attention_type="mla", qk_layernorm=True)
    with pytest.raises(ModelConfigError, match="attention_type='mla' or mla=None"):
        GPTConfig(mla=MLAConfig())
    with pytest.raises(ModelConfigError, match="attention_type='flash'"):
        GPTConfig(attention_type="flash")
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim=7"):
        MLAConfig(qk_rope_head_dim=7)
    with pytest.raises(ModelConfigError, match="q_lora_rank=0"):
        MLAConfig(q_lora_rank=0)
    with pytest.raises(ModelConfigError, match="beta_slow=4"):
        YarnScaling(beta_fast=2.0, beta_slow=4.0)
    assert GPTConfig(attention_type="mla").mla == MLAConfig()


def test_published_presets_have_the_published_parameter_counts():
    # DeepSeek-V3 report (arXiv:2412.19437): 671B parameters in the main model (the
    # multi-token-prediction module is counted apart); Kimi K2 report: 1.04T in total.
    assert GPTConfig.from_name("deepseek-v3").num_parameters() == pytest.approx(671e9, rel=2e-3)
    assert GPTConfig.from_name("kimi-k2").num_parameters() == pytest.approx(1.04e12, rel=2e-2)
    # Activated parameters per token: 37B (DeepSeek-V3 report) and 32B (Kimi K2 report); the
    # PaLM accounting of flops_per_token counts matmul parameters, the embedding apart.
    for name, activated in (("deepseek-v3", 37e9), ("kimi-k2", 32e9)):
        config = GPTConfig.from_name(name)
        products = 12 * config.num_layers * config.num_attention_heads * 160 * 1024
        matmul = (config.flops_per_token(1024) - products) / 6
        embedding = config.vocab_size * config.hidden_size
        assert matmul + embedding == pytest.approx(activated, rel=3e-2), name
    mla = GPTConfig.from_name("deepseek-v3").mla
    # 576 cached channels per token and layer (kv_lora_rank 512 + rope key 64).
    assert mla.latent_dim == 576
    assert mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_yarn_keeps_fast_and_slows_down_slow_frequencies():
    yarn = YarnScaling(factor=8.0, original_max_position_embeddings=64)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 32, 2).float() / 32)
    scaled = yarn_inverse_frequencies(32, 10000.0, yarn)
    # Wavelengths far below the original context are kept, far above it are divided by 8.
    torch.testing.assert_close(scaled[0], plain[0])
    torch.testing.assert_close(scaled[-1], plain[-1] / 8)
    assert bool((scaled <= plain + 1e-12).all())


def test_parameter_count_matches_the_built_model(models):
    for model in models.values():
        counted = sum(p.numel() for p in model.parameters())
        assert model.config.num_parameters() == counted


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-mla-moe"])
def test_absorbed_decode_matches_the_non_absorbed_forward(models, name):
    model = models[name]
    with torch.no_grad():
        expected = model(IDS[:1])
        cache = ContiguousLatentKVCache(model.config, max_seq_len=10)
        steps = [model(IDS[:1, :4], torch.arange(4)[None], kv_cache=cache)]
        for t in range(4, 10):
            steps.append(model(IDS[:1, t : t + 1], torch.tensor([[t]]), kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=2e-5, rtol=1e-5)
    assert cache.length() == 10
    # Per token and layer the latent cache holds kv_lora_rank + qk_rope_head_dim channels.
    mla = model.config.mla
    assert cache.nbytes == model.config.num_layers * 10 * (mla.kv_lora_rank + 8) * 4
    assert torch.equal(torch.cat(steps, dim=1).argmax(-1), expected.argmax(-1)), (
        "greedy tokens differ"
    )


def test_a_plain_kv_cache_gets_up_projected_heads(models):
    model = models["tiny-mla"]
    with torch.no_grad():
        expected = model(IDS[:1, :6])
        cache = ContiguousKVCache(model.config, max_seq_len=6)
        first = model(IDS[:1, :3], torch.arange(3)[None], kv_cache=cache)
        rest = model(IDS[:1, 3:6], torch.arange(3, 6)[None], kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, atol=2e-5, rtol=1e-5)


def test_latent_cache_rejects_a_model_without_mla():
    with pytest.raises(KVCacheError, match="attention_type='gqa'"):
        ContiguousLatentKVCache(GPTConfig.from_name("tiny"), max_seq_len=4)


def test_eager_and_sdpa_backends_agree(models):
    model = models["tiny-mla"]
    eager = GPTModel(model.config.replace(attention_backend="eager")).eval()
    with torch.no_grad():
        torch.testing.assert_close(eager(IDS), model(IDS), atol=2e-5, rtol=1e-5)


def _tensor_parallel_checks() -> dict[str, float]:
    state = initialize(tp=2)
    rank = state.tp_rank
    errors: dict[str, float] = {}
    for name, q_lora in (("tiny-mla", False), ("tiny-mla-moe", True)):
        config = GPTConfig.from_name(name, seed=7)
        cfg = config.replace(mla={**_fields(config.mla), "q_lora_rank": 32 if q_lora else None})
        reference, sharded = GPTModel(cfg), parallelize(GPTModel(cfg), state)
        assert isinstance(sharded.layers[0].self_attention, MLAttention)
        assert sharded.layers[0].self_attention.num_heads == 2
        ref_logits, tp_logits = reference(IDS), sharded(IDS)
        key = f"{name}/q_lora={q_lora}"
        errors[f"logits/{key}"] = (ref_logits - tp_logits).abs().max().item()
        (ref_logits.square().mean()).backward()
        (tp_logits.square().mean()).backward()
        ref_grads = dict(reference.named_parameters())
        worst = 0.0
        for pname, param in sharded.named_parameters():
            expected = ref_grads[pname].grad
            for dim in get_partition_dims(param).values():
                # tp over heads, etp over expert FFN channels: both of size 2 here.
                expected = expected.chunk(2, dim=dim)[rank]
            worst = max(worst, (param.grad - expected).abs().max().item())
        errors[f"grads/{key}"] = worst
        with torch.no_grad():
            cache = ContiguousLatentKVCache(cfg, max_seq_len=10)
            steps = [sharded(IDS[:1, :6], torch.arange(6)[None], kv_cache=cache)]
            for t in range(6, 10):
                steps.append(sharded(IDS[:1, t : t + 1], torch.tensor([[t]]), kv_cache=cache))
            errors[f"absorbed/{key}"] = (
                (torch.cat(steps, dim=1) - ref_logits[:1].detach()).abs().max().item()
            )
        _, full = gather_full_tensors([sharded], state, every_rank=True)
        errors[f"state_dict/{key}"] = max(
            (full[k] - v).abs().max().item() for k, v in reference.state_dict().items()
        )
    try:
        parallelize(GPTModel(GPTConfig.from_name("tiny-mla")), state, sequence_parallel=True)
        errors["sequence_parallel_rejected"] = 1.0
    except ModelConfigError:
        errors["sequence_parallel_rejected"] = 0.0
    return errors


def _fields(mla: MLAConfig) -> dict:
    return {name: getattr(mla, name) for name in MLAConfig.__dataclass_fields__}


def test_tensor_parallel_mla_matches_single_rank():
    for errors in run_distributed(_tensor_parallel_checks, 2):
        for key, error in errors.items():
            assert error < 5e-5, f"{key}: {error}"
