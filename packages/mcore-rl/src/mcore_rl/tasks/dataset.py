"""Prompts from a dataset, scored by reward functions (see :mod:`mcore_rl.rewards`)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from mcore_rl.rewards import RewardScorer
from mcore_rl.tasks.base import Problem, Task

__all__ = ["DatasetTask"]


class DatasetTask(Task):
    """A task whose problems come from a dataset and whose reward is a :class:`RewardScorer`.

    Args:
        scorer: Scores completions against the problems' reference answers.
    """

    name = "dataset"

    def __init__(self, scorer: RewardScorer) -> None:
        self.scorer = scorer

    def generate(self, rng: random.Random) -> Problem:
        """Not available: the problems come from the dataset.

        Args:
            rng: Unused.

        Raises:
            NotImplementedError: Always.
        """
        raise NotImplementedError("a DatasetTask's problems come from its prompt dataset")

    def verify(self, problem: Problem, completion: str) -> float:
        """Scores one completion.

        Args:
            problem: The problem (its target is the reference answer).
            completion: The completion text.

        Returns:
            The reward (0 for a failed sample).
        """
        return self.scorer.score([completion], [problem.target], [problem.prompt])[0]

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """Scores completions together (in the scorer's process pool when it has one).

        Args:
            problems: The problem of each completion.
            completions: The completion texts.

        Returns:
            One reward per completion.
        """
        return self.scorer.score(
            completions, [p.target for p in problems], [p.prompt for p in problems]
        )
