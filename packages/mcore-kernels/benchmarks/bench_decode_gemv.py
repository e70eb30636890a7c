"""Decode projections (1..64 rows): ``decode_gemv`` against cuBLAS (``F.linear``), in GB/s.

Shapes: every projection of the Qwen2.5-0.5B and Llama-3.2-1B shapes (fused q/k/v, o, fused
gate/up, down, the tied LM head). A projection of a few rows reads its weight once, so its
speed is the weight's bytes over the time, compared with the device-to-device copy bandwidth
measured in the same run (``copy``: bytes read + written per second).

Timing: each case is captured in a CUDA graph (launch overhead excluded, as in the engine's
decode graphs) that cycles through enough copies of the weight (>= 2x the L2 cache) for every
launch to read it from HBM; the time per launch is the graph's replay time over the launches.

Modes:

- default: the chosen configuration (:func:`mcore_kernels.decode_gemv.gemv_config`) and cuBLAS
  at M = 1..64, plus the fused variants the engine runs (norm prologue, bias, SwiGLU,
  residual epilogues) against the unfused torch sequence they replace;
- ``--sweep``: every configuration of a grid (tile sizes, warps, vector vs tensor-core,
  split-K with the in-kernel ticket reduction or a second pass) per shape and row count.

Kernels compile in parallel worker processes first (``--compile-workers``), so the timed loop
finds them in Triton's cache. Run from the repository root on one GPU::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-kernels/benchmarks/bench_decode_gemv.py --out $OUT/kernels
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import copy_bandwidth_tbs, device_info, markdown_table, write_results

from mcore_kernels.decode_gemv import GemvConfig, decode_gemv_triton, gemv_config

SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "qwen2.5-0.5b": {
        "qkv": (1152, 896),
        "o": (896, 896),
        "gate_up": (9728, 896),
        "down": (896, 4864),
        "lm_head": (151936, 896),
    },
    "llama-3.2-1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (128256, 2048),
    },
}
"""``(N, K)`` of each projection's weight per model shape."""

ROWS = (1, 2, 4, 8, 16, 32, 64)
L2_MULTIPLE = 2
"""The weight copies a graph cycles through cover this many L2 caches."""

VECTOR_TILES = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 256, 4), (16, 512, 4),
                (16, 1024, 8), (32, 256, 4), (32, 512, 8))  # fmt: skip
"""``(block_n, block_k, num_warps)`` of the vector (no ``tl.dot``) sweep, used up to 4 rows."""
DOT_TILES = ((16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 4))
"""``(block_n, block_k, num_warps)`` of the tensor-core sweep."""
WAVES = (0, 2, 4)
"""Split-K targets: no split, or about this many programs per multiprocessor."""
REFINE_TILES = ((4, 1024, 4, None), (4, 1024, 2, None), (4, 1024, 4, 1), (4, 1024, 4, 4),
                (4, 2048, 4, None), (4, 2048, 8, None), (8, 2048, 8, None), (2, 2048, 4, None),
                (8, 1024, 4, 4))  # fmt: skip
"""``(block_n, block_k, num_warps, num_stages)`` of the ``--refine`` sweep (vector path)."""
REFINE_ROWS = (1, 2)


def _split_for(config: GemvConfig, rows: int, n: int, k: int, waves: int, sms: int) -> int:
    if waves == 0:
        return 1
    block_m = min(64, max(16, 1 << (rows - 1).bit_length())) if config.use_dot else min(4, rows)
    tiles = math.ceil(n / config.block_n) * math.ceil(rows / block_m)
    return max(1, min(max(1, k // config.block_k), waves * sms // tiles))


def sweep_configs(rows: int, refine: bool = False) -> list[tuple[GemvConfig, int]]:
    """``(config without split, waves)`` pairs swept at ``rows`` (``refine``: the fine grid)."""
    cases: list[tuple[GemvConfig, int]] = []
    if refine:
        for bn, bk, warps, stages in REFINE_TILES:
            config = GemvConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            cases.append((config, 0))
        cases.append((GemvConfig(block_n=4, block_k=1024, num_warps=4), 2))
        return cases
    if rows <= 4:
        for (bn, bk, warps), waves in itertools.product(VECTOR_TILES, WAVES):
            cases.append((GemvConfig(block_n=bn, block_k=bk, num_warps=warps), waves))
    dot_waves = WAVES if rows > 4 else (0, 2)
    for (bn, bk, warps), waves in itertools.product(DOT_TILES, dot_waves):
        cases.append((GemvConfig(block_n=bn, block_k=bk, num_warps=warps, use_dot=True), waves))
    return cases


def _compile_job(job: tuple[int, dict[str, Any], dict[str, bool]]) -> str:
    """Launch one configuration on a small problem so Triton compiles and caches it."""
    rows, config_fields, flags = job
    config = GemvConfig(**config_fields)
    k, n = 8192, 256
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16)
    out_n = n if flags["swiglu"] else 2 * n
    decode_gemv_triton(
        x,
        weight,
        torch.randn(2 * n, device="cuda", dtype=torch.bfloat16) if flags["bias"] else None,
        norm_weight=torch.randn(k, device="cuda", dtype=torch.bfloat16) if flags["norm"] else None,
        swiglu=flags["swiglu"],
        residual=torch.randn(rows, out_n, device="cuda", dtype=torch.bfloat16)
        if flags["residual"]
        else None,
        config=config,
    )
    torch.cuda.synchronize()
    return "ok"


def precompile(jobs: list[tuple[int, dict[str, Any], dict[str, bool]]], workers: int) -> None:
    """Compile every distinct kernel variant in ``workers`` spawned processes."""
    start = time.perf_counter()
    if workers <= 1:
        for job in jobs:
            _compile_job(job)
    else:
        context = multiprocessing.get_context("spawn")
        try:
            with context.Pool(workers) as pool:
                pool.map(_compile_job, jobs, chunksize=1)
        except Exception as error:  # the timed loop then compiles what is missing
            print(f"parallel compilation failed: {error!r}", flush=True)
    print(f"compiled {len(jobs)} variants in {time.perf_counter() - start:.1f} s", flush=True)


_PLAIN = {"bias": False, "norm": False, "swiglu": False, "residual": False}


def _variant_key(rows: int, config: GemvConfig) -> tuple:
    block_m = min(64, max(16, 1 << (rows - 1).bit_length())) if config.use_dot else min(4, rows)
    return (block_m, config.block_n, config.block_k, config.num_warps, config.use_dot,
            config.split_k > 1, config.reduce, config.num_stages)  # fmt: skip


def graph_us(launches: list[Callable[[], Any]], replays: int = 5) -> float:
    """Microseconds per launch of a CUDA graph replaying ``launches`` (warmed up eagerly)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(launches))


class Problem:
    """Weight copies (enough to defeat the L2 cache) and inputs of one shape."""

    def __init__(self, n: int, k: int, l2_bytes: int) -> None:
        self.n, self.k = n, k
        self.bytes = n * k * 2
        copies = max(1, min(48, math.ceil(L2_MULTIPLE * l2_bytes / self.bytes)))
        self.weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        self.inputs = {rows: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                       for rows in ROWS}  # fmt: skip

    def time_gemv(self, rows: int, config: GemvConfig | None) -> float:
        """Microseconds of one ``decode_gemv_triton`` launch (``config=None``: the default)."""
        x = self.inputs[rows]
        return graph_us([lambda w=w: decode_gemv_triton(x, w, config=config) for w in self.weights])

    def time_cublas(self, rows: int) -> float:
        """Microseconds of one ``F.linear`` (cuBLAS) call."""
        x = self.inputs[rows]
        return graph_us([lambda w=w: F.linear(x, w) for w in self.weights])

    def time_copy(self) -> float:
        """Microseconds of one copy of the weight into a buffer of its size (read + write)."""
        target = torch.empty_like(self.weights[0])
        return graph_us([lambda w=w: target.copy_(w) for w in self.weights])

    def gbs(self, us: float) -> float:
        """Weight bytes per microsecond as GB/s."""
        return self.bytes / us / 1e3


def run_sweep(args: argparse.Namespace, sms: int, l2_bytes: int, copy_gbs: float) -> dict:
    """Time every configuration of the grid on every shape and row count."""
    rows_list = [r for r in (REFINE_ROWS if args.refine else ROWS) if r <= args.max_rows]
    jobs = {}
    for rows in rows_list:
        for config, waves in sweep_configs(rows, args.refine):
            for split in (1, 2) if waves else (1,):
                chosen = replace(config, split_k=split)
                jobs[_variant_key(rows, chosen)] = (rows, asdict(chosen), _PLAIN)
    problems = {(model, name): Problem(n, k, l2_bytes)
                for model, shapes in SHAPES.items() for name, (n, k) in shapes.items()}  # fmt: skip
    for rows in rows_list:
        for problem in problems.values():
            chosen = gemv_config(rows, problem.n, problem.k, sms)
            jobs[_variant_key(rows, chosen)] = (rows, asdict(chosen), _PLAIN)
            if chosen.split_k > 1:
                chosen = replace(chosen, reduce="second_pass")
                jobs[_variant_key(rows, chosen)] = (rows, asdict(chosen), _PLAIN)
    precompile(list(jobs.values()), args.compile_workers)
    records = []
    summary = []
    for rows in rows_list:
        if time.perf_counter() - args.started > args.budget_s:
            print(f"budget of {args.budget_s} s spent: stopping before M={rows}", flush=True)
            break
        for (model, name), problem in problems.items():
            n, k = problem.n, problem.k
            start = time.perf_counter()
            cublas = problem.time_cublas(rows)
            best: tuple[float, GemvConfig] | None = None
            for config, waves in sweep_configs(rows, args.refine):
                split = _split_for(config, rows, n, k, waves, sms)
                if waves and split == 1:
                    continue
                chosen = replace(config, split_k=split)
                us = problem.time_gemv(rows, chosen)
                records.append({"model": model, "proj": name, "rows": rows,
                                "config": asdict(chosen), "us": us})  # fmt: skip
                if best is None or us < best[0]:
                    best = (us, chosen)
            assert best is not None
            default_config = gemv_config(rows, n, k, sms)
            default = problem.time_gemv(rows, default_config)
            second = None
            if default_config.split_k > 1:
                second = problem.time_gemv(rows, replace(default_config, reduce="second_pass"))
            summary.append({
                "model": model, "proj": name, "rows": rows, "cublas_us": cublas,
                "best_us": best[0], "best": asdict(best[1]), "second_pass_us": second,
                "default_us": default, "default": asdict(default_config),
            })  # fmt: skip
            print(
                f"{model:13s} {name:8s} M={rows:2d} cublas {problem.gbs(cublas):7.0f} GB/s "
                f"best {problem.gbs(best[0]):7.0f} GB/s ({100 * problem.gbs(best[0]) / copy_gbs:4.1f}%"
                f" copy) {_short(best[1])} default {problem.gbs(default):7.0f}"
                f"{'' if second is None else f' 2nd-pass {problem.gbs(second):7.0f}'}"
                f" [{time.perf_counter() - start:.1f}s]",
                flush=True,
            )
    return {"records": records, "summary": summary}


FUSED_ROWS = (1, 2, 4, 16)


def _fused_timings(problem: Problem, rows: int, flags: dict[str, bool]) -> tuple[float, float]:
    """Microseconds of one fused ``decode_gemv`` and of the torch ops it replaces."""
    from mcore_kernels.moe.swiglu import swiglu
    from mcore_kernels.rms_norm import rms_norm

    n, k = problem.n, problem.k
    out_n = n // 2 if flags["swiglu"] else n
    x = problem.inputs[rows]
    norm = torch.ones(k, device="cuda", dtype=torch.bfloat16) if flags["norm"] else None
    bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16) if flags["bias"] else None
    residual = None
    if flags["residual"]:
        residual = torch.randn(rows, out_n, device="cuda", dtype=torch.bfloat16)

    def fused_call(w: torch.Tensor) -> torch.Tensor:
        return decode_gemv_triton(
            x, w, bias, norm_weight=norm, swiglu=flags["swiglu"], residual=residual
        )

    def unfused_call(w: torch.Tensor) -> torch.Tensor:
        y = F.linear(x if norm is None else rms_norm(x, norm), w, bias)
        if flags["swiglu"]:
            y = swiglu(y)
        return y if residual is None else y + residual

    fused_us = graph_us([lambda w=w: fused_call(w) for w in problem.weights])
    unfused_us = graph_us([lambda w=w: unfused_call(w) for w in problem.weights])
    return fused_us, unfused_us


def run_default(args: argparse.Namespace, sms: int, l2_bytes: int, copy_gbs: float) -> dict:
    """The default configuration against cuBLAS, plain and with the engine's fusions."""
    rows_list = [r for r in ROWS if r <= args.max_rows]
    jobs = {}
    fusions = {
        "qkv": {**_PLAIN, "bias": True, "norm": True},
        "o": {**_PLAIN, "residual": True},
        "gate_up": {**_PLAIN, "norm": True, "swiglu": True},
        "down": {**_PLAIN, "residual": True},
    }
    for shapes in SHAPES.values():
        for name, (n, k) in shapes.items():
            for rows in rows_list:
                config = gemv_config(rows, n, k, sms)
                jobs[(_variant_key(rows, config), "plain")] = (rows, asdict(config), _PLAIN)
                if name in fusions and rows in FUSED_ROWS:
                    out_n = n // 2 if fusions[name]["swiglu"] else n
                    config = gemv_config(rows, out_n, k, sms)
                    jobs[(_variant_key(rows, config), name)] = (rows, asdict(config), fusions[name])
    precompile(list(jobs.values()), args.compile_workers)
    plain, fused = [], []
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            problem = Problem(n, k, l2_bytes)
            copy_us = problem.time_copy()
            for rows in rows_list:
                cublas = problem.time_cublas(rows)
                gemv = problem.time_gemv(rows, None)
                plain.append({"model": model, "proj": name, "rows": rows, "cublas_us": cublas,
                              "gemv_us": gemv, "same_size_copy_us": copy_us,
                              "config": asdict(gemv_config(rows, n, k, sms))})  # fmt: skip
                print(
                    f"{model:13s} {name:8s} M={rows:2d} cuBLAS {cublas:7.1f} us "
                    f"{problem.gbs(cublas):5.0f} GB/s | decode_gemv {gemv:7.1f} us "
                    f"{problem.gbs(gemv):5.0f} GB/s ({100 * problem.gbs(gemv) / copy_gbs:3.0f}% copy)"
                    f" | same-size copy {copy_us:6.1f} us",
                    flush=True,
                )
            if name not in fusions:
                del problem
                continue
            for rows in FUSED_ROWS:
                if rows <= args.max_rows:
                    fused_us, unfused_us = _fused_timings(problem, rows, fusions[name])
                    fused.append({"model": model, "proj": name, "rows": rows,
                                  "flags": fusions[name], "fused_us": fused_us,
                                  "unfused_us": unfused_us})  # fmt: skip
                    print(
                        f"{model:13s} {name:8s} M={rows:2d} fused {fused_us:6.1f} us vs "
                        f"unfused torch {unfused_us:6.1f} us",
                        flush=True,
                    )
            del problem
            torch.cuda.empty_cache()
    return {"plain": plain, "fused": fused}


def _short(config: GemvConfig) -> str:
    kind = "dot" if config.use_dot else "vec"
    stages = "" if config.num_stages is None else f" st{config.num_stages}"
    return (
        f"{kind} n{config.block_n} k{config.block_k} w{config.num_warps} s{config.split_k}{stages}"
    )


def main() -> None:
    """Parse the arguments, run the benchmark, write ``decode_gemv.json`` and ``.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the result files")
    parser.add_argument("--sweep", action="store_true", help="sweep the configuration grid")
    parser.add_argument(
        "--refine", action="store_true", help="with --sweep: the fine vector grid at 1-2 rows"
    )
    parser.add_argument("--max-rows", type=int, default=64, help="largest row count")
    parser.add_argument("--compile-workers", type=int, default=8)
    parser.add_argument(
        "--budget-s", type=float, default=1e9, help="stop starting new row counts after this"
    )
    args = parser.parse_args()
    started = args.started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2_bytes = int(getattr(props, "L2_cache_size", 50 * 2**20))
    copy_gbs = copy_bandwidth_tbs() * 1e3
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, {sms} SMs, L2 {l2_bytes >> 20} MiB", flush=True)
    payload: dict[str, Any] = {"device": device_info(), "copy_gbs": copy_gbs}
    if args.sweep:
        payload.update(run_sweep(args, sms, l2_bytes, copy_gbs))
        rows = [
            [s["model"], s["proj"], s["rows"], _gbs(s, "cublas_us"), _gbs(s, "best_us"),
             100 * _gbs(s, "best_us") / copy_gbs, _short(GemvConfig(**s["best"])),
             _gbs(s, "default_us")]
            for s in payload["summary"]
        ]  # fmt: skip
        header = ["model", "proj", "M", "cuBLAS GB/s", "best GB/s", "best % copy", "best config",
                  "default GB/s"]  # fmt: skip
        name = "decode_gemv_refine" if args.refine else "decode_gemv_sweep"
    else:
        payload.update(run_default(args, sms, l2_bytes, copy_gbs))
        rows = [
            [p["model"], p["proj"], p["rows"], p["cublas_us"], _gbs(p, "cublas_us"),
             p["gemv_us"], _gbs(p, "gemv_us"), 100 * _gbs(p, "gemv_us") / copy_gbs,
             100 * p["same_size_copy_us"] / p["gemv_us"], p["cublas_us"] / p["gemv_us"]]
            for p in payload["plain"]
        ]  # fmt: skip
        header = ["model", "proj", "M", "cuBLAS us", "cuBLAS GB/s", "decode_gemv us",
                  "decode_gemv GB/s", "% copy BW", "% same-size copy", "speedup"]  # fmt: skip
        fused_rows = [
            [f["model"], f["proj"], f["rows"],
             "+".join(key for key, on in f["flags"].items() if on), f["unfused_us"],
             f["fused_us"], f["unfused_us"] / f["fused_us"]]
            for f in payload["fused"]
        ]  # fmt: skip
        name = "decode_gemv"
        payload["seconds"] = time.perf_counter() - started
        table = (
            markdown_table(header, rows)
            + "\nFused (one launch) against the torch ops it replaces:\n\n"
        )
        table += markdown_table(
            ["model", "proj", "M", "fused in", "unfused us", "fused us", "speedup"], fused_rows
        )
        table = (
            f"Copy bandwidth {copy_gbs:.0f} GB/s (2 GiB copy); {payload['device']['device']}. "
            "% copy BW: the weight's bytes per second against it; % same-size copy: the time "
            "of a graph-replayed copy of the weight (read + write, the same launch and latency "
            "floor) over the kernel's time.\n\n" + table
        )
        write_results(args.out, name, payload, table)
        return
    payload["seconds"] = time.perf_counter() - started
    write_results(args.out, name, payload, markdown_table(header, rows))


def _gbs(summary: dict, key: str) -> float:
    n, k = SHAPES[summary["model"]][summary["proj"]]
    return n * k * 2 / summary[key] / 1e3


if __name__ == "__main__":
    main()
