"""Data-parallel training step of a ~1B-parameter transformer on 2-8 GPUs: mcore DDP and
DistributedOptimizer (overlap off/on) against ``torch.nn.parallel.DistributedDataParallel``.

Every variant trains the same model (20 ``nn.TransformerEncoderLayer`` of width 2048, FFN 8192,
16 heads: 1.01B parameters) in fp32 with bf16 autocast, micro-batch 4 x 1024 tokens per GPU,
AdamW. Peers, in the same run on the same GPUs:

- ``torch_ddp``: torch DDP (25 MB buckets, overlap built in) + ``torch.optim.AdamW(fused=True)``.
- ``mcore_ddp``: mcore DDP, all-reduce after backward, fp32 main params, unsharded AdamW.
- ``mcore_ddp_overlap``: the same, buckets reduced during backward.
- ``mcore_dist_opt``: ZeRO-1 (reduce-scatter, sharded AdamW, all-gather), no overlap.
- ``mcore_dist_opt_overlap``: ZeRO-1 with overlapped reduce-scatter and parameter all-gather.

Reported: median step time (slowest rank), tokens/s over all GPUs, peak allocated memory.

Run from the repository root (2 GPUs; ``--gpus 4`` for four):

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-parallel/benchmarks/bench_ddp.py --out $OUT/ddp.json

``--cpu-smoke`` runs the same code on 2 gloo CPU ranks with tiny shapes (a check of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _timing import median_ms, write_result
from torch import nn

from mcore_parallel.distributed import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from mcore_parallel.testing import run_distributed


@dataclass(frozen=True)
class Shapes:
    """Sizes and repetitions of one benchmark run."""

    hidden: int = 2048
    ffn: int = 8192
    heads: int = 16
    layers: int = 20
    batch: int = 4
    seq: int = 1024
    warmup: int = 3
    iters: int = 10


SMOKE = Shapes(hidden=32, ffn=64, heads=4, layers=2, batch=2, seq=8, warmup=1, iters=2)

VARIANTS: dict[str, dict[str, bool] | None] = {
    "torch_ddp": None,
    "mcore_ddp": {},
    "mcore_ddp_overlap": {"overlap_grad_reduce": True},
    "mcore_dist_opt": {"use_distributed_optimizer": True},
    "mcore_dist_opt_overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
}


def _model(shapes: Shapes, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    # Initialising on the device avoids minutes of CPU initialisation of 1B parameters.
    with device:
        layers = [
            nn.TransformerEncoderLayer(
                shapes.hidden, shapes.heads, shapes.ffn, dropout=0.0, batch_first=True
            )
            for _ in range(shapes.layers)
        ]
        return nn.Sequential(*layers)


def _variant_step(
    name: str, shapes: Shapes, device: torch.device, x: torch.Tensor
) -> tuple[Callable[[], None], list[Any]]:
    options = VARIANTS[name]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if options is None:
        module = torch.nn.parallel.DistributedDataParallel(
            _model(shapes, device), device_ids=[device.index] if device.type == "cuda" else None
        )
        torch_optimizer = torch.optim.AdamW(
            module.parameters(), lr=1e-4, fused=device.type == "cuda"
        )

        def torch_step() -> None:
            torch_optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = module(x).float().pow(2).mean()
            loss.backward()
            torch_optimizer.step()

        return torch_step, [module, torch_optimizer]
    model = DistributedDataParallel(_model(shapes, device), DDPConfig(**options))
    optimizer = DistributedOptimizer(model, OptimizerConfig(lr=1e-4))

    def mcore_step() -> None:
        optimizer.zero_grad()
        with autocast:
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()

    return mcore_step, [model, optimizer]


def _worker(shapes: Shapes) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available() and dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(shapes.batch, shapes.seq, shapes.hidden, generator=generator).to(device)
    rows = []
    for name in VARIANTS:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step, keep = _variant_step(name, shapes, device, x)
        params = sum(p.numel() for p in _parameters(keep[0]))
        ms = median_ms(step, shapes.warmup, shapes.iters, device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows.append(
            {
                "variant": name,
                "step_ms": ms,
                "tokens_per_s": dist.get_world_size() * shapes.batch * shapes.seq / (ms / 1e3),
                "peak_allocated_gib": peak / 2**30,
                "parameters": params,
            }
        )
        del step, keep
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]["step_ms"]
    for row in rows:
        row["speedup_vs_torch_ddp"] = base / row["step_ms"]
    return rows


def _parameters(module: nn.Module) -> list[torch.Tensor]:
    inner = module.module if hasattr(module, "module") else module
    return list(inner.parameters())


def _markdown(result: dict[str, Any]) -> str:
    shapes = result["shapes"]
    params = result["rows"][0]["parameters"] / 1e9
    lines = [
        f"Data-parallel training step, {params:.2f}B-parameter transformer "
        f"({shapes['layers']} x width {shapes['hidden']}), fp32 + bf16 autocast, "
        f"{shapes['batch']} x {shapes['seq']} tokens per GPU, AdamW, "
        f"{result['device']} x {result['gpus']} (median ms, slowest rank)",
        "",
        "| variant | step ms | tokens/s | vs torch DDP | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['variant']} | {row['step_ms']:.1f} | {row['tokens_per_s']:.0f} | "
            f"{row['speedup_vs_torch_ddp']:.2f}x | {row['peak_allocated_gib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Runs the benchmark on ``--gpus`` GPUs and writes the JSON and a Markdown table next to it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="path of the JSON result")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on 2 gloo CPU ranks (no timing value)"
    )
    parser.add_argument("--gpus", type=int, default=2, help="data-parallel GPUs (2 to 8)")
    args = parser.parse_args()
    shapes = SMOKE if args.cpu_smoke else Shapes()
    backend = "gloo" if args.cpu_smoke else "nccl"
    gpus = 2 if args.cpu_smoke else args.gpus
    rows = run_distributed(_worker, gpus, shapes, backend=backend, timeout=600)[0]
    result = {
        "benchmark": "ddp",
        "device": "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(0),
        "gpus": gpus,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": {**asdict(shapes), "dtype": "float32 + bf16 autocast"},
        "rows": rows,
    }
    write_result(args.out, result, _markdown(result))


if __name__ == "__main__":
    main()
