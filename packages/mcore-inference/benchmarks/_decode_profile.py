"""Kernel count per decode token and GPU busy fraction of ``InferenceEngine.generate``.

Two profiled ``generate`` calls on a warm engine (graphs captured): one generating a single
token (prefill and first token) and one generating ``1 + tokens``; their difference, divided by
``tokens``, is the cost of one decode step. Kernels launched by CUDA graphs are traced one by
one (CUPTI), so the counts hold with graphs on. The GPU busy fraction is the summed duration of
the GPU activities (kernels, copies, sets; one stream, so they do not overlap) over the wall
time of the same steps.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _gpu_activities(prof: Any) -> list[tuple[str, float]]:
    """(name, duration in us) of every GPU activity of a finished profile."""
    handle, path = tempfile.mkstemp(suffix=".json", prefix="decode_trace_")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    finally:
        os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [
        (str(event.get("name", "?")), float(event.get("dur", 0.0)))
        for event in events
        if event.get("ph") == "X" and event.get("cat") in _GPU_CATEGORIES
    ]


def _profiled(run: Any) -> tuple[list[tuple[str, float]], float]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # CUDA activities only: recording host ops would slow the host loop being measured.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return _gpu_activities(prof), wall


def profile_decode(engine: Any, prompts: list[list[int]], tokens: int, params_type: Any) -> dict:
    """Profile the decode steps of ``engine.generate`` on ``prompts``.

    Args:
        engine: A warm ``InferenceEngine`` (graphs captured for ``len(prompts)``).
        prompts: The prompts (the batch).
        tokens: Decode tokens per request to profile.
        params_type: ``SamplingParams`` (passed in to keep this module import-free).

    Returns:
        Per decode step: kernels (GPU activities), GPU time, wall time, busy fraction, and the
        15 kernels of most GPU time with their count and time per step.
    """

    def run(count: int) -> None:
        engine.generate(prompts, params_type(temperature=0.0, max_tokens=count))

    short, short_wall = _profiled(lambda: run(1))
    full, full_wall = _profiled(lambda: run(1 + tokens))
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for sign, activities in ((1, full), (-1, short)):
        for name, duration in activities:
            per_name[name][0] += sign
            per_name[name][1] += sign * duration
    gpu_us = (sum(d for _, d in full) - sum(d for _, d in short)) / tokens
    wall_us = (full_wall - short_wall) * 1e6 / tokens
    top = sorted(per_name.items(), key=lambda item: -item[1][1])[:25]
    return {
        "batch": len(prompts),
        "profiled_tokens": tokens,
        "kernels_per_step": (len(full) - len(short)) / tokens,
        "gpu_us_per_step": gpu_us,
        "wall_us_per_step": wall_us,
        "gpu_busy_fraction": gpu_us / wall_us if wall_us > 0 else float("nan"),
        "top_kernels": [
            {
                "name": name[:120],
                "per_step": count / tokens,
                "us_per_step": duration / tokens,
            }
            for name, (count, duration) in top
        ],
    }
