"""Rewards on a table of completions (well-formed, equivalent, malformed), user rewards that
fail without stopping the run, and the process pool with a per-sample timeout."""

import time
from fractions import Fraction

import pytest

from mcore_rl.errors import RLConfigError
from mcore_rl.rewards import (
    RewardScorer,
    extract_answer,
    format_reward,
    math_reward,
    parse_number,
    reference_answer,
    resolve_reward,
)

GSM8K_ANSWER = (
    "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"
)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("She sold 72 clips in total.", GSM8K_ANSWER, 1.0),
        ("48 + 24 = 72", GSM8K_ANSWER, 1.0),
        ("The answer is \\boxed{72}.", GSM8K_ANSWER, 1.0),
        ("\\boxed{72.0}", "72", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("$1,234.00", "1234", 1.0),
        ("so x = -5", "-5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{3/4}", "\\boxed{0.75}", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{\\text{A}}", "\\text{a}", 1.0),
        ("I think 71, no wait, 72", "72", 1.0),
        ("72 then 71", "72", 0.0),  # the last number counts
        ("\\boxed{72} but 71", "71", 0.0),  # a boxed answer beats later numbers
        ("\\boxed{73}", GSM8K_ANSWER, 0.0),
        ("no number here", GSM8K_ANSWER, 0.0),
        ("", "72", 0.0),
        ("\\boxed{72", "72", 1.0),  # unclosed box: falls back to the last number
        ("\\boxed{}", "72", 0.0),
        ("\\boxed{seventy-two}", "72", 0.0),
        ("72", "not a number", 0.0),
        ("1/0", "1", 0.0),
    ],
)
def test_math_reward_table(completion, answer, expected):
    assert math_reward(completion, answer, "prompt") == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("\\boxed{72}", 1.0),
        ("The answer is 5", 1.0),
        ("\\boxed{x+1}", 0.0),
        ("nothing", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward_table(completion, expected):
    assert format_reward(completion, "72", "prompt") == expected


def test_extraction_and_parsing_helpers():
    assert extract_answer("a \\boxed{x^{2}} b") == "x^{2}"  # nested braces
    assert extract_answer("1, then 2.5") == "2.5"
    assert extract_answer("none") is None
    assert reference_answer(GSM8K_ANSWER) == "72"
    assert reference_answer("\\boxed{7}") == "7"
    assert parse_number("-1,234.5") == Fraction(-2469, 2)
    assert parse_number("\\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("12abc") is None


def raising_reward(completion, answer, prompt):
    if "7" in completion:
        raise RuntimeError("the verifier broke")
    return 1.0


def out_of_range_reward(completion, answer, prompt):
    return 2.0


def slow_reward(completion, answer, prompt):
    if completion == "slow":
        time.sleep(30)
    return 1.0


def test_user_reward_exceptions_give_zero_and_are_counted():
    scorer = RewardScorer([f"{__name__}:raising_reward"])
    assert scorer.score(["1", "7", "2", "77"], ["1"] * 4, ["p"] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert scorer.failures == 2
    bad = RewardScorer([f"{__name__}:out_of_range_reward"])
    assert bad.score(["1"], ["1"], ["p"]) == [0.0] and bad.failures == 1


def test_weighted_mean_of_rewards():
    scorer = RewardScorer(["math", "format"], [3.0, 1.0])
    assert scorer.score(["5", "4", "x"], ["5"] * 3, ["p"] * 3) == [1.0, 0.25, 0.0]


def test_unknown_rewards_fail_at_construction():
    with pytest.raises(RLConfigError, match="reward='nope' is unknown"):
        RewardScorer(["nope"])
    with pytest.raises(RLConfigError, match="does not import"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(RLConfigError, match="has no callable 'missing'"):
        resolve_reward(f"{__name__}:missing")


def test_process_pool_scores_like_in_process_and_times_out_slow_samples():
    completions = ["1", "slow", "7", "2"]
    pooled = RewardScorer([f"{__name__}:slow_reward", "math"], num_workers=2, timeout=3.0)
    try:
        assert pooled.score(["1"], ["1"], ["p"]) == [1.0]  # starts the pool (not timed)
        began = time.monotonic()
        rewards = pooled.score(completions, ["1", "1", "1", "2"], ["p"] * 4)
        elapsed = time.monotonic() - began
        assert rewards == [1.0, 0.0, 0.5, 1.0]
        assert (pooled.failures, pooled.timeouts) == (1, 1)
        assert elapsed < 25.0  # the 30 s sample was abandoned, not awaited
        # The pool was replaced after the timeout and still scores.
        assert pooled.score(["3"], ["3"], ["p"]) == [1.0]
    finally:
        pooled.close()
    local = RewardScorer([f"{__name__}:slow_reward", "math"])
    assert local.score(["1", "7", "2"], ["1", "1", "2"], ["p"] * 3) == [1.0, 0.5, 1.0]
