"""Context-parallel attention against gathering the full sequence, forward + backward.

Every rank of a cp group holds ``T / cp`` load-balanced tokens of a causal GQA attention
(``[B, Hq, T, D]`` queries, ``Hkv`` key/value heads). Variants, in the same run:

- ``gather_full``: the peer: all-gather q, k and v into the full sequence
  (``gather_sequence``), run ``scaled_dot_product_attention(is_causal=True)`` over all of it
  on every rank and keep the local rows (what a model does without CP attention).
- ``ring``: ``ring_attention``: keys/values passed round the ring with overlapped P2P.
- ``all_gather``: ``all_gather_attention``: keys/values all-gathered, one masked SDPA call.

Reported per sequence length: median ms of forward + backward on the slowest rank, the ratio
against ``gather_full``, and the peak allocated memory on GPUs.

CPU (gloo, ranks spawned here):

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-parallel/benchmarks/bench_context_parallel.py --cp 2 \
        --out packages/mcore-parallel/benchmarks/results/cpu/context_parallel.json

GPUs (NCCL, one process per GPU):

    torchrun --nproc-per-node 2 packages/mcore-parallel/benchmarks/bench_context_parallel.py \
        --out $OUT/context_parallel.json
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import median_ms, write_result

from mcore_parallel import initialize
from mcore_parallel.context_parallel import (
    all_gather_attention,
    gather_sequence,
    ring_attention,
    split_sequence,
)
from mcore_parallel.testing import run_distributed

VARIANTS = ("gather_full", "ring", "all_gather")


def _gather_full(q, k, v, group):  # type: ignore[no-untyped-def]
    full = [gather_sequence(t, group, dim=2) for t in (q, k, v)]
    repeat = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(repeat, dim=1) for t in full[1:])
    out = F.scaled_dot_product_attention(full[0], keys, values, is_causal=True)
    return split_sequence(out, dist.get_world_size(group), dist.get_rank(group), dim=2)


def _worker(config: dict[str, Any]) -> list[dict[str, Any]]:
    state = initialize(cp=dist.get_world_size())
    group, rank, cp = state.group("cp"), state.rank_in("cp"), state.size("cp")
    device = state.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    functions = {
        "gather_full": lambda q, k, v: _gather_full(q, k, v, group),
        "ring": lambda q, k, v: ring_attention(q, k, v, group),
        "all_gather": lambda q, k, v: all_gather_attention(q, k, v, group),
    }
    rows = []
    for seq in config["seqs"]:
        generator = torch.Generator().manual_seed(0)
        shape = (config["batch"], config["heads"], seq, config["head_dim"])
        kv_shape = (config["batch"], config["kv_heads"], seq, config["head_dim"])
        full = [torch.randn(s, generator=generator) for s in (shape, kv_shape, kv_shape)]
        local = [
            split_sequence(t, cp, rank, dim=2).to(device, dtype).requires_grad_() for t in full
        ]
        grad = torch.randn(local[0].shape, generator=generator).to(device, dtype)
        for name in VARIANTS:
            function = functions[name]

            def step(
                function: Callable[..., torch.Tensor] = function,
                inputs: list[torch.Tensor] = local,
                grad: torch.Tensor = grad,
            ) -> None:
                for tensor in inputs:
                    tensor.grad = None
                (function(*inputs) * grad).sum().backward()

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = median_ms(step, config["warmup"], config["iters"], device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            rows.append({"seq": seq, "variant": name, "fwd_bwd_ms": ms, "peak_gib": peak})
    for row in rows:
        base = next(r for r in rows if r["seq"] == row["seq"] and r["variant"] == "gather_full")
        row["speedup_vs_gather_full"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def _markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"Causal GQA attention forward + backward, cp={result['cp']}, batch {c['batch']}, "
        f"{c['heads']} query / {c['kv_heads']} key-value heads of {c['head_dim']}, "
        f"{result['dtype']}, {result['device']} (median ms, slowest rank)",
        "",
        "| seq | variant | fwd+bwd ms | vs gather_full | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['seq']} | {row['variant']} | {row['fwd_bwd_ms']:.1f} | "
            f"{row['speedup_vs_gather_full']:.2f}x | {row['peak_gib']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Runs the benchmark (spawned gloo ranks, or under torchrun) and writes JSON + Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="path of the JSON result")
    parser.add_argument(
        "--cp", type=int, default=2, help="CPU ranks to spawn (ignored by torchrun)"
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="full sequence lengths")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes (no timing value)")
    args = parser.parse_args()
    under_torchrun = "RANK" in os.environ
    if under_torchrun:
        config = {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128, "warmup": 3, "iters": 10}
        config["seqs"] = args.seqs or [8192, 16384, 32768]
        rows = _worker(config)
        cp, device = dist.get_world_size(), torch.cuda.get_device_name(0)
        is_writer = dist.get_rank() == 0
    else:
        config = {"batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 64, "warmup": 1, "iters": 5}
        config["seqs"] = args.seqs or [512, 1024, 2048]
        if args.cpu_smoke:
            config.update(seqs=[64], iters=1, warmup=0)
        rows = run_distributed(_worker, args.cp, config, timeout=1200)[0]
        cp, device, is_writer = args.cp, f"cpu ({platform.processor() or 'x86_64'}, gloo)", True
    if not is_writer:
        return
    result = {
        "benchmark": "context_parallel",
        "device": device,
        "cp": cp,
        "dtype": "bfloat16" if under_torchrun else "float32",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "config": config,
        "rows": rows,
    }
    write_result(args.out, result, _markdown(result))


if __name__ == "__main__":
    main()
