"""The task interface, the registry of tasks and the reward check shared by every task."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.errors import TaskError
from mcore_rl.tokenizer import DEFAULT_ALPHABET

__all__ = [
    "Problem",
    "Task",
    "FunctionTask",
    "register_task",
    "get_task",
    "available_tasks",
    "sample_problems",
]


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt of a task with what its verifier needs to score a completion."""

    prompt: str
    """The prompt text shown to the policy."""
    target: str
    """A reference answer (one of possibly many correct ones)."""
    data: tuple[Any, ...] = field(default=())
    """Task-specific facts the verifier needs (operands, numbers allowed ...)."""


class Task:
    """A procedural, verifiable task: a seeded prompt generator and a verifier.

    Subclasses implement :meth:`generate` and :meth:`verify`; :meth:`reward` checks the range.
    """

    name = "task"
    """Registry name of the task."""
    alphabet = DEFAULT_ALPHABET
    """Characters the task's prompts and answers use (the tokenizer's vocabulary)."""

    def generate(self, rng: random.Random) -> Problem:
        """Draws one problem.

        Args:
            rng: The random generator to draw from; the same state gives the same problem.

        Returns:
            The problem.
        """
        raise NotImplementedError

    def verify(self, problem: Problem, completion: str) -> float:
        """Scores a completion.

        Args:
            problem: The problem the completion answers.
            completion: The decoded completion (up to eos).

        Returns:
            The reward in [0, 1].
        """
        raise NotImplementedError

    def reward(self, problem: Problem, completion: str) -> float:
        """Scores a completion and checks that the reward lies in [0, 1].

        Args:
            problem: The problem the completion answers.
            completion: The decoded completion.

        Returns:
            The reward as a float in [0, 1].

        Raises:
            TaskError: If the verifier returned a value outside [0, 1] or not a number.
        """
        value = self.verify(problem, completion)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TaskError(
                f"task {self.name!r} returned reward={value!r} for completion={completion!r}, "
                "expected a float in [0, 1]"
            ) from None
        if not 0.0 <= value <= 1.0:
            raise TaskError(
                f"task {self.name!r} returned reward={value} for completion={completion!r}, "
                "expected a value in [0, 1]"
            )
        return value

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        """Scores completions, one :meth:`reward` each (tasks with slow rewards batch them).

        Args:
            problems: The problem of each completion.
            completions: The completion texts.

        Returns:
            One reward in [0, 1] per completion.
        """
        return [self.reward(p, c) for p, c in zip(problems, completions)]


class FunctionTask(Task):
    """A task made of two user callables.

    Args:
        name: Registry name.
        generate: ``generate(rng) -> Problem``.
        verify: ``verify(problem, completion) -> float`` in [0, 1].
        alphabet: Characters of the prompts and answers (the tokenizer's vocabulary).

    Raises:
        TaskError: If ``alphabet`` is empty or repeats a character.
    """

    def __init__(
        self,
        name: str,
        generate: Callable[[random.Random], Problem],
        verify: Callable[[Problem, str], float],
        *,
        alphabet: str = DEFAULT_ALPHABET,
    ) -> None:
        _check_alphabet(name, alphabet)
        self.name = name
        self.alphabet = alphabet
        self._generate = generate
        self._verify = verify

    def generate(self, rng: random.Random) -> Problem:
        """Draws one problem with the user generator.

        Args:
            rng: The random generator.

        Returns:
            The problem.

        Raises:
            TaskError: If the generator did not return a :class:`Problem`.
        """
        problem = self._generate(rng)
        if not isinstance(problem, Problem):
            raise TaskError(
                f"task {self.name!r} generator returned {type(problem).__name__}, "
                "expected a mcore_rl.tasks.Problem"
            )
        return problem

    def verify(self, problem: Problem, completion: str) -> float:
        """Scores a completion with the user verifier.

        Args:
            problem: The problem.
            completion: The decoded completion.

        Returns:
            The verifier's reward.
        """
        return self._verify(problem, completion)


def _check_alphabet(name: str, alphabet: str) -> None:
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise TaskError(
            f"alphabet={alphabet!r} of task {name!r} must be a non-empty string of distinct "
            "characters"
        )


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(
    name: str,
    factory: Callable[..., Task] | Callable[[random.Random], Problem],
    verify: Callable[[Problem, str], float] | None = None,
    *,
    overwrite: bool = False,
    alphabet: str = DEFAULT_ALPHABET,
) -> None:
    """Registers a task under a name.

    Either ``factory`` builds a :class:`Task` (called with the keyword options of
    :func:`get_task`), or ``factory`` is a problem generator and ``verify`` its verifier.

    Args:
        name: The registry name.
        factory: A Task factory, or a generator ``rng -> Problem`` when ``verify`` is given.
        verify: The verifier ``(problem, completion) -> reward`` of a generator.
        overwrite: Whether replacing an existing name is allowed.
        alphabet: With ``verify``: the characters of the task's prompts and answers (the
            tokenizer's vocabulary); a Task factory sets its own ``alphabet``.

    Raises:
        TaskError: If ``name`` is taken and ``overwrite`` is false, ``factory`` is not
            callable, or ``alphabet`` is empty or repeats a character.
    """
    if name in _REGISTRY and not overwrite:
        raise TaskError(f"name={name!r} is already registered; pass overwrite=True to replace it")
    if not callable(factory) or (verify is not None and not callable(verify)):
        raise TaskError(f"task {name!r}: factory and verify must be callables")
    if verify is None:
        _REGISTRY[name] = factory  # type: ignore[assignment]
    else:
        _check_alphabet(name, alphabet)
        generate, verifier = factory, verify
        _REGISTRY[name] = lambda: FunctionTask(
            name,
            generate,  # type: ignore[arg-type]
            verifier,
            alphabet=alphabet,
        )


def get_task(name: str, **options: Any) -> Task:
    """Builds a registered task.

    Args:
        name: The registry name.
        **options: Keyword options passed to the task factory.

    Returns:
        The task.

    Raises:
        TaskError: If ``name`` is not registered.
    """
    if name not in _REGISTRY:
        raise TaskError(f"task={name!r} is not registered, expected one of {available_tasks()}")
    task = _REGISTRY[name](**options)
    if not isinstance(task, Task):
        raise TaskError(f"factory of task {name!r} returned {type(task).__name__}, expected Task")
    return task


def available_tasks() -> list[str]:
    """Lists the registered task names.

    Returns:
        The names, sorted.
    """
    return sorted(_REGISTRY)


def sample_problems(task: Task, count: int, seed: int) -> list[Problem]:
    """Draws problems from a seeded generator, so a step's prompts depend only on the seed.

    Args:
        task: The task.
        count: How many problems.
        seed: The seed.

    Returns:
        The problems.

    Raises:
        TaskError: If ``count`` is negative.
    """
    if count < 0:
        raise TaskError(f"count={count} must be >= 0")
    rng = random.Random(seed)
    return [task.generate(rng) for _ in range(count)]
