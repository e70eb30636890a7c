"""Hugging Face parity: tiny random Llama / Qwen2 / Qwen3 built with transformers, loaded here."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_models import CheckpointFormatError, GPTModel

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 96, 64, 2, 4, 2, 112


def _hf_config(kind: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=FFN,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    if kind == "llama":
        return transformers.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(
            **common,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    return transformers.Qwen3Config(
        **common, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    )


_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _hf_model(kind: str):
    torch.manual_seed(0)
    model = getattr(transformers, _CLASSES[kind])(_hf_config(kind)).float().eval()
    with torch.no_grad():
        # Norm weights start at one; randomise them so that a swapped norm cannot pass.
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def hf_checkpoint(request, tmp_path_factory):
    model = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory


def _tokens(batch: int = 2, seq_len: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_from_hf_logits_match_transformers_fp32(hf_checkpoint, backend):
    _, hf_model, directory = hf_checkpoint
    model = GPTModel.from_hf(directory, attention_backend=backend).eval()
    ids = _tokens()
    with torch.no_grad():
        expected = hf_model(ids).logits.float()
        actual = model(ids)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_from_hf_reads_the_architecture_options(hf_checkpoint):
    kind, _, directory = hf_checkpoint
    config = GPTModel.from_hf(directory).config
    assert config.add_qkv_bias == (kind == "qwen2")
    assert config.qk_layernorm == (kind == "qwen3")
    assert config.tie_word_embeddings == (kind == "qwen2")
    assert (config.rope_scaling is not None) == (kind == "llama")
    assert config.num_query_groups == KV_HEADS


def test_to_hf_round_trip_loads_in_transformers_with_equal_logits(hf_checkpoint, tmp_path):
    kind, _, directory = hf_checkpoint
    model = GPTModel.from_hf(directory).eval()
    model.to_hf(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert type(reloaded).__name__ == _CLASSES[kind]
    ids = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits.float(), model(ids), atol=1e-4, rtol=0)
    again = GPTModel.from_hf(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_from_hf_reads_sharded_checkpoints_with_an_index(tmp_path):
    hf_model = _hf_model("llama")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = GPTModel.from_hf(tmp_path).eval()
    ids = _tokens(1, 7)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model(ids).logits, atol=1e-4, rtol=0)


def test_to_hf_over_a_sharded_checkpoint_replaces_it(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    model = GPTModel.from_hf(tmp_path).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)
    model.to_hf(tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    ids = _tokens(1, 7)
    with torch.no_grad():
        torch.testing.assert_close(GPTModel.from_hf(tmp_path)(ids), model(ids), atol=0, rtol=0)


def test_from_hf_rejects_unsupported_architecture(tmp_path):
    hf_model = _hf_model("llama")
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match="model_type='gpt2'"):
        GPTModel.from_hf(tmp_path)


def test_from_hf_names_a_missing_config_key(tmp_path):
    hf_model = _hf_model("llama")
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match=r"lacks \['intermediate_size'\]"):
        GPTModel.from_hf(tmp_path)


def test_from_hf_names_the_tensor_with_a_mismatched_shape(tmp_path):
    hf_model = _hf_model("llama")
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = FFN + 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointFormatError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"
    ):
        GPTModel.from_hf(tmp_path)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "qwen3-0.6b"])
def test_preset_config_round_trips_through_transformers_config(name):
    from mcore_models import GPTConfig
    from mcore_models.gpt.hf import config_from_hf, config_to_hf

    config = GPTConfig.from_name(name)
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
    assert config_from_hf(hf_config.to_dict()) == config


def test_config_from_hf_reads_the_transformers_4_rope_layout():
    from mcore_models.gpt.hf import config_from_hf

    legacy = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config = config_from_hf(legacy)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0


def test_from_hf_takes_the_state_by_position_or_keyword(hf_checkpoint):
    # The public contract is ``GPTModel.from_hf(dir, state=None)``: both call forms load the
    # same weights.
    _, _, directory = hf_checkpoint
    by_position = GPTModel.from_hf(directory, None).state_dict()
    by_keyword = GPTModel.from_hf(directory, state=None).state_dict()
    assert by_position.keys() == by_keyword.keys()
    for name, tensor in by_position.items():
        assert torch.equal(tensor, by_keyword[name]), name
