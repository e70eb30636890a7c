"""Countdown: reach a target with ``+ - *`` over given numbers, each used at most once."""

from __future__ import annotations

import random
from collections import Counter

from mcore_rl.errors import TaskError
from mcore_rl.tasks.base import Problem, Task
from mcore_rl.tasks.parsing import evaluate_expression

__all__ = ["CountdownTask"]


class CountdownTask(Task):
    """Countdown with targets reachable by construction.

    The generator draws the numbers, then builds a random expression over a random non-empty
    subset of them; its value is the target, so every prompt has at least that solution.

    Args:
        num_numbers: How many numbers a prompt offers.
        max_number: Numbers are drawn from ``[1, max_number]``.
        format_credit: Reward of a valid expression over allowed numbers with the wrong value.

    Raises:
        TaskError: If an argument is out of range.
    """

    name = "countdown"
    alphabet = "0123456789+-*()=,:>C"

    def __init__(self, num_numbers: int = 3, max_number: int = 9, format_credit: float = 0.1):
        if num_numbers < 2:
            raise TaskError(f"num_numbers={num_numbers} must be >= 2")
        if max_number < 1:
            raise TaskError(f"max_number={max_number} must be >= 1")
        if not 0.0 <= format_credit < 1.0:
            raise TaskError(f"format_credit={format_credit} must be in [0, 1)")
        self.num_numbers = num_numbers
        self.max_number = max_number
        self.format_credit = format_credit

    def generate(self, rng: random.Random) -> Problem:
        """Draws numbers and a target reached by a random expression over some of them.

        Args:
            rng: The random generator.

        Returns:
            The problem; ``target`` is the building expression, ``data`` is
            ``(numbers, target_value)``.
        """
        numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        used = rng.sample(numbers, rng.randint(2, self.num_numbers))
        expression = str(used[0])
        for n in used[1:]:
            expression += f"{rng.choice('+-*')}{n}"
        evaluated = evaluate_expression(expression)
        assert evaluated is not None  # built only from digits and + - * ( )
        value = evaluated[0]
        prompt = f"C:{','.join(map(str, numbers))}>{value}="
        return Problem(prompt=prompt, target=expression, data=(tuple(numbers), value))

    def verify(self, problem: Problem, completion: str) -> float:
        """Scores an expression.

        Args:
            problem: The problem.
            completion: The completion text.

        Returns:
            1 if it reaches the target with allowed numbers, ``format_credit`` if it is valid
            but misses, else 0.
        """
        evaluated = evaluate_expression(completion.strip())
        if evaluated is None:
            return 0.0
        value, literals = evaluated
        numbers, target = problem.data
        if Counter(literals) - Counter(numbers):
            return 0.0
        return 1.0 if value == target else self.format_credit
