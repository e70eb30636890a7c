"""Prompt datasets: JSONL, Parquet or Hugging Face ``datasets`` records -> problems per step.

Records become :class:`~mcore_rl.tasks.Problem` objects (prompt text, reference answer). The
training order is a seeded shuffle per epoch, so the prompts of step ``s`` depend only on the
seed and ``s`` (a resumed run sees the same prompts). A held-out split is taken from a
separate file or from the head of the seeded shuffle.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_rl.config import DataConfig
from mcore_rl.errors import RLDataError
from mcore_rl.tasks import Problem

__all__ = ["PromptDataset", "load_records", "load_prompt_dataset"]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RLDataError(f"{path}:{number} is not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict):
            raise RLDataError(f"{path}:{number} is {type(record).__name__}, expected an object")
        records.append(record)
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise RLDataError(
            f"path={str(path)!r} is Parquet, which needs pyarrow: install mcore-rl[data]"
        ) from None
    return list(parquet.read_table(path).to_pylist())


def _read_hf(name: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise RLDataError(
            f"path='hf:{name}' needs the datasets package (pip install datasets)"
        ) from None
    return [dict(r) for r in datasets.load_dataset(name, split=split)]


def load_records(path: str, *, split: str = "train") -> list[dict[str, Any]]:
    """Reads the records of a dataset file.

    Args:
        path: ``.jsonl``/``.json`` (one object per line), ``.parquet``, or ``hf:NAME``.
        split: Split of an ``hf:`` dataset.

    Returns:
        The records.

    Raises:
        RLDataError: If the file is missing, of an unknown kind, or malformed, or a needed
            package is missing.
    """
    if path.startswith("hf:"):
        return _read_hf(path[3:], split)
    file = Path(path)
    if not file.is_file():
        raise RLDataError(f"path={path!r} does not exist (expected a .jsonl or .parquet file)")
    suffix = file.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(file)
    if suffix == ".parquet":
        return _read_parquet(file)
    raise RLDataError(f"path={path!r} has suffix {suffix!r}, expected .jsonl, .json or .parquet")


def _problems(records: list[dict[str, Any]], config: DataConfig, source: str) -> list[Problem]:
    problems = []
    for index, record in enumerate(records):
        for name in (config.prompt_field, config.answer_field):
            if name not in record:
                raise RLDataError(
                    f"record {index} of {source} has no field {name!r} (fields: "
                    f"{sorted(record)}); set data.prompt_field / data.answer_field"
                )
        prompt, answer = record[config.prompt_field], record[config.answer_field]
        if not isinstance(prompt, str):
            raise RLDataError(
                f"record {index} of {source}: {config.prompt_field}={prompt!r} is not text"
            )
        problems.append(Problem(prompt=prompt, target=str(answer)))
    return problems


@dataclass(kw_only=True, slots=True)
class PromptDataset:
    """Training and held-out problems and the prompts skipped while loading."""

    train: list[Problem]
    """Training problems, in file order."""
    eval: list[Problem]
    """Held-out problems."""
    skipped: int
    """Prompts skipped because they do not fit the context."""
    seed: int
    """Seed of the shuffles."""
    epochs: int | None
    """Passes over ``train`` (None: unbounded)."""

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
        return order

    def max_steps(self, prompts_per_step: int) -> int | None:
        """Steps until the epochs are used up.

        Args:
            prompts_per_step: Prompts per step.

        Returns:
            The step count (at least 1), or None when ``epochs`` is None.
        """
        if self.epochs is None:
            return None
        return max(1, self.epochs * len(self.train) // prompts_per_step)

    def problems_for_step(self, step: int, count: int) -> list[Problem]:
        """The ``count`` problems of a step: the next slice of the per-epoch shuffled order.

        Args:
            step: Step number.
            count: Prompts per step.

        Returns:
            The problems.
        """
        size = len(self.train)
        first = step * count
        chosen = []
        for position in range(first, first + count):
            epoch, index = divmod(position, size)
            chosen.append(self.train[self._order(epoch)[index]])
        return chosen


def load_prompt_dataset(
    config: DataConfig,
    *,
    seed: int,
    fits: Callable[[str], bool] | None = None,
    eval_limit: int | None = None,
) -> PromptDataset:
    """Loads, filters and splits a prompt dataset.

    Args:
        config: The data section (``path`` must be set).
        seed: Seed of the split and of the per-epoch shuffles.
        fits: ``fits(prompt) -> bool``: whether a prompt fits the context; prompts that do not
            are skipped and counted. None keeps every prompt.
        eval_limit: Most held-out problems kept.

    Returns:
        The dataset.

    Raises:
        RLDataError: If a file is missing or malformed, a field is missing, or the training or
            a requested held-out set is empty.
    """
    if config.path is None:
        raise RLDataError("data.path is not set")
    problems = _problems(load_records(config.path, split=config.split), config, config.path)
    if not problems:
        raise RLDataError(f"path={config.path!r} holds no records")
    if config.eval_path is not None:
        held_out = _problems(load_records(config.eval_path), config, config.eval_path)
    else:
        order = list(range(len(problems)))
        random.Random(f"{seed}/split").shuffle(order)
        if config.eval_size >= len(problems):
            raise RLDataError(
                f"eval_size={config.eval_size} leaves no training prompts of the "
                f"{len(problems)} in {config.path!r}"
            )
        held = set(order[: config.eval_size])
        held_out = [problems[i] for i in order[: config.eval_size]]
        problems = [p for i, p in enumerate(problems) if i not in held]
    skipped = 0
    if fits is not None:
        kept = [p for p in problems if fits(p.prompt)]
        skipped = len(problems) - len(kept)
        problems = kept
        held_out = [p for p in held_out if fits(p.prompt)]
    if not problems:
        raise RLDataError(
            f"every one of the {skipped} training prompts of {config.path!r} is longer than the "
            "context allows (prompt tokens + rollout.max_new_tokens > the model's "
            "max_position_embeddings, or > data.max_prompt_tokens)"
        )
    if (config.eval_path is not None or config.eval_size) and not held_out:
        raise RLDataError("the held-out set is empty after skipping prompts that do not fit")
    if eval_limit is not None:
        held_out = held_out[:eval_limit]
    return PromptDataset(
        train=problems, eval=held_out, skipped=skipped, seed=seed, epochs=config.epochs
    )
