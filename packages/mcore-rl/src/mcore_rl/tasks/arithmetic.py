"""Arithmetic: ``a+b=`` prompts answered with the integer result."""

from __future__ import annotations

import random

from mcore_rl.errors import TaskError
from mcore_rl.tasks.base import Problem, Task
from mcore_rl.tasks.parsing import parse_int

__all__ = ["ArithmeticTask"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(Task):
    """Binary arithmetic on non-negative operands.

    Reward: 1 for the exact result; a well-formed wrong integer earns up to
    ``partial_credit`` scaled by its closeness, so a policy from random init first learns the
    answer format and then the answer; anything else earns 0.

    Args:
        max_operand: Operands are drawn from ``[0, max_operand]``.
        ops: The operators to draw from, a subset of ``"+-*"``.
        partial_credit: The largest reward of a wrong integer answer, in [0, 1).

    Raises:
        TaskError: If an argument is out of range.
    """

    name = "arithmetic"
    alphabet = "0123456789+-*="

    def __init__(self, max_operand: int = 9, ops: str = "+", partial_credit: float = 0.1) -> None:
        if max_operand < 0:
            raise TaskError(f"max_operand={max_operand} must be >= 0")
        if not ops or not set(ops) <= set(_OPS):
            raise TaskError(f"ops={ops!r} must be a non-empty subset of '+-*'")
        if not 0.0 <= partial_credit < 1.0:
            raise TaskError(f"partial_credit={partial_credit} must be in [0, 1)")
        self.max_operand = max_operand
        self.ops = ops
        self.partial_credit = partial_credit

    def generate(self, rng: random.Random) -> Problem:
        """Draws ``a op b``.

        Args:
            rng: The random generator.

        Returns:
            The problem; ``data`` is ``(a, op, b, result)``.
        """
        a = rng.randint(0, self.max_operand)
        b = rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        result = _OPS[op](a, b)
        return Problem(prompt=f"{a}{op}{b}=", target=str(result), data=(a, op, b, result))

    def verify(self, problem: Problem, completion: str) -> float:
        """Scores an integer answer.

        Args:
            problem: The problem.
            completion: The completion text.

        Returns:
            1 if exact, up to ``partial_credit`` for a close integer, else 0.
        """
        answer = parse_int(completion)
        if answer is None:
            return 0.0
        result = problem.data[3]
        if answer == result:
            return 1.0
        closeness = max(0.0, 1.0 - abs(answer - result) / (abs(result) + 1))
        return self.partial_credit * (0.5 + 0.5 * closeness)
