"""Paged decode attention alone at one attention shape: split size and merge, in % of copy.

Workload: one new token per request (decode) attending to its whole context in a paged cache
of 16-position blocks scattered over a shared pool, bf16, the Qwen2.5-0.5B attention shape by
default (14 query heads, 2 key/value heads, head_dim 64; ``--heads`` changes it), batch 1..64,
contexts 160..32k. Variants: the split sizes ``--splits`` with the separate merge kernel
(``kernel``) and with the in-launch ticket merge (``ticket``).

Bandwidth counts the bytes the kernel must move (keys and values of every attended position,
queries and outputs) over the time; ``of copy`` divides it by the device-to-device copy
bandwidth (read + write of 1 GiB) measured in the same run. Each case is a CUDA graph of
``--inner`` launches cycling through enough copies of the problem (different blocks of the
pool) to move at least 2x the L2 cache per replay when the problem is large; the median of
``--repeats`` replays. Small problems stay latency-bound: their time is what a decode step
waits for.

Run from the repository root on one GPU::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-kernels/benchmarks/bench_decode_attention.py --out $OUT/kernels
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import device_info

from mcore_kernels.paged_attention import paged_attention_reference, paged_attention_triton

BLOCK = 16
CASES = ((64, 4096), (32, 8192), (8, 32768), (1, 32768), (1, 160), (1, 288), (64, 160),
         (1, 4096), (8, 4096), (1, 1024))  # fmt: skip
"""(batch, context) pairs, long contexts first (a cut run keeps those)."""
L2_BYTES = 50 << 20


def _copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(30):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * (1 << 30) / (start.elapsed_time(end) / 1000 / 20)


def _graph_us(calls: list[Any], repeats: int) -> float:
    """Median microseconds per call of a CUDA graph replaying ``calls``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def main() -> None:
    """Run the benchmark; write ``decode_attention.json`` and ``decode_attention.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", default="14,2,64", help="query heads, KV heads, head_dim")
    parser.add_argument("--splits", default="256,64", help="split sizes to time")
    parser.add_argument("--inner", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop timing after this")
    args = parser.parse_args()
    started = time.perf_counter()
    q_heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    splits = [int(s) for s in args.splits.split(",")]
    variants = [(split, merge) for split in splits for merge in ("kernel", "ticket")]
    bandwidth = _copy_bandwidth()
    pool_blocks = max(b * c for b, c in CASES) // BLOCK * 2
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (pool_blocks, BLOCK, kv_heads, head_dim)
    k_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    v_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    scale = head_dim**-0.5
    rows: list[dict[str, Any]] = []
    for batch, context in CASES:
        if time.perf_counter() - started > args.budget_s:
            break
        blocks = context // BLOCK
        moved = batch * context * kv_heads * head_dim * 2 * 2 + 2 * batch * q_heads * head_dim * 2
        copies = max(1, min(args.inner, -(-2 * L2_BYTES // moved)))
        problems = []
        for _ in range(copies):
            order = torch.randperm(pool_blocks, device="cuda", generator=generator)
            tables = order[: batch * blocks].reshape(batch, blocks).to(torch.int32)
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(
                (batch, q_heads, head_dim), device="cuda", dtype=torch.bfloat16, generator=generator
            )
            problems.append((q, k_pool, v_pool, tables, lens))
        reference = paged_attention_reference(problems[0][0].float(), *problems[0][1:], scale=scale)
        row: dict[str, Any] = {"batch": batch, "context": context, "bytes": moved}
        for split, merge in variants:
            name = f"{merge}{split}"
            out = paged_attention_triton(*problems[0], scale=scale, split_size=split, merge=merge)
            row[f"{name}_max_abs_error"] = float((out.float() - reference).abs().max())
            calls = [
                lambda p=p, split=split, merge=merge: paged_attention_triton(
                    *p, scale=scale, split_size=split, merge=merge
                )
                for p in problems
            ] * max(1, args.inner // copies)
            us = _graph_us(calls, args.repeats)
            row[f"{name}_us"] = us
            row[f"{name}_of_copy"] = moved / (us * 1e-6) / bandwidth
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    result = {
        "benchmark": "decode_attention",
        **device_info(),
        "heads": {"query": q_heads, "key_value": kv_heads, "head_dim": head_dim},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention.json").write_text(json.dumps(result, indent=2))
    header = " | ".join(f"{merge} merge, split {split}" for split, merge in variants)
    lines = [
        f"Paged decode attention alone, bf16, {q_heads} query / {kv_heads} key-value heads, "
        f"head_dim {head_dim}, blocks of {BLOCK}; {result['device']}, copy "
        f"{bandwidth / 1e12:.2f} TB/s. Cells: us (% of copy).",
        "",
        f"| batch | context | KV MB | {header} |",
        "|---:|---:|---:|" + "---:|" * len(variants),
    ]
    for row in rows:
        cells = " | ".join(
            f"{row[f'{m}{s}_us']:.1f} ({100 * row[f'{m}{s}_of_copy']:.0f}%)" for s, m in variants
        )
        lines.append(f"| {row['batch']} | {row['context']} | {row['bytes'] / 1e6:.1f} | {cells} |")
    (args.out / "decode_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
