"""The GRPO driver loop: steps, metrics, checkpoints, progress, plot."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcore_rl.config import GRPOConfig
from mcore_rl.errors import RLCheckpointError
from mcore_rl.metrics import MetricsLog, plot_metrics, summary_line
from mcore_rl.workers import WorkerGroup, make_workers

__all__ = ["RunResult", "run_grpo"]

PHASES = ("generate", "logprobs", "reference", "train")


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What a finished run reports."""

    run_dir: Path
    """The run directory."""
    records: list[dict[str, Any]]
    """Metrics of every step (the resumed part included)."""
    reached_target: bool
    """Whether the mean reward over the window reached ``target_reward``."""
    seconds: float
    """Wall time of this invocation."""
    is_main: bool
    """Whether this process wrote the run directory (rank 0, or the Ray driver)."""


def _reached(records: list[dict[str, Any]], config: GRPOConfig) -> bool:
    if config.target_reward is None or len(records) < config.target_window:
        return False
    window = records[-config.target_window :]
    return sum(r["reward/mean"] for r in window) / len(window) >= config.target_reward


@contextmanager
def _progress(config: GRPOConfig, enabled: bool, completed: int) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        progress.add_task("GRPO steps", total=config.num_steps, completed=completed)
        progress.add_task("phase", total=len(PHASES))
        yield progress


def run_grpo(config: GRPOConfig, workers: WorkerGroup | None = None) -> RunResult:
    """Runs (or resumes) a GRPO run.

    Writes into the run directory ``config.json``, ``metrics.jsonl`` (one line per step),
    ``checkpoints/`` (every ``checkpoint_every`` steps and at the end) and ``metrics.png``.

    Args:
        config: The run config.
        workers: Workers to use; None builds them from ``config.mode`` (and closes them).

    Returns:
        The run's result.

    Raises:
        RLCheckpointError: If ``resume`` is set and the run directory holds no checkpoint.
    """
    began = time.perf_counter()
    run_dir = Path(config.run_dir or time.strftime("runs/grpo-%Y%m%d-%H%M%S"))
    checkpoints = run_dir / "checkpoints"
    if config.resume and not (checkpoints / "latest").exists():
        raise RLCheckpointError(
            f"run_dir={str(run_dir)!r} holds no checkpoint to resume (no {checkpoints}/latest)"
        )
    owned = workers is None
    group = make_workers(config) if workers is None else workers
    try:
        start = group.load_checkpoint(checkpoints) if config.resume else 0
        log = MetricsLog(run_dir / "metrics.jsonl", start) if group.is_main else None
        if group.is_main:
            (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        records: list[dict[str, Any]] = list(log.records) if log is not None else []
        step = start
        with _progress(config, config.progress and group.is_main, start) as progress:

            def on_phase(name: str) -> None:
                if progress is not None:
                    index = PHASES.index(name) if name in PHASES else 0
                    progress.update(1, description=name, completed=index)

            while step < config.num_steps and not _reached(records, config):
                record = group.step(step, on_phase)
                record["time/elapsed"] = time.perf_counter() - began
                step += 1
                records.append(record)
                if log is not None:
                    log.append(record)
                    line = summary_line(record)
                    if progress is not None:
                        progress.update(0, completed=step)
                        progress.update(1, completed=len(PHASES))
                        progress.console.print(line)
                    else:
                        print(line, flush=True)
                if config.checkpoint_every and step % config.checkpoint_every == 0:
                    group.save_checkpoint(checkpoints, step)
        if step > start and not (config.checkpoint_every and step % config.checkpoint_every == 0):
            group.save_checkpoint(checkpoints, step)
        if config.plot and group.is_main and records:
            plot_metrics(records, run_dir / "metrics.png")
    finally:
        if owned:
            group.close()
    return RunResult(
        run_dir=run_dir,
        records=records,
        reached_target=_reached(records, config),
        seconds=time.perf_counter() - began,
        is_main=group.is_main,
    )
