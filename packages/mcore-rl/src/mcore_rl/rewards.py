"""Rewards of prompt datasets: math answers, answer format, user ``module:function`` rewards.

A reward function is ``f(completion: str, answer: str, prompt: str) -> float`` (called with
these three positional arguments) returning a value in [0, 1]. :class:`RewardScorer` combines
several into their weighted mean. A function that raises, returns something that is not a
number in [0, 1], or (in the process pool) runs past its timeout fails that sample: the sample
gets reward 0 and the failure is counted, the run goes on.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import re
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from mcore_rl.errors import RLConfigError

__all__ = [
    "REWARDS",
    "RewardFunction",
    "RewardScorer",
    "extract_answer",
    "format_reward",
    "math_reward",
    "parse_number",
    "reference_answer",
    "resolve_reward",
]

RewardFunction = Callable[[str, str, str], float]
"""``f(completion, answer, prompt) -> reward in [0, 1]``."""

_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    # The content of the last \boxed{...} (or \fbox{...}), braces balanced.
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    index = text.index("{", start) + 1
    depth, begin = 1, index
    while index < len(text):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index]
        index += 1
    return None


def extract_answer(completion: str) -> str | None:
    """Extracts the final answer of a completion.

    The content of the last ``\\boxed{...}`` when there is one, else the last number.

    Args:
        completion: The generated text.

    Returns:
        The answer text, or None if the completion holds neither.
    """
    boxed = _boxed(completion)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1].strip() if numbers else None


def reference_answer(answer: str) -> str:
    """The final answer of a reference solution: what follows GSM8K's ``####``, a boxed value,
    or the text itself.

    Args:
        answer: The dataset's answer field.

    Returns:
        The final answer text.
    """
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = _boxed(answer)
    return boxed.strip() if boxed is not None else answer.strip()


def parse_number(text: str) -> Fraction | None:
    """Parses a number as written in an answer: ``-1,234.5``, ``$12``, ``3/4``, ``\\frac{3}{4}``,
    ``50%`` (as 50), with surrounding text like ``x =`` or a trailing dot removed.

    Args:
        text: The text.

    Returns:
        The exact value, or None if the text is not one number.
    """
    text = text.strip().rstrip(".").strip()
    text = re.sub(r"^[a-zA-Z]\s*=\s*", "", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = text.replace("\\!", "").replace("{,}", "").replace(",", "").replace(" ", "")
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}", text)
    if frac:
        text = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if not re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+)(/-?\d+)?", text):
        return None
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _equal(answer: str, reference: str) -> bool:
    got, want = parse_number(answer), parse_number(reference)
    if got is not None and want is not None:
        return got == want or abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    normalise = lambda s: re.sub(r"\s+", "", s).rstrip(".").lower()  # noqa: E731
    return bool(answer.strip()) and normalise(answer) == normalise(reference)


def math_reward(completion: str, answer: str, prompt: str = "") -> float:
    """1 when the completion's final answer equals the reference numerically, else 0.

    The completion's answer is its last ``\\boxed{}`` or else its last number
    (:func:`extract_answer`); the reference is :func:`reference_answer` of the dataset answer.
    Numbers compare exactly as fractions (``0.5`` equals ``1/2`` and ``\\frac{1}{2}``);
    non-numeric answers compare as text without spaces or case.

    Args:
        completion: The generated text.
        answer: The dataset's answer field.
        prompt: The prompt (unused).

    Returns:
        1.0 or 0.0.
    """
    del prompt
    extracted = extract_answer(completion)
    return 1.0 if extracted is not None and _equal(extracted, reference_answer(answer)) else 0.0


def format_reward(completion: str, answer: str = "", prompt: str = "") -> float:
    """1 when the completion states a final answer that parses as a number, else 0.

    A ``\\boxed{}`` answer counts when there is one; otherwise the completion's last number.
    The reward teaches the answer format independently of correctness.

    Args:
        completion: The generated text.
        answer: The dataset's answer field (unused).
        prompt: The prompt (unused).

    Returns:
        1.0 or 0.0.
    """
    del answer, prompt
    extracted = extract_answer(completion)
    return 1.0 if extracted is not None and parse_number(extracted) is not None else 0.0


REWARDS: dict[str, RewardFunction] = {"math": math_reward, "format": format_reward}
"""Built-in reward names -> functions."""


def resolve_reward(name: str) -> RewardFunction:
    """Looks up a reward by name or imports a ``module:function``.

    Args:
        name: A key of :data:`REWARDS` or ``package.module:function``.

    Returns:
        The callable.

    Raises:
        RLConfigError: If the name is unknown, the module does not import, or the attribute is
            missing or not callable.
    """
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise RLConfigError(
            f"reward={name!r} is unknown, expected one of {sorted(REWARDS)} or 'module:function'"
        )
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RLConfigError(
            f"reward={name!r}: module {module_name!r} does not import ({exc})"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RLConfigError(f"reward={name!r}: {module_name} has no callable {attribute!r}")
    return function  # type: ignore[no-any-return]


def _resolve_all(names: tuple[str, ...]) -> None:
    for name in names:
        resolve_reward(name)


def _score_one(
    names: tuple[str, ...], weights: tuple[float, ...], completion: str, answer: str, prompt: str
) -> float | None:
    # None marks a failed sample (an exception or a value that is not a reward).
    total = 0.0
    for name, weight in zip(names, weights):
        try:
            value = float(resolve_reward(name)(completion, answer, prompt))
        except Exception:
            return None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            return None
        total += weight * value
    return total / sum(weights)


class RewardScorer:
    """Scores completions with the weighted mean of reward functions, counting failures.

    Args:
        functions: Reward names or ``module:function`` strings (see :func:`resolve_reward`).
        weights: One weight per function; None weighs them equally.
        num_workers: Processes of the scoring pool; 0 scores in this process (no timeout).
        timeout: Seconds one sample may take in the pool.

    Raises:
        RLConfigError: If a function cannot be resolved or the weights do not match.
    """

    def __init__(
        self,
        functions: Sequence[str],
        weights: Sequence[float] | None = None,
        *,
        num_workers: int = 0,
        timeout: float = 10.0,
    ) -> None:
        self.names = tuple(functions)
        for name in self.names:
            resolve_reward(name)  # fail at construction, not at the first step
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(self.names)
        if len(self.weights) != len(self.names) or not sum(self.weights) > 0.0:
            raise RLConfigError(f"weights={self.weights} do not fit functions={self.names}")
        self.num_workers = num_workers
        self.timeout = timeout
        self.failures = 0
        """Samples that failed (exception, invalid value or timeout) since construction."""
        self.timeouts = 0
        """Of those, samples that ran past ``timeout``."""
        self._pool: Any = None

    def score(
        self, completions: Sequence[str], answers: Sequence[str], prompts: Sequence[str]
    ) -> list[float]:
        """Scores a batch of completions.

        Args:
            completions: Generated texts.
            answers: The reference answer of each.
            prompts: The prompt of each.

        Returns:
            One reward in [0, 1] per completion (0 for a failed sample).
        """
        items = list(zip(completions, answers, prompts))
        if self.num_workers == 0:
            results = [_score_one(self.names, self.weights, *item) for item in items]
        else:
            results = self._score_in_pool(items)
        self.failures += sum(r is None for r in results)
        return [0.0 if r is None else r for r in results]

    def _score_in_pool(self, items: list[tuple[str, str, str]]) -> list[float | None]:
        if self._pool is None:
            # NOTE: forkserver, not fork: the worker process holds threads (torch, gloo) that a
            # forked child would inherit in an unknown state. The server is a fresh process
            # that imports this module once; pool processes (also the replacements after a
            # timeout) fork from it without importing torch again.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            self._pool = context.Pool(self.num_workers)
            # Wait for every process to import the rewards once, so that start-up time does
            # not count against the first samples' timeouts.
            self._pool.map(_resolve_all, [self.names] * self.num_workers, chunksize=1)
        pending = [
            self._pool.apply_async(_score_one, (self.names, self.weights, *item)) for item in items
        ]
        results: list[float | None] = []
        began = time.monotonic()
        timed_out = False
        for index, job in enumerate(pending):
            # Jobs run num_workers at a time in order: job i may start after i // num_workers
            # timeouts at the latest, so its deadline is one timeout after that.
            deadline = began + self.timeout * (index // self.num_workers + 1)
            try:
                results.append(job.get(timeout=max(0.0, deadline - time.monotonic())))
            except multiprocessing.TimeoutError:
                results.append(None)
                self.timeouts += 1
                timed_out = True
            except Exception:
                results.append(None)
        if timed_out:
            # A stuck reward keeps its process busy: replace the pool.
            self.close()
        return results

    def close(self) -> None:
        """Terminates the scoring processes (a later :meth:`score` starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
