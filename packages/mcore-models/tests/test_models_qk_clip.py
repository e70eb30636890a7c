"""QK-logit clipping: tracked maxima, rescaling above the threshold, no-op below it."""

from __future__ import annotations

import pytest
import torch

from mcore_models import GPTConfig, GPTModel, ModelConfigError, ModelInputError
from mcore_models.gpt.qk_clip import attention_logit_maxima, clip_qk
from mcore_models.gpt.rope import apply_rotary


def _reference_maxima(model: GPTModel, ids: torch.Tensor) -> torch.Tensor:
    """Per-head maxima computed independently from explicit query-key scores."""
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        for name in ("q_proj", "k_proj"):
            module = getattr(layer.self_attention, name)
            hooks.append(
                module.register_forward_hook(
                    lambda mod, args, out, key=f"{i}.{name}": captured.__setitem__(key, out)
                )
            )
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    seq, dim = ids.shape[1], model.config.kv_channels
    cos, sin = model.rotary(torch.arange(seq)[None])
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    rows = []
    for i in range(len(model.layers)):
        q = apply_rotary(captured[f"{i}.q_proj"].unflatten(-1, (-1, dim)), cos, sin)
        k = apply_rotary(captured[f"{i}.k_proj"].unflatten(-1, (-1, dim)), cos, sin)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * dim**-0.5
        rows.append(scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)))
    return torch.stack(rows)


def _exaggerated_model(backend: str = "sdpa") -> GPTModel:
    config = GPTConfig.from_name("tiny", qk_clip_tracking=True, attention_backend=backend)
    model = GPTModel(config)
    with torch.no_grad():
        model.layers[0].self_attention.q_proj.weight[16:32] *= 60.0
        model.layers[0].self_attention.k_proj.weight[:16] *= 60.0
    return model


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", ["sdpa", "flex", "eager"])
def test_tracked_maxima_equal_explicit_scores_for_every_backend(backend):
    model = _exaggerated_model(backend)
    with torch.no_grad():
        model(IDS)
    tracked = attention_logit_maxima(model)
    torch.testing.assert_close(tracked, _reference_maxima(model, IDS), rtol=1e-5, atol=1e-4)


def test_clip_qk_lowers_an_exaggerated_maximum_to_the_threshold():
    model = _exaggerated_model()
    with torch.no_grad():
        model(IDS)
    before = attention_logit_maxima(model).clone()
    threshold = 5.0
    assert before[0].max() > 4 * threshold
    used = clip_qk(model, threshold, alpha=0.5)
    torch.testing.assert_close(used, before)
    with torch.no_grad():
        model(IDS)
    after = attention_logit_maxima(model)
    # Layer 0 sees unchanged inputs, so each head's logits shrink by its exact factor.
    gamma = torch.clamp(threshold / before[0], max=1.0)
    group_gamma = gamma.view(model.config.num_kv_heads, -1).amin(dim=1)
    kv_factor = group_gamma.repeat_interleave(gamma.numel() // group_gamma.numel())
    expected = before[0] * gamma.sqrt() * kv_factor.sqrt()
    torch.testing.assert_close(after[0], expected, rtol=1e-4, atol=1e-4)
    assert after[0].max() <= threshold * (1 + 1e-4)
    assert torch.isclose(after[0].max(), torch.tensor(threshold), rtol=1e-4)


def test_clip_qk_below_threshold_leaves_weights_unchanged():
    model = GPTModel(GPTConfig.from_name("tiny", qk_clip_tracking=True, add_qkv_bias=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model(IDS)
    maxima = clip_qk(model, threshold=1e4)
    assert maxima.shape == (2, 4)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_clip_qk_alpha_splits_the_rescaling_between_queries_and_keys():
    model = _exaggerated_model()
    q_before = model.layers[0].self_attention.q_proj.weight.clone()
    k_before = model.layers[0].self_attention.k_proj.weight.clone()
    with torch.no_grad():
        model(IDS)
    maxima = clip_qk(model, 5.0, alpha=1.0)
    gamma = torch.clamp(5.0 / maxima[0], max=1.0).repeat_interleave(16)
    torch.testing.assert_close(
        model.layers[0].self_attention.q_proj.weight, q_before * gamma[:, None]
    )
    assert torch.equal(model.layers[0].self_attention.k_proj.weight, k_before)


def test_clip_qk_rejects_bad_arguments_and_untracked_models():
    model = _exaggerated_model()
    with pytest.raises(ModelInputError, match="no attention logits"):
        clip_qk(model, 5.0)
    with pytest.raises(ModelConfigError, match="threshold=0"):
        clip_qk(model, 0)
    with pytest.raises(ModelConfigError, match=r"alpha=1\.5"):
        clip_qk(model, 5.0, alpha=1.5)
    with pytest.raises(ModelConfigError, match="qk_clip_tracking=False"):
        clip_qk(GPTModel(GPTConfig.from_name("tiny")), 5.0)
    with pytest.raises(ModelConfigError, match="qk_layernorm=True"):
        clip_qk(
            GPTModel(GPTConfig.from_name("tiny", qk_layernorm=True, qk_clip_tracking=True)), 5.0
        )
