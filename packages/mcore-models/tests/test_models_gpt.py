"""GPTModel behaviour: backends agree, causal masking, packed sequences, KV cache, checkpointing."""

from __future__ import annotations

import pytest
import torch

from mcore_models import (
    AttentionBackendError,
    ContiguousKVCache,
    GPTConfig,
    GPTModel,
    KVCache,
    KVCacheError,
    ModelConfigError,
    ModelInputError,
    PackedSeqError,
    PackedSeqParams,
    preset_names,
)

BACKENDS = ["sdpa", "flex", "eager"]


@pytest.fixture(scope="module")
def model() -> GPTModel:
    return GPTModel(GPTConfig.from_name("tiny", add_qkv_bias=True)).eval()


@pytest.fixture(autouse=True)
def _restore_backend(request):
    """Tests switch the shared model's backend; restore it so no test depends on the order."""
    if "model" not in request.fixturenames:
        yield
        return
    shared = request.getfixturevalue("model")
    backend = shared.config.attention_backend
    yield
    shared.config.attention_backend = backend


def _ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def _with_backend(model: GPTModel, backend: str) -> GPTModel:
    model.config.attention_backend = backend
    return model


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_backends_match_eager_reference(model, backend):
    ids = _ids(2, 13)
    with torch.no_grad():
        expected = _with_backend(model, "eager")(ids)
        actual = _with_backend(model, backend)(ids)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_masking_ignores_future_tokens(model, backend):
    ids = _ids(1, 12)
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 7) % 256
    with torch.no_grad():
        a = _with_backend(model, backend)(ids)
        b = model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_equal_unpacked_per_sequence(model, backend):
    lengths = [5, 1, 9, 4]
    sequences = [_ids(1, n, seed=i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=max(lengths))
    with torch.no_grad():
        logits = _with_backend(model, backend)(
            torch.cat(sequences, dim=1), packed_seq_params=packed
        )
        for i, seq in enumerate(sequences):
            expected = model(seq)
            torch.testing.assert_close(logits[:, cu[i] : cu[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_packed_positions_restart_at_zero_per_sequence():
    packed = PackedSeqParams(torch.tensor([0, 3, 3, 5], dtype=torch.int32), 3)
    assert packed.position_ids().tolist() == [[0, 1, 2, 0, 1]]
    assert packed.segment_ids().tolist() == [0, 0, 0, 2, 2]


def test_packed_seq_params_reject_malformed_boundaries(model):
    with pytest.raises(PackedSeqError, match="cu_seqlens"):
        PackedSeqParams(torch.tensor([1, 3], dtype=torch.int32), 2)
    with pytest.raises(PackedSeqError, match="max_seqlen=2"):
        PackedSeqParams(torch.tensor([0, 3], dtype=torch.int32), 2)
    packed = PackedSeqParams(torch.tensor([0, 3, 6], dtype=torch.int32), 3)
    with pytest.raises(PackedSeqError, match="cu_seqlens\\[-1\\]=6"):
        model(_ids(1, 7), packed_seq_params=packed)
    with pytest.raises(PackedSeqError, match="B == 1"):
        model(_ids(2, 6), packed_seq_params=packed)


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_incremental_decoding_with_kv_cache_equals_full_forward(qk_layernorm):
    config = GPTConfig.from_name("tiny", qk_layernorm=qk_layernorm, seed=5)
    model = GPTModel(config).eval()
    ids = _ids(1, 10, seed=7)
    cache = ContiguousKVCache(config, max_seq_len=16)
    assert isinstance(cache, KVCache)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :6], torch.arange(6)[None], kv_cache=cache)]
        for t in range(6, 10):
            steps.append(model(ids[:, t : t + 1], torch.tensor([[t]]), kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length(0) == cache.length(config.num_layers - 1) == 10


def test_kv_cache_overflow_raises_and_keeps_contents(model):
    cache = ContiguousKVCache(model.config, max_seq_len=4)
    with torch.no_grad():
        model(_ids(1, 3), torch.arange(3)[None], kv_cache=cache)
        with pytest.raises(KVCacheError, match="max_seq_len=4"):
            model(_ids(1, 2), torch.tensor([[3, 4]]), kv_cache=cache)
    assert cache.length(0) == 3


def test_kv_cache_rejects_keys_that_do_not_match_the_cached_tokens():
    config = GPTConfig.from_name("tiny")
    cache = ContiguousKVCache(config, max_seq_len=8)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cache.attend(0, q, k, k, scale=0.25)
    with pytest.raises(KVCacheError, match="call reset"):
        cache.attend(0, q, k.double(), k.double(), scale=0.25)
    assert cache.length(0) == 2
    cache.reset()
    assert cache.attend(0, q.double(), k.double(), k.double(), scale=0.25).dtype == torch.float64


def test_kv_cache_requires_positions_and_single_row(model):
    cache = ContiguousKVCache(model.config, max_seq_len=8)
    with pytest.raises(ModelInputError, match="position_ids=None"):
        model(_ids(1, 3), kv_cache=cache)
    with pytest.raises(ModelInputError, match="B must be 1"):
        model(_ids(2, 3), torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)


def test_return_hidden_then_compute_logits_equals_logits(model):
    ids = _ids(2, 6)
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)
        assert hidden.shape == (2, 6, model.config.hidden_size)
        torch.testing.assert_close(model.compute_logits(hidden), model(ids))


def test_explicit_position_ids_equal_default_positions(model):
    ids = _ids(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(6).expand(2, 6)), model(ids))


def test_activation_checkpointing_gives_same_loss_and_gradients():
    config = GPTConfig.from_name("tiny")
    plain = GPTModel(config)
    recomputed = GPTModel(config.replace(activation_checkpointing=True))
    ids = _ids(2, 8)
    grads = []
    for m in (plain, recomputed):
        m(ids).logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-6)


