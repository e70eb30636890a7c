"""Hugging Face parity of MLA models: tiny random DeepSeek-V3 checkpoints (with and without
low-rank queries, with YaRN, dense and MoE) load with GPTModel.from_hf and give the logits and
parameter gradients of transformers' DeepseekV3ForCausalLM; to_hf writes back the same tensors
and a config transformers reads."""

from __future__ import annotations

import json

import pytest
import torch
from mla_hf_fixtures import VOCAB, save_deepseek_v3
from safetensors.torch import load_file

from mcore_models import CheckpointFormatError, GPTConfig, GPTModel, MLAConfig
from mcore_models.gpt.hf import hf_name
from mcore_models.moe.hf import moe_hf_pieces

transformers = pytest.importorskip("transformers")

CASES = {
    "dense-q_lora-yarn": dict(q_lora=True, yarn=True, moe=False),
    "dense-full_q": dict(q_lora=False, yarn=False, moe=False),
    "moe-q_lora-yarn": dict(q_lora=True, yarn=True, moe=True),
    "moe-full_q-yarn-halves": dict(q_lora=False, yarn=True, moe=True, interleave=False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_deepseek_v3(directory / "hf", **CASES[request.param])
    return request.param, directory, hf_model


def _hf_gradient(hf_model, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    params = dict(hf_model.named_parameters())
    if ".mlp.experts." in name:
        layer, kind = name.split(".")[1], name.rsplit(".", 1)[1]
        return params[f"model.layers.{layer}.mlp.experts.{kind}"].grad.reshape(shape)
    pieces = moe_hf_pieces(name, shape, None, "deepseek_v3")  # type: ignore[arg-type]
    hf = pieces[0].hf_name if pieces else hf_name(name)
    return params[hf].grad


def test_from_hf_matches_transformers_logits_and_gradients(checkpoint):
    case, directory, hf_model = checkpoint
    model = GPTModel.from_hf(directory / "hf")
    assert model.config.attention_type == "mla"
    assert (model.config.mla.q_lora_rank is not None) == CASES[case]["q_lora"]
    assert (model.config.moe is not None) == CASES[case]["moe"]
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 11, VOCAB, generator=torch.Generator().manual_seed(2))
    expected = hf_model(ids).logits
    logits = model(ids)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
    (expected * probe).sum().backward()
    (logits * probe).sum().backward()
    for name, param in model.named_parameters():
        reference = _hf_gradient(hf_model, name, tuple(param.shape))
        # fp32 rounding of products of random weights: the norms agree to ~1e-4; a swapped
        # head, projection or expert is off by O(1).
        error = ((param.grad - reference).norm() / reference.norm()).item()
        assert error < 2e-3, f"{name}: relative gradient error {error:.2e}"
    hf_model.zero_grad()


def test_to_hf_round_trips_tensors_and_transformers_reads_the_export(checkpoint):
    _, directory, hf_model = checkpoint
    model = GPTModel.from_hf(directory / "hf")
    model.to_hf(directory / "export")
    written = json.loads((directory / "export" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3"
    original = load_file(str(directory / "hf" / "model.safetensors"))
    exported = load_file(str(directory / "export" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory / "export").eval()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_model(ids).logits, atol=0, rtol=0)


def test_from_hf_ignores_multi_token_prediction_layers(tmp_path):
    from safetensors.torch import save_file

    save_deepseek_v3(tmp_path, q_lora=True, yarn=False, moe=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    # DeepSeek-V3 ships its multi-token-prediction module as one extra layer.
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = GPTModel.from_hf(tmp_path)
    assert len(model.layers) == 2


def test_export_rejects_a_router_deepseek_v3_cannot_express(tmp_path):
    config = GPTConfig(
        attention_type="mla",
        mla=MLAConfig(
            q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
        ),
        moe=dict(num_experts=4, top_k=2, router_score="softmax"),
        num_layers=1,
    )
    with pytest.raises(CheckpointFormatError, match="router_score='sigmoid'"):
        GPTModel(config).to_hf(tmp_path)


# config.json of deepseek-ai/DeepSeek-V3 on the Hugging Face Hub (transformers 4 layout).
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "ep_size": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def test_published_deepseek_v3_config_translates_to_the_preset():
    from mcore_models.gpt.hf import config_from_hf

    assert config_from_hf(DEEPSEEK_V3_CONFIG) == GPTConfig.from_name("deepseek-v3")
    quantized = dict(DEEPSEEK_V3_CONFIG, quantization_config={"quant_method": "fp8"})
    with pytest.raises(CheckpointFormatError, match="quant_method='fp8'"):
        config_from_hf(quantized)
