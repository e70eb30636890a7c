"""GPU checks of MLA: bf16 logits of a DeepSeek-V3-layout model are as close to fp32 as
transformers' own bf16 (sdpa and flex backends), and fp32 parity on CUDA with gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from _bf16_parity import bf16_errors

from mcore_models import GPTModel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 512, (2, 384), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=[True, False], ids=["q_lora", "full_q"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=96 if request.param else None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=48,
        max_position_embeddings=4096,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=1024,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    directory = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(checkpoint, backend):
    hf_model, directory = checkpoint
    our_error, hf_error = bf16_errors(hf_model, directory, IDS.cuda(), backend)
    assert our_error <= 1.5 * hf_error + 1e-2, (our_error, hf_error)


def test_fp32_logits_and_gradients_match_transformers_on_cuda(checkpoint):
    hf_model, directory = checkpoint
    hf_model = copy.deepcopy(hf_model).cuda()
    ids = IDS[:, :128].cuda()
    model = GPTModel.from_hf(directory, device="cuda")
    expected, logits = hf_model(ids).logits, model(ids)
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=2e-3)
    expected.logsumexp(-1).mean().backward()
    logits.logsumexp(-1).mean().backward()
    hf_params = dict(hf_model.named_parameters())
    for name in ("layers.0.self_attention.kv_b_proj.weight", "embedding.weight"):
        hf = (
            "model.embed_tokens.weight"
            if name == "embedding.weight"
            else ("model.layers.0.self_attn.kv_b_proj.weight")
        )
        grad, reference = dict(model.named_parameters())[name].grad, hf_params[hf].grad
        assert ((grad - reference).norm() / reference.norm()).item() < 1e-2, name