def test_same_seed_builds_identical_weights_and_other_seed_differs():
    a = GPTModel(GPTConfig.from_name("tiny", seed=3)).state_dict()
    b = GPTModel(GPTConfig.from_name("tiny", seed=3)).state_dict()
    c = GPTModel(GPTConfig.from_name("tiny", seed=4)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], c["layers.0.mlp.up_proj.weight"])


def test_tied_embeddings_share_the_output_weight():
    model = GPTModel(GPTConfig.from_name("tiny", tie_word_embeddings=True))
    assert model.output_layer is None
    assert model.output_weight() is model.embedding.weight


def test_flex_trains_on_cpu_with_the_gradients_of_eager():
    config = GPTConfig.from_name("tiny")
    ids = _ids(1, 9)
    packed = PackedSeqParams(torch.tensor([0, 4, 9], dtype=torch.int32), 5)
    grads = []
    for backend in ("eager", "flex"):
        model = GPTModel(config.replace(attention_backend=backend))
        model(ids, packed_seq_params=packed).logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-6)


def test_unknown_backend_set_after_construction_raises(model):
    model.config.attention_backend = "te"
    try:
        with pytest.raises(AttentionBackendError, match="attention_backend='te'"):
            model(_ids(1, 4))
    finally:
        model.config.attention_backend = "sdpa"


def test_bad_input_ids_raise_model_input_error(model):
    with pytest.raises(ModelInputError, match="input_ids"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ModelInputError, match="float32"):
        model(torch.zeros(1, 4))
    with pytest.raises(ModelInputError, match="position_ids"):
        model(_ids(1, 4), torch.arange(3)[None])


@pytest.mark.parametrize("name", preset_names())
def test_presets_build_valid_configs(name):
    config = GPTConfig.from_name(name)
    assert config.num_parameters() > 0
    # A token uses at least half the parameters of a dense model, and at least half of the
    # top_k / num_experts share of a sparse one (DeepSeek-V3: 37B of 671B).
    share = 0.5 if config.moe is None else 0.5 * config.moe.top_k / config.moe.num_experts
    assert config.flops_per_token(4096) > 6 * config.num_parameters() * share


def test_llama_3_2_1b_preset_has_the_published_parameter_count():
    # 1.24B parameters with tied embeddings (meta-llama/Llama-3.2-1B model card).
    assert round(GPTConfig.from_name("llama-3.2-1b").num_parameters() / 1e9, 2) == 1.24


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_query_groups", 3, "num_query_groups=3"),
        ("attention_backend", "te", "attention_backend='te'"),
        ("dtype", "int8", "dtype='int8'"),
        ("hidden_size", 0, "hidden_size=0"),
        ("norm_eps", 0.0, "norm_eps=0.0"),
        ("ffn_hidden_size", 96.0, "ffn_hidden_size=96.0"),
        ("num_query_groups", 2.0, "num_query_groups=2.0"),
        ("head_dim", 16.0, "head_dim=16.0"),
        ("max_position_embeddings", 0, "max_position_embeddings=0"),
    ],
)
def test_config_rejects_invalid_fields(field, value, match):
    with pytest.raises(ModelConfigError, match=match):
        GPTConfig.from_name("tiny", **{field: value})


def test_unknown_preset_name_raises():
    with pytest.raises(ModelConfigError, match="name='gpt-5'"):
        GPTConfig.from_name("gpt-5")


def test_replace_derives_head_dim_and_groups_again_when_width_changes():
    config = GPTConfig.from_name("tiny", num_query_groups=None)
    wider = config.replace(hidden_size=128, num_attention_heads=8)
    assert (wider.head_dim, wider.num_query_groups) == (16, 8)
    gqa = GPTConfig.from_name("tiny").replace(hidden_size=128)
    assert (gqa.head_dim, gqa.num_query_groups) == (32, 2)
    explicit = GPTConfig.from_name("tiny", head_dim=8).replace(hidden_size=128)
    assert explicit.head_dim == 8
