"""HybridConfig: the layer pattern, validation errors and the published presets."""

import pytest
import torch

from mcore_models import ModelConfigError, MoEConfig
from mcore_models.mamba import HybridConfig, HybridModel, hybrid_preset, hybrid_preset_names


def test_pattern_maps_to_layer_kinds_and_indices():
    config = HybridConfig(layer_pattern="M*-E", moe=MoEConfig(num_experts=4, top_k=2))
    assert config.layer_kinds == ["mamba", "attention", "mlp", "moe"]
    assert config.mamba_layer_indices == [0] and config.attention_layer_indices == [1]
    model = HybridModel(config)
    assert [type(layer.mixer).__name__ for layer in model.layers] == [
        "Mamba2Mixer",
        "Attention",
        "SquaredReLUMLP",
        "MoELayer",
    ]
    assert model(torch.randint(0, 256, (2, 9))).shape == (2, 9, 256)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_pattern": "M*X"}, "layer_pattern='M\\*X'"),
        ({"layer_pattern": "ME"}, "has MoE layers"),
        ({"chunk_size": 48}, "chunk_size=48"),
        ({"mamba_num_groups": 3}, "mamba_num_groups=3"),
        ({"time_step_limit": (0.1, 0.01)}, "time_step_limit"),
        ({"mlp_activation": "gelu"}, "mlp_activation='gelu'"),
        ({"dtype": "float64"}, "dtype='float64'"),
    ],
)
def test_invalid_fields_raise_model_config_error(fields, message):
    with pytest.raises(ModelConfigError, match=message):
        HybridConfig(**fields)


def test_published_presets_have_their_shapes():
    assert set(hybrid_preset_names()) >= {"mamba2-2.7b", "nemotron-h-8b", "tiny-hybrid"}
    nemotron = hybrid_preset("nemotron-h-8b")
    assert nemotron.num_layers == 52 and nemotron.layer_pattern.count("*") == 4
    assert nemotron.mamba_inner_size == 8192 and nemotron.conv_dim == 8192 + 2 * 8 * 128
    mamba = hybrid_preset("mamba2-2.7b")
    assert mamba.num_layers == 64 and mamba.mamba_num_heads == 80
    with pytest.raises(ModelConfigError, match="not a preset"):
        hybrid_preset("mamba3")
