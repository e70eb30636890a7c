"""Host (CPU) time against device time of one MoE layer step: is the step launch-bound?

For the Mixtral and Qwen3-30B-A3B cases of ``bench_moe.py`` (dropless, fused kernels) and their
dense peers, each step (forward + backward) is timed twice: with CUDA events (device time per
step over ``iters`` back-to-back steps, as ``bench_moe.py`` does), and on the host clock from
the step's first call to its return without synchronising (the time the CPU needs to enqueue
it). A host time close to the device time means the GPU waits for launches between kernels.
Writes ``moe_host.json`` and ``moe_host.md``.

Run from the repository root on the GPU machine::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-models/benchmarks/bench_moe_host.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_moe import CASES, _dense, _moe  # type: ignore[import-not-found]
from torch import nn


def _measure(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int) -> dict:
    leaf = x.clone().requires_grad_(True)

    def step() -> None:
        module(leaf).backward(grad)
        module.zero_grad(set_to_none=True)
        leaf.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        host.append((time.perf_counter() - begin) * 1e3)
    end.record()
    torch.cuda.synchronize()
    return {"device_ms": start.elapsed_time(end) / iters, "host_ms": sorted(host)[len(host) // 2]}


def _host_profile(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, title: str) -> str:
    """Operators by host (self CPU) time over two steps."""
    from torch.profiler import ProfilerActivity, profile

    leaf = x.clone().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            module(leaf).backward(grad)
            module.zero_grad(set_to_none=True)
            leaf.grad = None
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50
    )
    return f"== {title}\n{table}\n"


def main(argv: list[str] | None = None) -> None:
    """Measure and write the results.

    Args:
        argv: Command-line arguments (default ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--cases", nargs="*", default=["mixtral-8x7b", "qwen3-30b-a3b"], help="case names"
    )
    parser.add_argument(
        "--expert-kernels",
        nargs="*",
        default=["grouped_mm"],
        help="MoEConfig.expert_kernel values to measure (one row each)",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    profiles: list[str] = []
    for name in args.cases:
        case = CASES[name]
        x = torch.randn(case["tokens"], case["hidden"], device=device, dtype=torch.bfloat16)
        grad = torch.randn_like(x)
        builds = [("dense", lambda case=case: _dense(case, device))]
        for kernel in args.expert_kernels:
            builds.append(
                (
                    f"mcore dropless, fused kernels, {kernel} experts",
                    lambda case=case, kernel=kernel: _moe(case, device, expert_kernel=kernel),
                )
            )
        for label, build in builds:
            module = build()
            measured = _measure(module, x, grad, args.iters)
            rows.append({"case": name, "implementation": label, **measured})
            if label != "dense":
                profiles.append(_host_profile(module, x, grad, f"{name}: {label}"))
            del module
            torch.cuda.empty_cache()
    lines = [
        f"Host enqueue time against device time per forward + backward ({torch.cuda.get_device_name()})",
        "",
        "| case | implementation | device ms / step | host ms / step (median) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['implementation']} | {r['device_ms']:.2f} | {r['host_ms']:.2f} |"
        for r in rows
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_host.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "moe_host.md").write_text("\n".join(lines) + "\n")
    (out / "moe_host_profile.txt").write_text("".join(profiles))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
