"""Benchmark residual add + RMSNorm (forward and backward, bf16) against its peers on one GPU.

Peers measured in the same run: torch eager (``x + residual`` then ``F.rms_norm``),
``torch.compile`` of the same function, and Liger-Kernel's ``LigerFusedAddRMSNormFunction``
when installed. Effective bandwidth counts the bytes that must move (forward: read ``x``,
``residual``, write ``x + residual`` and ``y``; backward: read ``dy``, ``d(x + residual)``,
``x + residual``, write ``dx``) and is compared with a device-to-device copy measured in the same
run.

Usage: ``python3 packages/mcore-kernels/benchmarks/bench_rms_norm.py --out DIR``
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    allow_many_recompiles,
    bench_ms,
    copy_bandwidth_tbs,
    device_info,
    load_liger,
    markdown_table,
    quick,
    write_results,
)

from mcore_kernels import rms_norm

EPS = 1e-6


def eager_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    hidden = x + residual
    return F.rms_norm(hidden, (hidden.shape[-1],), weight, EPS), hidden


def shapes() -> list[tuple[int, int]]:
    """The whole table: rows {1, 256, 4096, 8192, 16384} x hidden {2048, 4096, 8192}.

    It holds the training shapes of the 1B (8192 x 2048) and 8B (16384 x 4096) models.
    """
    if quick():
        return [(1, 2048), (4096, 2048), (8192, 8192)]
    return [(rows, hidden) for hidden in (2048, 4096, 8192) for rows in (1, 256, 4096, 8192, 16384)]


def host_us(fn: Callable[[], Any], calls: int = 300) -> float:
    """Host microseconds per call of back-to-back calls (the GPU keeps up at one row)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def profiler_cpu_us(fn: Callable[[], Any], calls: int = 100) -> float:
    """CPU microseconds per call as ``torch.profiler`` records it (its own overhead included)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            with record_function("benchmarked_call"):
                fn()
    torch.cuda.synchronize()
    (event,) = [e for e in prof.key_averages() if e.key == "benchmarked_call"]
    return event.cpu_time_total / event.count


def measure(rows: int, hidden: int, compiled, liger_ops) -> dict[str, Any]:
    dtype = torch.bfloat16
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    residual = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()
    dy = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    dh = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    impls = {
        "mcore": lambda: rms_norm(x, weight, EPS, residual=residual),
        "eager": lambda: eager_add_rms_norm(x, residual, weight),
        "compile": lambda: compiled(x, residual, weight),
    }
    if liger_ops is not None:
        impls["liger"] = lambda: liger_ops.LigerFusedAddRMSNormFunction.apply(
            x, residual, weight, EPS, 0.0, "llama", False
        )
    result: dict[str, Any] = {
        "rows": rows,
        "hidden": hidden,
        "dtype": "bfloat16",
        "fwd_ms": {},
        "bwd_ms": {},
    }
    for name, fn in impls.items():
        with torch.no_grad():
            result["fwd_ms"][name] = bench_ms(fn)
        outputs = fn()
        inputs = (x, residual, weight)

        def backward(outputs=outputs, inputs=inputs):
            return torch.autograd.grad(outputs, inputs, (dy, dh), retain_graph=True)

        result["bwd_ms"][name] = bench_ms(backward)
        del outputs
    if rows <= 256:
        result["fwd_graph_ms"] = {}
        for name, fn in impls.items():
            with torch.no_grad():
                result["fwd_graph_ms"][name] = bench_ms(fn, graph=True)
    if rows == 1:
        # Call overhead outside graphs: host time of the forward without and with autograd
        # and of the backward, by wall clock and by the profiler's CPU time.
        result["host_us"] = {}
        result["profiler_cpu_us"] = {}
        for name, fn in impls.items():
            outputs = fn()

            def backward(outputs=outputs, inputs=(x, residual, weight)):
                return torch.autograd.grad(outputs, inputs, (dy, dh), retain_graph=True)

            with torch.no_grad():
                fwd_host = host_us(fn)
                fwd_prof = profiler_cpu_us(fn)
            result["host_us"][name] = {
                "fwd_no_grad": fwd_host,
                "fwd_autograd": host_us(fn),
                "bwd": host_us(backward),
            }
            result["profiler_cpu_us"][name] = {
                "fwd_no_grad": fwd_prof,
                "fwd_autograd": profiler_cpu_us(fn),
                "bwd": profiler_cpu_us(backward),
            }
            del outputs
    elem = rows * hidden * 2
    result["tensor_mb"] = elem / 1e6
    result["fwd_bytes"] = 4 * elem + 2 * hidden
    result["bwd_bytes"] = 4 * elem + 2 * 2 * hidden
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for rms_norm.json and rms_norm.md"
    )
    args = parser.parse_args()
    allow_many_recompiles()
    liger_ops, liger_missing = load_liger()
    compiled = torch.compile(eager_add_rms_norm, dynamic=False)
    copy_tbs = copy_bandwidth_tbs()
    results = []
    for rows, hidden in shapes():
        entry = measure(rows, hidden, compiled, liger_ops)
        mcore_fwd, mcore_bwd = entry["fwd_ms"]["mcore"], entry["bwd_ms"]["mcore"]
        entry["fwd_tbs"] = entry["fwd_bytes"] / (mcore_fwd * 1e-3) / 1e12
        entry["bwd_tbs"] = entry["bwd_bytes"] / (mcore_bwd * 1e-3) / 1e12
        entry["fwd_fraction_of_copy"] = entry["fwd_tbs"] / copy_tbs
        entry["bwd_fraction_of_copy"] = entry["bwd_tbs"] / copy_tbs
        entry["speedup_fwd"] = {
            k: v / mcore_fwd for k, v in entry["fwd_ms"].items() if k != "mcore"
        }
        entry["speedup_bwd"] = {
            k: v / mcore_bwd for k, v in entry["bwd_ms"].items() if k != "mcore"
        }
        results.append(entry)
        print(entry, flush=True)
    launchers = importlib.import_module("mcore_kernels.rms_norm")
    payload = {
        **device_info(),
        "benchmark": "residual add + RMSNorm, bf16",
        # Whether the launches went through the cached compiled kernels (see CachedLauncher).
        "cached_launch": launchers._FORWARD._fast and launchers._BACKWARD._fast,
        "copy_tbs": copy_tbs,
        "liger": liger_missing or "liger-kernel " + _liger_version(),
        "results": results,
    }
    peers = ["eager", "compile"] + (["liger"] if liger_ops is not None else [])
    header = ["rows x hidden", "fwd ms", "fwd % copy"]
    header += (
        [f"fwd vs {p}" for p in peers] + ["bwd ms", "bwd % copy"] + [f"bwd vs {p}" for p in peers]
    )
    rows = []
    for e in results:
        row = [f"{e['rows']}x{e['hidden']}", e["fwd_ms"]["mcore"], 100 * e["fwd_fraction_of_copy"]]
        row += [e["speedup_fwd"][p] for p in peers]
        row += [e["bwd_ms"]["mcore"], 100 * e["bwd_fraction_of_copy"]]
        row += [e["speedup_bwd"][p] for p in peers]
        rows.append(row)
    table = (
        f"Residual add + RMSNorm, bf16, on {payload['device']} (torch {payload['torch']}, triton "
        f"{payload['triton']}, {payload['liger']}); device-to-device copy {copy_tbs:.2f} TB/s. "
        "Ratios are peer time / mcore time (> 1: mcore faster).\n\n" + markdown_table(header, rows)
    )
    graph_rows = [
        [f"{e['rows']}x{e['hidden']}"] + [e["fwd_graph_ms"].get(k) for k in ["mcore", *peers]]
        for e in results
        if "fwd_graph_ms" in e
    ]
    if graph_rows:
        table += "\nForward under CUDA graph replay (launch-bound shapes), ms:\n\n"
        table += markdown_table(["rows x hidden", "mcore", *peers], graph_rows)
    host_rows = []
    for e in results:
        if "host_us" not in e:
            continue
        for phase in ("fwd_no_grad", "fwd_autograd", "bwd"):
            host_rows.append(
                [f"1x{e['hidden']}", phase]
                + [e["host_us"][k][phase] for k in ["mcore", *peers]]
                + [e["profiler_cpu_us"][k][phase] for k in ["mcore", *peers]]
            )
    if host_rows:
        table += (
            "\nCall overhead outside graphs (one row), microseconds of host time per call: wall "
            "clock of back-to-back calls, then the profiler's CPU time (which adds its own "
            "per-op cost):\n\n"
        )
        table += markdown_table(
            ["shape", "phase"]
            + [f"{k} host us" for k in ["mcore", *peers]]
            + [f"{k} profiler us" for k in ["mcore", *peers]],
            host_rows,
        )
    write_results(args.out, "rms_norm", payload, table)


def _liger_version() -> str:
    from importlib.metadata import version

    return version("liger-kernel")


if __name__ == "__main__":
    main()
