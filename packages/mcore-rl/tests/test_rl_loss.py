"""The GRPO loss against a plain per-token reference written with Python floats."""

import math

import pytest
import torch

from mcore_rl.errors import RLConfigError, RLInputError
from mcore_rl.loss import LossConfig, grpo_loss, grpo_loss_metric_names


def _reference(lp, old, adv, mask, ref, inf, cfg, total):
    # Sum over tokens of the documented per-token formula, one token at a time.
    loss = 0.0
    for t in range(len(lp)):
        if not mask[t]:
            continue
        ratio = math.exp(lp[t] - old[t])
        clipped = min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high)
        term = -min(ratio * adv[t], clipped * adv[t])
        d = ref[t] - lp[t]
        term += cfg.kl_beta * (math.exp(d) - d - 1)
        weight = min(math.exp(old[t] - inf[t]), cfg.importance_sampling_cap)
        loss += weight * term
    return loss / total


def _inputs(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    lp = (old + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.3).double()
    ref = old + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    inf = old + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    return lp, old, adv, mask, ref, inf


def test_loss_matches_reference_with_clipping_kl_and_importance_weights():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, kl_beta=0.05, importance_sampling_cap=1.5)
    lp, old, adv, mask, ref, inf = _inputs()
    loss, metrics = grpo_loss(
        lp,
        old,
        adv,
        mask,
        num_global_tokens=100.0,
        config=cfg,
        ref_logprobs=ref,
        inference_logprobs=inf,
    )
    expected = _reference(*(t.tolist() for t in (lp, old, adv, mask, ref, inf)), cfg, 100.0)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert 0.0 < metrics["clip_fraction"].item() < mask.sum().item() / 100
    assert metrics["kl"].item() > 0.0


def test_loss_gradient_matches_reference_gradient():
    cfg = LossConfig(kl_beta=0.1, importance_sampling_cap=2.0)
    lp, old, adv, mask, ref, inf = _inputs(16, seed=1)
    loss, _ = grpo_loss(
        lp,
        old,
        adv,
        mask,
        num_global_tokens=10.0,
        config=cfg,
        ref_logprobs=ref,
        inference_logprobs=inf,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    eps = 1e-6
    for t in range(16):
        values = [x.tolist() for x in (lp, old, adv, mask, ref, inf)]
        values[0][t] += eps
        up = _reference(*values, cfg, 10.0)
        values[0][t] -= 2 * eps
        down = _reference(*values, cfg, 10.0)
        assert grad[t].item() == pytest.approx((up - down) / (2 * eps), abs=1e-6)


def test_clip_higher_bounds_positive_and_negative_advantages_differently():
    cfg = LossConfig(clip_low=0.1, clip_high=0.5, importance_sampling_cap=None)
    old = torch.zeros(2)
    lp = torch.log(torch.tensor([2.0, 0.5])).requires_grad_()
    loss, _ = grpo_loss(
        lp, old, torch.tensor([1.0, -1.0]), torch.ones(2), num_global_tokens=1.0, config=cfg
    )
    # Token 0: ratio 2 clipped at 1.5 (A > 0); token 1: ratio 0.5 clipped at 0.9 (A < 0).
    assert loss.item() == pytest.approx(-1.5 + 0.9)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.equal(grad, torch.zeros(2))


def test_token_normalisation_sums_to_global_mean_over_microbatches():
    cfg = LossConfig(importance_sampling_cap=None)
    lp, old, adv, mask, _, _ = _inputs(40, seed=2)
    total = mask.sum().item()
    whole, _ = grpo_loss(lp, old, adv, mask, num_global_tokens=total, config=cfg)
    parts = sum(
        grpo_loss(lp[s], old[s], adv[s], mask[s], num_global_tokens=total, config=cfg)[0]
        for s in (slice(0, 13), slice(13, 40))
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_loss_inputs_are_validated():
    cfg = LossConfig(kl_beta=0.1)
    x = torch.zeros(3)
    with pytest.raises(RLInputError, match="advantages has shape"):
        grpo_loss(x, x, torch.zeros(4), x, num_global_tokens=1, config=cfg, ref_logprobs=x)
    with pytest.raises(RLInputError, match="ref_logprobs is None"):
        grpo_loss(x, x, x, x, num_global_tokens=1, config=cfg)
    with pytest.raises(RLInputError, match="num_global_tokens=0"):
        grpo_loss(x, x, x, x, num_global_tokens=0, config=cfg, ref_logprobs=x)
    with pytest.raises(RLConfigError, match=r"clip_low=1\.5"):
        LossConfig(clip_low=1.5)


def test_entropy_bonus_lowers_loss_by_coefficient_times_mean_entropy():
    lp, old, adv, mask, _, _ = _inputs(24, seed=3)
    entropy = torch.rand(24, dtype=torch.float64, requires_grad=True)
    plain, _ = grpo_loss(
        lp,
        old,
        adv,
        mask,
        num_global_tokens=10.0,
        config=LossConfig(importance_sampling_cap=None),
        entropy=entropy,
    )
    bonus, _ = grpo_loss(
        lp,
        old,
        adv,
        mask,
        num_global_tokens=10.0,
        config=LossConfig(importance_sampling_cap=None, entropy_coef=0.3),
        entropy=entropy,
    )
    expected = 0.3 * (entropy * mask).sum().item() / 10.0
    assert plain.item() - bonus.item() == pytest.approx(expected, rel=1e-5)
    (grad,) = torch.autograd.grad(bonus, entropy)
    torch.testing.assert_close(grad, -0.3 * mask / 10.0, check_dtype=False)


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_metric_names_equal_what_grpo_loss_returns(cap, reference, inference, entropy):
    # Pipeline stages without a loss reduce these names; they must be grpo_loss's own.
    lp = torch.full((4,), -1.0)
    config = LossConfig(importance_sampling_cap=cap, entropy_coef=0.0, kl_beta=0.0)
    _, metrics = grpo_loss(
        lp,
        lp,
        torch.ones(4),
        torch.ones(4),
        num_global_tokens=4.0,
        config=config,
        ref_logprobs=lp if reference else None,
        inference_logprobs=lp if inference else None,
        entropy=torch.ones(4) if entropy else None,
    )
    names = grpo_loss_metric_names(
        config, reference=reference, inference=inference, entropy=entropy
    )
    assert names == set(metrics) | {"loss"}
