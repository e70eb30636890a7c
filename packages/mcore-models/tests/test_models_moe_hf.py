"""Hugging Face parity for MoE families: tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and dots.llm1
(DeepSeek-V3 routing: sigmoid scores, expert score-correction bias, group-limited top-k, routed
scaling) built with transformers, loaded with GPTModel.from_hf (logits equal) and exported back
with to_hf."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_models import CheckpointFormatError, GPTConfig, GPTModel
from mcore_models.hf_io import SafetensorsReader, read_into
from mcore_models.init import GlobalSlice
from mcore_models.moe import MoEConfig, MoELayer
from mcore_models.moe.hf import moe_hf_pieces

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**COMMON, intermediate_size=40, num_local_experts=4)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    elif kind == "dots1":
        config = transformers.Dots1Config(
            **{**COMMON, "num_experts_per_tok": 4},
            intermediate_size=48,
            moe_intermediate_size=16,
            head_dim=16,
            n_routed_experts=16,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            sliding_window=None,
        )
        model = transformers.Dots1ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=4,
            head_dim=16,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    model = model.float().eval()
    with torch.no_grad():
        # Routers start at zero in some families and norms at one: randomise everything so
        # that a swapped expert, projection or norm cannot pass.
        for param in model.parameters():
            param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Large enough to change which experts (and groups) win.
                buffer.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "dots1"])
def test_from_hf_matches_transformers_logits_and_to_hf_round_trips(kind, tmp_path):
    hf_model = _hf_model(kind)
    hf_model.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
        model = GPTModel.from_hf(tmp_path / "hf").eval()
        torch.testing.assert_close(model(ids), expected, atol=2e-5, rtol=2e-5)
    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoELayer)]
    assert len(moe_layers) == (1 if kind in ("qwen2_moe", "dots1") else 2)
    if kind == "dots1":
        moe = model.config.moe
        assert (moe.router_num_groups, moe.router_group_top_k) == (4, 2)
        assert moe.router_score == "sigmoid" and moe.router_scaling_factor == 2.5
    model.to_hf(tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["model_type"] == kind
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=2e-5, rtol=2e-5)


def test_from_hf_names_missing_expert(tmp_path):
    hf_model = _hf_model("mixtral")
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointFormatError,
        match=re.escape("'model.layers.1.block_sparse_moe.experts.3.w2.weight' is missing"),
    ):
        GPTModel.from_hf(tmp_path)


def test_to_hf_rejects_moe_options_without_hf_counterpart(tmp_path):
    moe = MoEConfig(num_experts=4, top_k=2, router_score="sigmoid")
    model = GPTModel(GPTConfig.from_name("tiny", moe=moe))
    with pytest.raises(CheckpointFormatError, match="router_expert_bias=True"):
        model.to_hf(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def _dots1_like_model() -> GPTModel:
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_ffn_hidden_size=8,
        shared_expert_ffn_hidden_size=16,
        router_score="sigmoid",
        router_expert_bias=True,
        router_num_groups=2,
        router_group_top_k=1,
        router_scaling_factor=2.0,
        dense_layers=(0,),
    )
    model = GPTModel(GPTConfig.from_name("tiny", qk_layernorm=True, seed=4, moe=moe))
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.router.expert_bias.normal_()
    return model


@pytest.mark.parametrize("model_type", ["dots1", "mixtral"])
def test_moe_hf_pieces_read_only_the_local_block(model_type, tmp_path):
    if model_type == "dots1":
        model = _dots1_like_model()
    else:
        model = GPTModel(GPTConfig.from_name("tiny", seed=4, moe=MoEConfig(num_experts=4)))
    model.to_hf(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    reader = SafetensorsReader(tmp_path)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    checked = 0
    for name, whole in tensors.items():
        pieces = moe_hf_pieces(name, tuple(whole.shape), model.config, model_type)
        if pieces is None:
            assert ".experts." not in name and ".router." not in name
            continue
        # Expert rank 1 of 2 along the experts, expert-TP rank 1 of 2 along the FFN width.
        offset = [0] * whole.dim()
        local_shape = list(whole.shape)
        if ".experts." in name:
            ffn_dim = 2
            for dim in (0, ffn_dim):
                local_shape[dim] //= 2
                offset[dim] = local_shape[dim]
        local = torch.full(local_shape, float("nan"), dtype=whole.dtype)
        where = GlobalSlice(name, tuple(whole.shape), tuple(offset))
        before = reader.bytes_read
        read_into(local, where, pieces, reader)
        expected = whole.detach()[where.box(tuple(local_shape))]
        torch.testing.assert_close(local, expected, atol=0, rtol=0)
        assert reader.bytes_read - before == local.numel() * local.element_size()
        checked += 1
    # dots1: one MoE layer (experts x2, router weight and bias, shared expert x3);
    # Mixtral: two MoE layers (experts x2, router).
    assert checked == (7 if model_type == "dots1" else 6)
