"""Shared helpers of the mcore-kernels benchmarks: timing, copy bandwidth, result files."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def device_info() -> dict[str, Any]:
    """Describe the GPU and the software stack of this run."""
    props = torch.cuda.get_device_properties(0)
    import triton

    return {
        "device": torch.cuda.get_device_name(0),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def bench_ms(fn: Callable[[], Any], *, graph: bool = False, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (or its CUDA-graph variant)
    over about ``rep`` milliseconds of calls."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(do_bench(fn, warmup=min(25, rep), rep=rep, return_mode="median"))


L2_FLUSH_BYTES = 150e6
"""Bytes one graph cycles through before reusing an input set: three H100/H200 L2 caches."""


def cuda_generator(seed: int = 0) -> torch.Generator:
    """A CUDA generator of its own for benchmark inputs.

    A graph capture that fails (a peer that cannot be captured) can leave the default CUDA
    generator in its capture state, after which every ``torch.randn`` on the device raises;
    inputs drawn from a private generator are unaffected.
    """
    return torch.Generator(device="cuda").manual_seed(seed)


def input_sets(bytes_per_call: int, cap: int = 32) -> int:
    """Number of input sets a graph rotates through so that every call reads cold inputs.

    A CUDA graph of back-to-back calls on the same tensors would time L2-resident inputs for
    tensors smaller than the cache; cycling through enough copies reads from memory instead,
    as ``triton.testing.do_bench`` does by flushing the cache between calls.
    """
    return max(1, min(cap, -(-int(L2_FLUSH_BYTES) // max(int(bytes_per_call), 1))))


def graph_us(make_calls: Callable[[], list[Callable[[], Any]]], min_calls: int = 10) -> float:
    """GPU microseconds per call, without host launch cost: median over replays of one graph.

    ``make_calls`` runs on the capture stream (so that the autograd graph of a forward made
    there sends its backward to the same stream) and returns one call per input set; the graph
    holds ``max(len(calls), min_calls)`` calls, cycling over the sets.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    calls = _run_once(make_calls, stream)
    count = max(len(calls), min_calls)
    graph, _ = _capture(calls, count, stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / count)
    del graph, calls
    return sorted(times)[len(times) // 2]


def _run_once(
    make_calls: Callable[[], list[Callable[[], Any]]], stream: torch.cuda.Stream
) -> list[Callable[[], Any]]:
    """Make the calls on ``stream`` and run each once (compilation, allocator warm-up)."""
    with torch.cuda.stream(stream):
        calls = make_calls()
        for call in calls:
            call()
    torch.cuda.synchronize()
    return calls


def _capture(
    calls: list[Callable[[], Any]], count: int, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, float]:
    """One CUDA graph of ``count`` calls (cycling over ``calls``) and its microseconds per call."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            for k in range(count):
                calls[k % len(calls)]()
        finally:
            graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return graph, start.elapsed_time(end) * 1000 / count


def interleaved_graph_us(
    makers: dict[str, Callable[[], list[Callable[[], Any]]]],
    *,
    rounds: int = 15,
    min_calls: int = 10,
    min_replay_us: float = 200.0,
    flush_l2: bool = False,
) -> dict[str, dict[str, Any]]:
    """GPU microseconds per call of several implementations timed in one interleaved loop.

    Each maker runs on the capture stream and returns one call per input set (as for
    :func:`graph_us`); each implementation becomes one CUDA graph of at least ``min_calls``
    calls (cycling over its sets), lengthened until a replay lasts about ``min_replay_us``. The
    graphs are then replayed round after round, one replay of each per round in an order that
    rotates every round, with no host synchronisation between replays: the GPU never idles, so
    every implementation runs at the same clocks and under the same background, and a
    disturbance lands in one round of every implementation instead of all of one. Per
    implementation: the median over the rounds (``us``), and the spread (``min``/``max``).
    An implementation that cannot be captured is reported with ``error`` and no time.

    ``flush_l2``: before every replay (outside its timing events) a kernel reads a buffer of
    three times the L2 size, so that every replay starts from the same L2 state. Without it a
    replay starts with what the one before it left in L2, and the rotation keeps each
    implementation's predecessor fixed: when the implementations read the same input sets,
    one that follows a peer loading them without eviction hints finds some of them in L2
    (H200, 256 x 2048-8192 add + RMSNorm: the same kernel 2.5-4.5 % faster after Liger's
    replay than after another's, session 15).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, int]] = {}
    results: dict[str, dict[str, Any]] = {}
    keep: list[Any] = []
    for name, make in makers.items():
        try:
            calls = _run_once(make, stream)
            # Calls per replay: a first graph measures one call, a second one is long enough.
            count = max(len(calls), min_calls)
            graph, per_call = _capture(calls, count, stream)
            wanted = math.ceil(min_replay_us / max(per_call, 1e-3))
            if wanted > count:
                count = -(-wanted // len(calls)) * len(calls)
                del graph
                graph, _ = _capture(calls, count, stream)
            graphs[name] = (graph, count)
            keep.append(calls)
        except Exception as exc:  # a peer whose call cannot be captured in a CUDA graph
            torch.cuda.synchronize()
            results[name] = {"us": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    names = list(graphs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    flush = None
    if flush_l2:
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 2**26
        flush = torch.ones(3 * l2_bytes // 4, dtype=torch.float32, device="cuda")
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)] if names else []
        events = []
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                if flush is not None:
                    # A read of the whole buffer: L2 holds only its (clean) lines afterwards.
                    flush.sum()
                start.record()
                graphs[name][0].replay()
                end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            samples[name].append(start.elapsed_time(end) * 1000 / graphs[name][1])
    for name in names:
        times = sorted(samples[name])
        results[name] = {
            "us": times[len(times) // 2],
            "min": times[0],
            "max": times[-1],
            "calls_per_replay": graphs[name][1],
        }
    del graphs, keep
    return results


def copy_bandwidth_tbs(num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting the bytes read and written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e12


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated by ``fn`` beyond what was allocated before it (results included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    del out
    return int(extra)


def allow_many_recompiles() -> None:
    """Let torch.compile specialise on every benchmarked shape instead of falling back to eager."""
    import torch._dynamo

    for name in (
        "cache_size_limit",
        "recompile_limit",
        "accumulated_cache_size_limit",
        "accumulated_recompile_limit",
    ):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)


def load_liger() -> tuple[Any, str | None]:
    """Import Liger-Kernel's ops if installed; return (module, None) or (None, reason)."""
    try:
        import liger_kernel.ops as liger_ops
    except Exception as exc:
        return None, f"liger-kernel not importable: {exc!r}"
    return liger_ops, None


def write_results(out: Path, name: str, payload: dict[str, Any], table: str) -> None:
    """Write ``<name>.json`` and ``<name>.md`` into the directory ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table, flush=True)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """Render a Markdown table (floats with 3 significant decimals)."""

    def cell(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def quick() -> bool:
    """Whether ``MCORE_BENCH_QUICK=1`` asks for the reduced shape set."""
    return os.environ.get("MCORE_BENCH_QUICK", "0") == "1"
