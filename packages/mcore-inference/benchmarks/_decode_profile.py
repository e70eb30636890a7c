"""Kernel count per decode token and GPU busy fraction of ``InferenceEngine.generate``.

Two profiled ``generate`` calls on a warm engine (graphs captured): one generating a single
token (prefill and first token) and one generating ``1 + tokens``; their difference, divided by
``tokens``, is the cost of one decode step. Kernels launched by CUDA graphs are traced one by
one (CUPTI), so the counts hold with graphs on. The GPU busy fraction is the summed duration of
the GPU activities (kernels, copies, sets; one stream, so they do not overlap) over the wall
time of the same steps.

Under programmatic dependent launch the kernels of a step overlap (a kernel starts while the
previous one runs and waits for it), so summed durations exceed the wall time. Each activity
is therefore also charged its *critical* time: how much later the GPU's busy span ends because
of it (its end minus the latest end before it, nothing if it ends inside that span). The
critical times of a step sum to the span the GPU is busy; the gaps between are idle time.
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


def _gpu_activities(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start, duration) in us of every GPU activity of a finished profile, by start."""
    handle, path = tempfile.mkstemp(suffix=".json", prefix="decode_trace_")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    finally:
        os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted(
        (
            (str(event.get("name", "?")), float(event.get("ts", 0.0)), float(event.get("dur", 0.0)))
            for event in events
            if event.get("ph") == "X" and event.get("cat") in _GPU_CATEGORIES
        ),
        key=lambda activity: activity[1],
    )


def _critical(
    activities: list[tuple[str, float, float]],
) -> tuple[list[float], float, list[float]]:
    """Critical time of each activity (see the module docstring), the idle time between, and
    the idle gap right before each activity."""
    critical: list[float] = []
    gaps: list[float] = []
    busy_end: float | None = None
    idle = 0.0
    for _, start, duration in activities:
        end = start + duration
        if busy_end is None:
            critical.append(duration)
            gaps.append(0.0)
            busy_end = end
            continue
        gap = max(0.0, start - busy_end)
        idle += gap
        gaps.append(gap)
        critical.append(max(0.0, end - max(start, busy_end)))
        busy_end = max(busy_end, end)
    return critical, idle, gaps


