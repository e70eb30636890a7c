"""Paged decode attention alone: bandwidth of the split-KV kernel against the device's copy.

Workload: 16 query heads, group 1, 4 or 8 (16, 4 or 2 key/value heads; group 7 is the
Qwen2.5-0.5B shape, 14 query and 2 key/value heads), head_dim 64, 72 or 128, bf16, KV blocks
of 16 positions scattered over a shared pool (every token reads its own blocks), batch 1..256
and contexts 128..32k (every token of a batch at the full context). Launches that move less
than 256 MB cycle through up to ``--inner`` problems on different blocks, so that the 50 MB
L2 cache does not serve the repeated reads. One decode step per token: split size 256, the engine's
default. Each configuration is timed as a CUDA graph of ``--inner`` launches (the launch cost
of the host stays out), median of ``--repeats`` replays.

Bandwidth counts the bytes the kernel must move (keys and values of every attended position,
queries and outputs); ``of copy`` divides it by the device-to-device copy bandwidth measured in
the same run (bytes read + written of a 1 GiB copy, after a warm-up that raises the clocks,
timed like ``bench_decode.py``'s).

Variants: ``before`` is the split kernel as it was (query group padded to 16 rows, IEEE
float32 ``tl.dot``); ``default`` is the configuration the package picks for the launch
(:func:`mcore_kernels.paged_attention.paged_decode_config`: 2 warps and at most 128
registers per thread from 4 programs per multiprocessor, else 4 warps); ``--sweep`` adds the other
modes and tiles; ``auto`` is the default configuration with the split picked per launch
(``split_size=None``: :func:`mcore_kernels.paged_attention.auto_split_size`, up to 1024
positions while the launch keeps 3 programs per multiprocessor). A second table times a chunked-prefill step and a batch-512 decode step of
the Llama-3.2-1B attention shape, with and without the grouping of a sequence's tokens. Kernels are compiled first in ``--compile-workers``
processes (Triton's on-disk cache), so compilation stays out of the measured loop.

Run from the repository root on one GPU::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-kernels/benchmarks/bench_paged_attention.py --out $OUT/kernels
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import device_info
from _paged_attention_baseline import baseline_paged_attention

from mcore_kernels.paged_attention import (
    PagedDecodeConfig,
    paged_attention_reference,
    paged_attention_triton,
    paged_decode_config,
)

BLOCK = 16
SPLIT = 256
Q_HEADS = 16
"""Query heads of a shape (14 for group 7, the Qwen2.5-0.5B shape)."""


def _heads(group: int) -> tuple[int, int]:
    """(query heads, key/value heads) of a group size."""
    kv_heads = max(1, Q_HEADS // group)
    return kv_heads * group, kv_heads


SHAPES = (
    (1, 128),
    (1, 1024),
    (1, 4096),
    (1, 32768),
    (8, 4096),
    (8, 32768),
    (64, 4096),
    (32, 1024),
    (32, 8192),
    (128, 128),
    (128, 1024),
    (256, 128),
    (256, 1024),
)
"""(batch, context) pairs; at most 256k attended positions per launch."""


def _variants(group: int, sweep: bool) -> dict[str, PagedDecodeConfig | None]:
    """Name -> config (None: the pre-change kernel)."""
    del group
    variants: dict[str, PagedDecodeConfig | None] = {"before": None}
    if sweep:
        variants["sum-t16"] = PagedDecodeConfig(mode="sum", tile=16)
        variants["dot-t32"] = PagedDecodeConfig(tile=32)
        variants["dot-t64-w8"] = PagedDecodeConfig(tile=64, num_warps=8)
        variants["dot-t128-w8"] = PagedDecodeConfig(tile=128, num_warps=8)
        variants["dot-t64-s3"] = PagedDecodeConfig(tile=64, num_stages=3)
    return variants


def _problem(
    batch: int,
    context: int,
    group: int,
    head_dim: int,
    pool: tuple[torch.Tensor, torch.Tensor],
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Queries, caches, block tables and lengths; each token reads its own shuffled blocks."""
    k_pool, v_pool = pool
    blocks = context // BLOCK
    generator = torch.Generator(device="cuda").manual_seed(batch * 7 + context + 1000 * seed)
    order = torch.randperm(k_pool.shape[0], device="cuda", generator=generator)
    tables = order[: batch * blocks].reshape(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, _heads(group)[0], head_dim), device="cuda", dtype=torch.bfloat16)
    return q, k_pool, v_pool, tables, lens


