"""QK clipping of MLA heads: clipped heads end exactly at the threshold (one layer, so no later
layer sees changed inputs), others keep their maximum, and the weights move as the Kimi K2
recipe says (per-head no-position rows by sqrt(gamma), rotary query rows by gamma, the shared
rotary key and the values untouched)."""

from __future__ import annotations

import torch

from mcore_models import GPTConfig, GPTModel, attention_logit_maxima, clip_qk

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def test_clip_brings_mla_heads_to_the_threshold_and_scales_only_per_head_parts():
    config = GPTConfig.from_name(
        "tiny-mla", num_layers=1, num_attention_heads=8, init_std=0.3, qk_clip_tracking=True
    )
    model = GPTModel(config)
    with torch.no_grad():
        model(IDS)
    before = attention_logit_maxima(model)[0]
    threshold = before.median().item()
    clipped = before > threshold
    assert 0 < int(clipped.sum()) < 8
    attention = model.layers[0].self_attention
    q_before = attention.q_b_proj.weight.detach().clone()
    kv_b_before = attention.kv_b_proj.weight.detach().clone()
    kv_a_before = attention.kv_a_proj_with_mqa.weight.detach().clone()
    clip_qk(model, threshold)
    with torch.no_grad():
        model(IDS)
    after = attention_logit_maxima(model)[0]
    # Hand computation: a clipped head's logits all shrink by gamma = t / S, so its new
    # maximum is t; the other heads are untouched.
    expected = torch.where(clipped, torch.full_like(before, threshold), before)
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-5)
    assert bool((after <= threshold + 1e-4).all())
    mla = config.mla
    gamma = torch.clamp(threshold / before, max=1.0)
    q_rows = torch.cat(
        [
            gamma.sqrt()[:, None].expand(-1, mla.qk_nope_head_dim),
            gamma[:, None].expand(-1, mla.qk_rope_head_dim),
        ],
        dim=1,
    ).flatten()
    torch.testing.assert_close(attention.q_b_proj.weight, q_before * q_rows[:, None])
    k_rows = torch.cat(
        [gamma.sqrt()[:, None].expand(-1, mla.qk_nope_head_dim), torch.ones(8, mla.v_head_dim)],
        dim=1,
    ).flatten()
    torch.testing.assert_close(attention.kv_b_proj.weight, kv_b_before * k_rows[:, None])
    assert torch.equal(attention.kv_a_proj_with_mqa.weight, kv_a_before)
