"""Timing and result files shared by the mcore-parallel benchmarks."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for on the CPU).

    Args:
        device: The rank's device.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step: Callable[[], Any], warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds of ``step`` over ``iters`` runs, the slowest rank's figure.

    Every rank calls it; the ranks start each run together (a barrier) and agree on the
    largest median.

    Args:
        step: The work of one run.
        warmup: Untimed runs first.
        iters: Timed runs.
        device: The rank's device.

    Returns:
        The largest per-rank median, in milliseconds.
    """
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(iters):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    median = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def write_result(out: Path, result: dict[str, Any], markdown: str) -> None:
    """Writes the JSON result to ``out``, its Markdown table next to it, and prints the table.

    Args:
        out: Path of the JSON file (the table goes to the same path with ``.md``).
        result: The result.
        markdown: The table.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
