"""The GRPO driver loop: steps, evaluation, metrics, checkpoints, exports, progress, summary."""

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
from mcore_rl.metrics import MetricsLog, TensorBoardLog, plot_metrics, summary_line
from mcore_rl.summary import write_summary
from mcore_rl.workers import WorkerGroup, make_workers

__all__ = ["RunResult", "run_grpo"]

PHASES = ("generate", "logprobs", "reference", "train", "push")


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What a finished run reports."""

    run_dir: Path
    """The run directory."""
    records: list[dict[str, Any]]
    """Metrics of every step (the resumed part included; on rank 0 / the Ray driver)."""
    reached_target: bool
    """Whether the mean reward over the window reached ``target_reward`` (the same on every
    rank)."""
    seconds: float
    """Wall time of this invocation."""
    is_main: bool
    """Whether this process wrote the run directory (rank 0, or the Ray driver)."""
    hf_checkpoints: list[Path]
    """Hugging Face checkpoints exported by this invocation."""


def _reached(records: list[dict[str, Any]], config: GRPOConfig) -> bool:
    run = config.run
    if run.target_reward is None or len(records) < run.target_window:
        return False
    window = records[-run.target_window :]
    return sum(r["reward/mean"] for r in window) / len(window) >= run.target_reward


@contextmanager
def _progress(total: int, enabled: bool, completed: int) -> Iterator[Any]:
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
        progress.add_task("GRPO steps", total=total, completed=completed)
        progress.add_task("phase", total=len(PHASES))
        yield progress


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def run_grpo(config: GRPOConfig, workers: WorkerGroup | None = None) -> RunResult:
    """Runs (or resumes) a GRPO run.

    Writes into the run directory ``config.json``, ``metrics.jsonl`` (one line per step, with
    the evaluation metrics on evaluation steps), ``checkpoints/`` (resumable, every
    ``run.checkpoint_every`` steps and at the end), ``hf/step-N/`` (Hugging Face checkpoints,
    every ``run.hf_checkpoint_every`` steps and at the end of runs from ``model.hf_path``),
    ``metrics.png``, ``summary.md`` and, with ``run.tensorboard``, ``tensorboard/``.

    Every decision that ends the loop is rank 0's, broadcast to all ranks, so that a resumed
    multi-rank run (whose earlier metrics only rank 0 reads) stops everywhere at once.

    Args:
        config: The run config.
        workers: Workers to use; None builds them from ``run.mode`` (and closes them).

    Returns:
        The run's result.

    Raises:
        RLCheckpointError: If ``resume`` is set and the run directory holds no checkpoint.
    """
    began = time.perf_counter()
    run = config.run
    run_dir = Path(run.run_dir) if run.run_dir else _new_run_dir()
    checkpoints = run_dir / "checkpoints"
    if run.resume and not (checkpoints / "latest").exists():
        raise RLCheckpointError(
            f"run_dir={str(run_dir)!r} holds no checkpoint to resume (no {checkpoints}/latest)"
        )
    if run.tensorboard:
        TensorBoardLog.check_available()
    owned = workers is None
    group = make_workers(config) if workers is None else workers
    exported: list[Path] = []
    tensorboard: TensorBoardLog | None = None
    try:
        start = group.load_checkpoint(checkpoints) if run.resume else 0
        log = MetricsLog(run_dir / "metrics.jsonl", start) if group.is_main else None
        if group.is_main:
            (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
            if run.tensorboard:
                tensorboard = TensorBoardLog(run_dir / "tensorboard")
        records: list[dict[str, Any]] = list(log.records) if log is not None else []
        limit = run.num_steps
        if group.max_steps is not None:
            limit = min(limit, group.max_steps)
        step = start
        evaluated = -1

        def export(at: int) -> None:
            directory = run_dir / "hf" / f"step-{at:06d}"
            group.export_hf(directory)
            exported.append(directory)

        with _progress(limit, run.progress and group.is_main, start) as progress:

            def on_phase(name: str) -> None:
                if progress is not None:
                    index = PHASES.index(name) if name in PHASES else 0
                    progress.update(1, description=name, completed=index)

            while not group.agree(step >= limit or _reached(records, config)):
                record = group.step(step, on_phase)
                step += 1
                if _every(step, config.eval.every):
                    record.update(group.evaluate())
                    evaluated = step
                record["time/elapsed"] = time.perf_counter() - began
                records.append(record)
                if log is not None:
                    log.append(record)
                    if tensorboard is not None:
                        tensorboard.append(record)
                    line = summary_line(record)
                    if progress is not None:
                        progress.update(0, completed=step)
                        progress.update(1, completed=len(PHASES))
                        progress.console.print(line)
                    else:
                        print(line, flush=True)
                if _every(step, run.checkpoint_every):
                    group.save_checkpoint(checkpoints, step)
                if _every(step, run.hf_checkpoint_every):
                    export(step)
        if step > start:
            if not _every(step, run.checkpoint_every):
                group.save_checkpoint(checkpoints, step)
            if config.eval.every and evaluated != step:
                final = group.evaluate()
                if records and final:
                    records[-1].update(final)
                    if log is not None:
                        log.rewrite_last(records[-1])
            wants_export = run.hf_checkpoint_every or config.model.hf_path is not None
            if wants_export and not _every(step, run.hf_checkpoint_every):
                export(step)
        reached = group.agree(_reached(records, config))
        if group.is_main:
            if run.plot and records:
                plot_metrics(records, run_dir / "metrics.png")
            write_summary(
                run_dir / "summary.md",
                config=config,
                records=records,
                reached_target=reached,
                hf_checkpoints=sorted((run_dir / "hf").glob("step-*")),
                seconds=time.perf_counter() - began,
            )
    finally:
        if tensorboard is not None:
            tensorboard.close()
        if owned:
            group.close()
    return RunResult(
        run_dir=run_dir,
        records=records,
        reached_target=reached,
        seconds=time.perf_counter() - began,
        is_main=group.is_main,
        hf_checkpoints=exported,
    )


def _new_run_dir() -> Path:
    """A fresh ``runs/grpo-<time>`` directory name (suffixed when runs start in one second)."""
    base = Path(time.strftime("runs/grpo-%Y%m%d-%H%M%S"))
    candidate, number = base, 1
    while candidate.exists():
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate
