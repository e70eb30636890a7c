"""Metrics of a run on disk: one JSON line per step, a summary line, and the PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcore_rl.errors import RLConfigError

__all__ = ["MetricsLog", "TensorBoardLog", "summary_line", "plot_metrics"]


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl``.

    Args:
        path: The JSONL file.
        first_step: Lines of steps at or after this are dropped on open (a resumed run rewrites
            the steps it repeats, so the file never holds a step twice).
    """

    def __init__(self, path: str | Path, first_step: int = 0) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    if record["step"] < first_step:
                        self.records.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as handle:
            for record in self.records:
                handle.write(json.dumps(record) + "\n")

    def append(self, record: dict[str, Any]) -> None:
        """Writes one step's metrics.

        Args:
            record: The metrics (JSON-serialisable, with a ``step`` key).
        """
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def rewrite_last(self, record: dict[str, Any]) -> None:
        """Replaces the last step's line (the final evaluation joins the last step's metrics).

        Args:
            record: The new metrics of the last step.
        """
        self.records[-1] = record
        with self.path.open("w") as handle:
            for line in self.records:
                handle.write(json.dumps(line) + "\n")


class TensorBoardLog:
    """Writes every numeric metric of a step as a TensorBoard scalar.

    Args:
        directory: The event file directory.

    Raises:
        RLConfigError: If the tensorboard package is not installed.
    """

    def __init__(self, directory: str | Path) -> None:
        self.check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    @staticmethod
    def check_available() -> None:
        """Checks that TensorBoard logging can run (before a run builds its workers).

        Raises:
            RLConfigError: If the tensorboard package is not installed.
        """
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise RLConfigError(
                "run.tensorboard=True needs the tensorboard package: install mcore-rl[tensorboard]"
            ) from None

    def append(self, record: dict[str, Any]) -> None:
        """Logs one step's metrics.

        Args:
            record: The metrics (with a ``step`` key).
        """
        step = int(record["step"])
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float):
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        """Flushes and closes the event file."""
        self.writer.close()


def summary_line(record: dict[str, Any]) -> str:
    """One line describing a step.

    Args:
        record: The step's metrics.

    Returns:
        The line.
    """
    times = sum(v for k, v in record.items() if k.startswith("time/") and k != "time/elapsed")
    parts = [
        f"step {int(record['step']):4d}",
        f"reward {record['reward/mean']:.3f}",
        f"acc {record['reward/accuracy']:.3f}",
        f"len {record['response/length']:.2f}",
        f"kl {record.get('kl', 0.0):.4f}",
        f"entropy {record.get('entropy', 0.0):.3f}",
        f"loss {record.get('loss', 0.0):+.4f}",
        f"pack {record['packing/efficiency']:.2f}",
        *([f"eval pass@1 {record['eval/pass@1']:.3f}"] if "eval/pass@1" in record else []),
        f"{times:.2f}s",
        f"{record.get('time/elapsed', 0.0):.0f}s total",
    ]
    return " | ".join(parts)


def plot_metrics(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Plots reward, KL (entropy when no KL was computed), response length and, when the run
    evaluated, held-out pass@1 and mean reward into a PNG.

    Args:
        records: Per-step metrics.
        path: The PNG file.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    has_kl = any("kl" in r for r in records)
    panels = [
        ("reward/mean", "mean reward"),
        ("kl", "KL to reference") if has_kl else ("entropy", "entropy (no KL: kl_beta=0)"),
        ("response/length", "response length"),
    ]
    evaluated = [r for r in records if "eval/pass@1" in r]
    if evaluated:
        panels.append(("eval", "held-out eval (greedy)"))
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for axis, (key, title) in zip(axes, panels):
        if key == "eval":
            for name, label in (("eval/pass@1", "pass@1"), ("eval/reward", "mean reward")):
                axis.plot(
                    [r["step"] + 1 for r in evaluated],
                    [r[name] for r in evaluated],
                    "o-",
                    label=label,
                )
            axis.legend()
        else:
            axis.plot(steps, [r.get(key, math.nan) for r in records])
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
