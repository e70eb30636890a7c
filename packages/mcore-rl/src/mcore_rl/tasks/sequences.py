"""Sorting and reversing lists of digits."""

from __future__ import annotations

import random

from mcore_rl.errors import TaskError
from mcore_rl.tasks.base import Problem, Task
from mcore_rl.tasks.parsing import parse_int_list

__all__ = ["SortTask", "ReverseTask"]


class _ListTask(Task):
    prefix = ""

    def __init__(self, min_length: int = 2, max_length: int = 5, partial_credit: float = 0.5):
        if not 1 <= min_length <= max_length:
            raise TaskError(
                f"min_length={min_length}, max_length={max_length}: expected 1 <= min <= max"
            )
        if not 0.0 <= partial_credit < 1.0:
            raise TaskError(f"partial_credit={partial_credit} must be in [0, 1)")
        self.min_length = min_length
        self.max_length = max_length
        self.partial_credit = partial_credit

    def _transform(self, values: list[int]) -> list[int]:
        raise NotImplementedError

    def generate(self, rng: random.Random) -> Problem:
        """Draws a list of digits.

        Args:
            rng: The random generator.

        Returns:
            The problem; ``data`` is ``(expected_list,)``.
        """
        values = [rng.randint(0, 9) for _ in range(rng.randint(self.min_length, self.max_length))]
        expected = self._transform(values)
        prompt = f"{self.prefix}:{','.join(map(str, values))}="
        return Problem(prompt=prompt, target=",".join(map(str, expected)), data=(tuple(expected),))

    def verify(self, problem: Problem, completion: str) -> float:
        """Scores a comma-separated list.

        Args:
            problem: The problem.
            completion: The completion text.

        Returns:
            1 if exact, ``partial_credit`` times the fraction of right positions for a list of
            the right length, else 0.
        """
        answer = parse_int_list(completion)
        (expected,) = problem.data
        if answer is None or len(answer) != len(expected):
            return 0.0
        if tuple(answer) == tuple(expected):
            return 1.0
        right = sum(a == e for a, e in zip(answer, expected))
        return self.partial_credit * right / len(expected)


class SortTask(_ListTask):
    """Sort a list of digits ascending (``S:3,1,2=`` -> ``1,2,3``).

    Args:
        min_length: Shortest list.
        max_length: Longest list.
        partial_credit: Reward of a list of the right length with every position right but not
            equal (scaled by the fraction of right positions).
    """

    name = "sort"
    alphabet = "0123456789,:=S"
    prefix = "S"

    def _transform(self, values: list[int]) -> list[int]:
        return sorted(values)


class ReverseTask(_ListTask):
    """Reverse a list of digits (``R:3,1,2=`` -> ``2,1,3``).

    Args:
        min_length: Shortest list.
        max_length: Longest list.
        partial_credit: Largest reward of a wrong list of the right length.
    """

    name = "reverse"
    alphabet = "0123456789,:=R"
    prefix = "R"

    def _transform(self, values: list[int]) -> list[int]:
        return values[::-1]