def _run(name: str, config: PagedDecodeConfig | None, args: tuple, scale: float) -> torch.Tensor:
    if config is None:
        return baseline_paged_attention(*args, scale=scale, split_size=SPLIT)
    # "auto": the split picked per launch (split_size=None, auto_split_size); "default" and
    # "auto" leave the configuration to the package (it depends on the launch's size).
    split = None if name == "auto" else SPLIT
    if name in ("default", "auto"):
        config = None
    return paged_attention_triton(*args, scale=scale, split_size=split, config=config)


def _graph_ms(fn: Any, inner: int, repeats: int) -> float:
    """Median milliseconds of one call, from replays of a graph of ``inner`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    del graph
    return sorted(times)[len(times) // 2]


def _compile_one(job: tuple[int, int, str, PagedDecodeConfig | None]) -> str:
    """Worker: run one variant of one head config at every context (fills Triton's cache)."""
    group, head_dim, name, config = job
    started = time.perf_counter()
    kv_heads = _heads(group)[1]
    shape = (max(c for _, c in SHAPES) // BLOCK, BLOCK, kv_heads, head_dim)
    pool = (
        torch.zeros(shape, device="cuda", dtype=torch.bfloat16),
        torch.zeros(shape, device="cuda", dtype=torch.bfloat16),
    )
    for context in sorted({c for _, c in SHAPES}):
        _run(name, config, _problem(1, context, group, head_dim, pool), head_dim**-0.5)
    torch.cuda.synchronize()
    return f"compiled g{group} d{head_dim} {name} in {time.perf_counter() - started:.1f} s"


def _all_variants(group: int, head_dim: int, sweep: bool) -> dict[str, PagedDecodeConfig | None]:
    variants = _variants(group, sweep)
    variants["default"] = paged_decode_config(group, head_dim, _heads(group)[1], torch.bfloat16)
    variants["auto"] = variants["default"]
    return variants


PREFILL_VARIANTS: dict[str, PagedDecodeConfig | None] = {
    "before": None,
    "default": PagedDecodeConfig(),
    "default, one token per program": PagedDecodeConfig(prefill_tokens=2**31 - 1),
}
"""Variants of the chunked-prefill table (the default groups a sequence's tokens)."""


def _prefill_cases() -> list[tuple[str, tuple[torch.Tensor, ...]]]:
    """GRPO generation steps of the Llama-3.2-1B shape (32 heads, 8 KV heads, head_dim 64)."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    shape = (32 * 16 + 512 * 26 + 1, BLOCK, 8, 64)
    k_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    v_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    order = torch.randperm(shape[0], device="cuda", generator=generator).to(torch.int32)
    # Chunked prefill: 32 sequences x 256 prompt tokens in one step (contexts 1..256).
    seq_tables = order[: 32 * 16].reshape(32, 16)
    rows = torch.arange(32, device="cuda").repeat_interleave(256)
    lens = torch.arange(1, 257, device="cuda", dtype=torch.int32).repeat(32)
    q = torch.randn((8192, 32, 64), device="cuda", dtype=torch.bfloat16, generator=generator)
    prefill = (q, k_pool, v_pool, seq_tables[rows], lens)
    # Decode at batch 512, contexts 384..415.
    tables = order[32 * 16 : 32 * 16 + 512 * 26].reshape(512, 26)
    lens = 384 + torch.arange(512, device="cuda", dtype=torch.int32) % 32
    q = torch.randn((512, 32, 64), device="cuda", dtype=torch.bfloat16, generator=generator)
    decode = (q, k_pool, v_pool, tables, lens)
    return [
        ("prefill 8192 tokens (32 seqs x 256)", prefill),
        ("decode batch 512, context 384-415", decode),
    ]


def _compile_prefill(_: int) -> str:
    """Worker: compile the variants of the chunked-prefill table."""
    for _name, problem in _prefill_cases():
        for name, config in PREFILL_VARIANTS.items():
            _run(name, config, problem, 0.125)
    torch.cuda.synchronize()
    return "compiled the prefill table"


def _prefill_table(inner: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for case, problem in _prefill_cases():
        row: dict[str, Any] = {"case": case}
        for name, config in PREFILL_VARIANTS.items():
            ms = _graph_ms(
                lambda name=name, config=config, problem=problem: _run(
                    name, config, problem, 0.125
                ),
                inner,
                repeats,
            )
            row[f"{name}_us"] = ms * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), as bench_decode."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(40):  # clocks up
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * (1 << 30) / (start.elapsed_time(end) / 1000 / 20)


def main() -> None:
    """Run the benchmark; write ``paged_attention.json`` and ``paged_attention.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--head-configs",
        default="1x72,7x64,1x128,8x128,4x128,1x64,4x64,8x64,4x72,8x72",
        help="GROUPxHEAD_DIM list, timed in this order",
    )
    parser.add_argument("--sweep", action="store_true", help="time every variant, not only two")
    parser.add_argument("--compile-workers", type=int, default=9)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop timing after this")
    args = parser.parse_args()
    head_configs = [tuple(int(x) for x in item.split("x")) for item in args.head_configs.split(",")]
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (g, d, name, config)
        for g, d in head_configs
        for name, config in _all_variants(g, d, args.sweep).items()
    ]
    if args.compile_workers > 1:
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.compile_workers) as pool:
            prefill = pool.map_async(_compile_prefill, [0])
            for line in pool.imap_unordered(_compile_one, jobs):
                print(f"[{time.perf_counter() - started:5.1f}s] {line}", flush=True)
            print(f"[{time.perf_counter() - started:5.1f}s] {prefill.get()[0]}", flush=True)
    bandwidth = _copy_bandwidth()
    print(f"[{time.perf_counter() - started:5.1f}s] copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    prefill_rows = _prefill_table(args.inner, args.repeats)
    for group, head_dim in head_configs:
        if time.perf_counter() - started > args.budget_s:
            break
        kv_heads = _heads(group)[1]
        pool_blocks = max(b * c for b, c in SHAPES) // BLOCK
        shape = (pool_blocks, BLOCK, kv_heads, head_dim)
        pool = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16),
            torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        )
        variants = _all_variants(group, head_dim, args.sweep)
        default = variants["default"]
        scale = head_dim**-0.5
        # Numerics of every variant against the float32 torch reference, on a mid shape.
        check = _problem(4, 1024 + 48, group, head_dim, pool)
        reference = paged_attention_reference(check[0].float(), *check[1:], scale=scale)
        rounded = reference.to(torch.bfloat16)
        for name, config in variants.items():
            got = _run(name, config, check, scale)
            errors.append(
                {
                    "group": group,
                    "head_dim": head_dim,
                    "variant": name,
                    "max_abs_error": float((got.float() - reference).abs().max()),
                    "differs_from_rounded_reference": float((got != rounded).float().mean()),
                }
            )
        for batch, context in SHAPES:
            if time.perf_counter() - started > args.budget_s:
                break
            problem = _problem(batch, context, group, head_dim, pool)
            moved = batch * context * kv_heads * head_dim * 2 * 2 + 2 * problem[0].nbytes
            copies = [problem] + [
                _problem(batch, context, group, head_dim, pool, seed=i)
                for i in range(1, min(args.inner, -(-(256 << 20) // moved)))
            ]
            row: dict[str, Any] = {
                "group": group,
                "head_dim": head_dim,
                "batch": batch,
                "context": context,
                "bytes": moved,
                "default_config": str(default),
            }
            for name, config in variants.items():
                calls = iter(range(10**9))
                ms = _graph_ms(
                    lambda name=name, config=config, scale=scale, calls=calls, copies=copies: _run(
                        name, config, copies[next(calls) % len(copies)], scale
                    ),
                    args.inner,
                    args.repeats,
                )
                row[f"{name}_us"] = ms * 1e3
                row[f"{name}_gbs"] = moved / (ms * 1e-3) / 1e9
                row[f"{name}_of_copy"] = moved / (ms * 1e-3) / bandwidth
            rows.append(row)
            best = max(variants, key=lambda n: row[f"{n}_gbs"])
            print(
                f"[{time.perf_counter() - started:5.1f}s] g{group} d{head_dim} b{batch} "
                f"c{context}: before {row['before_us']:.1f} us, default {row['default_us']:.1f} "
                f"us ({100 * row['default_of_copy']:.0f}% of copy), best {best} "
                f"{row[f'{best}_us']:.1f} us",
                flush=True,
            )
        del pool
        torch.cuda.empty_cache()
        _write(args.out, bandwidth, rows, errors, prefill_rows, started)


def _write(
    out: Path,
    bandwidth: float,
    rows: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    prefill_rows: list[dict[str, Any]],
    started: float,
) -> None:
    result = {
        "benchmark": "paged_attention",
        **device_info(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "q_heads": Q_HEADS,
        "block_size": BLOCK,
        "split_size": SPLIT,
        "rows": rows,
        "errors": errors,
        "prefill_rows": prefill_rows,
        "elapsed_s": time.perf_counter() - started,
    }
    (out / "paged_attention.json").write_text(json.dumps(result, indent=2))
    (out / "paged_attention.md").write_text(_markdown(result))


def _markdown(result: dict[str, Any]) -> str:
    names = list(
        dict.fromkeys(k[: -len("_us")] for row in result["rows"] for k in row if k.endswith("_us"))
    )
    lines = [
        f"Paged decode attention, bf16, {result['q_heads']} query heads (14 at group 7), blocks of "
        f"{result['block_size']}, split {result['split_size']}; {result['device']}, copy "
        f"{result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. Cells: us (% of copy).",
        "",
        "| group | head_dim | batch | context | " + " | ".join(names) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    for row in result["rows"]:
        cells = [
            f"{row[f'{n}_us']:.1f} ({100 * row[f'{n}_of_copy']:.0f}%)" if f"{n}_us" in row else "-"
            for n in names
        ]
        lines.append(
            f"| {row['group']} | {row['head_dim']} | {row['batch']} | {row['context']} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "Chunked prefill and large-batch decode, Llama-3.2-1B attention shape (32 query heads, "
        "8 KV heads, head_dim 64), us per call:",
        "",
        "| step | " + " | ".join(PREFILL_VARIANTS) + " |",
        "|---|" + "---:|" * len(PREFILL_VARIANTS),
    ]
    lines += [
        f"| {row['case']} | " + " | ".join(f"{row[f'{n}_us']:.1f}" for n in PREFILL_VARIANTS) + " |"
        for row in result["prefill_rows"]
    ]
    lines += [
        "",
        "Against the float32 torch reference (batch 4, context 1072): largest error and the",
        "share of outputs that differ from the reference rounded to bf16.",
        "",
    ]
    lines += [
        "| group | head_dim | variant | max abs error | outputs off the rounded reference |",
        "|---:|---:|---|---:|---:|",
    ]
    lines += [
        f"| {e['group']} | {e['head_dim']} | {e['variant']} | {e['max_abs_error']:.2e} | "
        f"{100 * e['differs_from_rounded_reference']:.2f}% |"
        for e in result["errors"]
    ]
    lines += ["", f"Benchmark wall time {result['elapsed_s']:.0f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