def _profiled(run: Any) -> tuple[list[tuple[str, float, float]], float]:
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
        Per decode step: kernels (GPU activities), GPU time, wall time, busy fraction, the
        busy span and idle time, the 25 kernels of most critical time with their count, time,
        critical time and the idle gaps right before them per step, and the 8 activities
        preceded by the most idle time (``idle_before``).
    """

    def run(count: int) -> None:
        engine.generate(prompts, params_type(temperature=0.0, max_tokens=count))

    short, short_wall = _profiled(lambda: run(1))
    full, full_wall = _profiled(lambda: run(1 + tokens))
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    idle_us = 0.0
    for sign, activities in ((1, full), (-1, short)):
        critical, idle, gaps = _critical(activities)
        idle_us += sign * idle
        for (name, _, duration), charged, gap in zip(activities, critical, gaps, strict=True):
            per_name[name][0] += sign
            per_name[name][1] += sign * duration
            per_name[name][2] += sign * charged
            per_name[name][3] += sign * gap
    gpu_us = (sum(d for _, _, d in full) - sum(d for _, _, d in short)) / tokens
    wall_us = (full_wall - short_wall) * 1e6 / tokens
    busy_us = sum(entry[2] for entry in per_name.values()) / tokens
    top = sorted(per_name.items(), key=lambda item: -item[1][2])[:25]
    idle_top = sorted(per_name.items(), key=lambda item: -item[1][3])[:8]
    return {
        "batch": len(prompts),
        "profiled_tokens": tokens,
        "kernels_per_step": (len(full) - len(short)) / tokens,
        "gpu_us_per_step": gpu_us,
        "wall_us_per_step": wall_us,
        "gpu_busy_fraction": gpu_us / wall_us if wall_us > 0 else float("nan"),
        "busy_span_us_per_step": busy_us,
        "idle_us_per_step": idle_us / tokens,
        "top_kernels": [
            {
                "name": name[:120],
                "per_step": count / tokens,
                "us_per_step": duration / tokens,
                "critical_us_per_step": charged / tokens,
                "idle_before_us_per_step": gap / tokens,
            }
            for name, (count, duration, charged, gap) in top
        ],
        "idle_before": [
            {"name": name[:120], "per_step": count / tokens, "idle_us_per_step": gap / tokens}
            for name, (count, _, _, gap) in idle_top
        ],
    }


def host_split(engine: Any, prompts: list[list[int]], tokens: int, params_type: Any) -> dict:
    """Where a decode step's time goes between the host and the GPU (warm engine, graphs on).

    - ``graph_us_per_step``: the GPU time of one captured decode step (forward and LM head,
      no sampling), from back-to-back replays of the engine's graph of this batch size;
    - ``host_us_per_step``: the host's own time per step of ``generate`` (wall time minus the
      time it spent waiting for the GPU in the token readback's event waits);
    - ``wait_us_per_step``: that waiting. Near zero, the host is the bottleneck: the GPU then
      waits for the host's next launch instead.

    Args:
        engine: A warm ``InferenceEngine`` (graphs captured for ``len(prompts)``).
        prompts: The prompts (the batch).
        tokens: Decode steps to time.
        params_type: ``SamplingParams``.

    Returns:
        The three times above, per decode step.
    """
    from mcore_inference import readback

    waited = [0.0]
    real_wait = readback.DeferredSamples.wait

    def timed_wait(self: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_wait(self)
        finally:
            waited[0] += time.perf_counter() - start

    def run(count: int) -> float:
        waited[0] = 0.0
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params_type(temperature=0.0, max_tokens=count))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    readback.DeferredSamples.wait = timed_wait  # type: ignore[method-assign]
    try:
        short = run(1)
        short_wait = waited[0]
        full = run(1 + tokens)
        full_wait = waited[0]
    finally:
        readback.DeferredSamples.wait = real_wait  # type: ignore[method-assign]
    wall_us = (full - short) * 1e6 / tokens
    wait_us = (full_wait - short_wait) * 1e6 / tokens
    result = {"wall_us_per_step": wall_us, "wait_us_per_step": wait_us,
              "host_us_per_step": wall_us - wait_us}  # fmt: skip
    for width, us in graph_replay_us(engine, len(prompts), tokens).items():
        # The last (widest) table's graph, and each width's under its own key.
        result["graph_us_per_step"] = us
        result[f"graph_us_per_step_width_{width}"] = us
    return result


def graph_replay_us(engine: Any, batch: int, steps: int) -> dict[int, float]:
    """GPU time of one captured decode step per block-table width (back-to-back replays).

    Host-independent: the replays are queued without host work between them, so the time is
    the GPU's alone (the engine's step time also depends on the host's bookkeeping).

    Args:
        engine: A warm ``InferenceEngine`` with graphs captured for ``batch``.
        batch: The graph bucket.
        steps: Replays timed per width.

    Returns:
        Microseconds per replay by table width (widest last).
    """
    graphs = getattr(getattr(engine, "_runner", None), "graphs", None)
    # Keys are (bucket, width, decode): the decode step's graph where a bucket has two.
    entries = {
        width: graph
        for (bucket, width, _), (graph, _) in sorted(getattr(graphs, "_graphs", {}).items())
        if bucket == batch
    }
    result: dict[int, float] = {}
    for width, graph in sorted(entries.items()):
        graph.replay()
        torch.cuda.synchronize()
        start_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
        for _ in range(steps):
            graph.replay()
        end_event.record()
        end_event.synchronize()
        result[width] = start_event.elapsed_time(end_event) * 1e3 / steps
    return result


_PHASES = (
    ("schedule", "mcore_inference.scheduler", "Scheduler", ("admit", "schedule")),
    ("build", "mcore_inference.engine_step", None, ("build_microbatch", "plan_run")),
    ("forward_launch", "mcore_inference.stage", "StageRunner", ("run", "run_steps")),
    ("sample_launch", "mcore_inference.engine_step", None, ("sample_microbatch",)),
    ("readback_start", "mcore_inference.readback", "SampleReadback", ("start",)),
    ("gpu_wait", "mcore_inference.readback", "DeferredSamples", ("wait",)),
    ("apply_tokens", "mcore_inference.engine_results", "_ResultBook", ("_complete",)),
)
"""Phases of an engine step timed by :func:`host_breakdown`: (name, module, class or None for
a module-level function, attribute names)."""


def host_breakdown(engine: Any, prompts: list[list[int]], tokens: int, params_type: Any) -> dict:
    """Host microseconds per decode step in each phase of the engine's step loop.

    Wraps the step loop's functions with wall-clock timers (``time.perf_counter``, about a
    microsecond per call of overhead) and times ``generate`` of 1 and of ``1 + tokens`` tokens;
    the difference divided by ``tokens`` is charged to each phase: scheduling (admission and
    the choice of tokens), batch building (and multi-step run planning), the forward's launch
    (graph replays; with multi-step decode also the device-side sampling of every step of a
    run), the single-step sampler's launch, the start of the asynchronous readback, the waits
    for the GPU, applying the read tokens to the requests (stop checks, reports), and the rest
    of the loop (``other``).

    Args:
        engine: A warm ``InferenceEngine``.
        prompts: The prompts (the batch).
        tokens: Decode steps to time.
        params_type: ``SamplingParams``.

    Returns:
        ``{phase: us per step}`` with ``wall`` and ``other``.
    """
    import importlib

    spent: dict[str, float] = defaultdict(float)
    restore: list[tuple[Any, str, Any]] = []

    def wrap(name: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return timed

    for phase, module_name, class_name, attributes in _PHASES:
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name) if class_name else module
        for attribute in attributes:
            if hasattr(owner, attribute):
                original = getattr(owner, attribute)
                restore.append((owner, attribute, original))
                setattr(owner, attribute, wrap(phase, original))

    def run(count: int) -> tuple[float, dict[str, float]]:
        spent.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params_type(temperature=0.0, max_tokens=count))
        torch.cuda.synchronize()
        return time.perf_counter() - start, dict(spent)

    try:
        short, short_spent = run(1)
        full, full_spent = run(1 + tokens)
    finally:
        for owner, attribute, original in reversed(restore):
            setattr(owner, attribute, original)
    result = {"wall": (full - short) * 1e6 / tokens}
    for phase, *_ in _PHASES:
        result[phase] = (full_spent.get(phase, 0.0) - short_spent.get(phase, 0.0)) * 1e6 / tokens
    result["other"] = result["wall"] - sum(result[phase] for phase, *_ in _PHASES)
    return result
