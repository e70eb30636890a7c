"""Advantage estimators against hand-computed values."""

import pytest
import torch

from mcore_rl.advantages import compute_advantages
from mcore_rl.errors import RLInputError

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])


def test_grpo_divides_by_sample_std():
    # Group 1: mean 0.5, sample std sqrt(1/3).
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (1 / 3) ** 0.5
    out = compute_advantages(REWARDS, 4, "grpo")
    torch.testing.assert_close(out[:4], expected)
    assert torch.equal(out[4:], torch.zeros(4))


def test_leave_one_out_subtracts_mean_of_others():
    # r_0 = 1, others 0, 0, 1 -> 1 - 1/3.
    out = compute_advantages(REWARDS, 4, "leave_one_out")
    torch.testing.assert_close(out[:4], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(out[4:], torch.zeros(4))


def test_dr_grpo_is_mean_only():
    out = compute_advantages(torch.tensor([0.0, 0.25, 1.0]), 3, "dr_grpo")
    torch.testing.assert_close(out, torch.tensor([-5 / 12, -2 / 12, 7 / 12]))


@pytest.mark.parametrize("estimator", ["grpo", "leave_one_out", "dr_grpo"])
def test_zero_std_group_gets_zero_advantage(estimator):
    out = compute_advantages(torch.full((6,), 0.7), 3, estimator)
    assert torch.equal(out, torch.zeros(6))


def test_bad_inputs_raise():
    with pytest.raises(RLInputError, match="group_size=1"):
        compute_advantages(REWARDS, 1)
    with pytest.raises(RLInputError, match="divisible by group_size=3"):
        compute_advantages(REWARDS, 3)
    with pytest.raises(RLInputError, match="estimator='ppo'"):
        compute_advantages(REWARDS, 4, "ppo")  # type: ignore[arg-type]
