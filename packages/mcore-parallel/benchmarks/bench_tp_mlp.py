"""Tensor-parallel MLP on 2 GPUs: mcore-parallel layers against PyTorch's DTensor tensor parallel.

A two-layer MLP (column-parallel up projection, SiLU, row-parallel down projection) in bf16,
forward + backward, at several token counts. Peers, in the same run on the same GPUs:
``torch.distributed.tensor.parallel`` (ColwiseParallel/RowwiseParallel, and the sequence-
parallel layouts for the SP rows) and the unsharded MLP on one GPU. The outputs of the mcore
and torch variants are compared and the largest difference is recorded.

Run from the repository root (2 GPUs):

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-parallel/benchmarks/bench_tp_mlp.py --out $OUT/tp_mlp.json

``--cpu-smoke`` runs the same code on 2 gloo CPU ranks with tiny shapes (a check of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _timing import median_ms, write_result
from torch import nn

from mcore_parallel.state import initialize
from mcore_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mcore_parallel.testing import run_distributed


@dataclass(frozen=True)
class Shapes:
    """Sizes and repetitions of one benchmark run."""

    hidden: int = 4096
    ffn: int = 14336
    tokens: tuple[int, ...] = (512, 2048, 8192)
    warmup: int = 5
    iters: int = 30


SMOKE = Shapes(hidden=64, ffn=128, tokens=(16,), warmup=1, iters=2)


def _mcore_mlp(state, shapes: Shapes, sequence_parallel: bool) -> nn.Module:
    # state None builds the unsharded MLP (device set by the caller).
    device = state.device if state is not None else None
    common = {"state": state, "bias": False, "dtype": torch.bfloat16, "device": device}
    return nn.Sequential(
        ColumnParallelLinear(
            shapes.hidden,
            shapes.ffn,
            gather_output=False,
            sequence_parallel=sequence_parallel,
            seed=1,
            **common,
        ),
        nn.SiLU(),
        RowParallelLinear(
            shapes.ffn,
            shapes.hidden,
            input_is_parallel=True,
            sequence_parallel=sequence_parallel,
            seed=2,
            **common,
        ),
    )


def _torch_mlp(state, shapes: Shapes, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(state.device.type, (state.tp_size,))
    mlp = nn.Sequential(
        nn.Linear(shapes.hidden, shapes.ffn, bias=False),
        nn.SiLU(),
        nn.Linear(shapes.ffn, shapes.hidden, bias=False),
    )
    torch.manual_seed(1)
    nn.init.normal_(mlp[0].weight, std=0.02)
    torch.manual_seed(2)
    nn.init.normal_(mlp[2].weight, std=0.02)
    mlp = mlp.to(device=state.device, dtype=torch.bfloat16)
    if sequence_parallel:
        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        }
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(mlp, mesh, plan)


def _step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        x.grad = None
        y = model(x)
        y.backward(dy)
        return y

    return run


def _worker(shapes: Shapes) -> list[dict[str, Any]]:
    state = initialize(tp=2)
    device = state.device

    def timed(step: Callable[[], Any]) -> float:
        return median_ms(step, shapes.warmup, shapes.iters, device)

    rows = []
    for tokens in shapes.tokens:
        generator = torch.Generator(device="cpu").manual_seed(tokens)
        full_x = torch.randn(tokens, shapes.hidden, generator=generator).to(device, torch.bfloat16)
        full_dy = torch.randn(tokens, shapes.hidden, generator=generator).to(device, torch.bfloat16)
        shard = slice(state.tp_rank * tokens // 2, (state.tp_rank + 1) * tokens // 2)
        row: dict[str, Any] = {"tokens": tokens}
        for sequence_parallel in (False, True):
            x = (full_x[shard] if sequence_parallel else full_x).clone().requires_grad_()
            dy = full_dy[shard] if sequence_parallel else full_dy
            suffix = "_sp" if sequence_parallel else ""
            mcore = _mcore_mlp(state, shapes, sequence_parallel)
            peer = _torch_mlp(state, shapes, sequence_parallel)
            y_mcore, y_torch = _step(mcore, x, dy)(), _step(peer, x, dy)()
            if hasattr(y_torch, "to_local"):
                y_torch = y_torch.to_local()
            row[f"max_abs_diff{suffix}"] = float((y_mcore - y_torch).detach().abs().max())
            row[f"mcore{suffix}_ms"] = timed(_step(mcore, x, dy))
            row[f"torch_tp{suffix}_ms"] = timed(_step(peer, x, dy))
            del mcore, peer
        unsharded = _mcore_mlp(None, shapes, False).to(device)
        x = full_x.clone().requires_grad_()
        row["one_gpu_ms"] = timed(_step(unsharded, x, full_dy))
        row["speedup_vs_torch_tp"] = row["torch_tp_ms"] / row["mcore_ms"]
        row["speedup_vs_torch_sp"] = row["torch_tp_sp_ms"] / row["mcore_sp_ms"]
        row["speedup_vs_one_gpu"] = row["one_gpu_ms"] / row["mcore_ms"]
        rows.append(row)
    return rows


def _markdown(result: dict[str, Any]) -> str:
    shapes = result["shapes"]
    lines = [
        f"TP=2 MLP {shapes['hidden']}->{shapes['ffn']}->{shapes['hidden']}, bf16, "
        "forward + backward, "
        f"{result['device']} x {result['gpus']} (median ms, slowest rank)",
        "",
        "| tokens | mcore TP | torch TP | ratio | mcore TP+SP | torch TP+SP | ratio | 1 GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['tokens']} | {row['mcore_ms']:.3f} | {row['torch_tp_ms']:.3f} | "
            f"{row['speedup_vs_torch_tp']:.2f}x | {row['mcore_sp_ms']:.3f} | "
            f"{row['torch_tp_sp_ms']:.3f} | {row['speedup_vs_torch_sp']:.2f}x | "
            f"{row['one_gpu_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Runs the benchmark on 2 GPUs and writes the JSON and a Markdown table next to it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="path of the JSON result")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on 2 gloo CPU ranks (no timing value)"
    )
    args = parser.parse_args()
    shapes = SMOKE if args.cpu_smoke else Shapes()
    backend = "gloo" if args.cpu_smoke else "nccl"
    rows = run_distributed(_worker, 2, shapes, backend=backend, timeout=600)[0]
    result = {
        "benchmark": "tp_mlp",
        "device": "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(0),
        "gpus": 2,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": {**asdict(shapes), "dtype": "bfloat16"},
        "rows": rows,
    }
    write_result(args.out, result, _markdown(result))


if __name__ == "__main__":
    main()
