"""Decode throughput of InferenceEngine over tensor / pipeline / data parallel layouts.

Workload: a Qwen2.5-0.5B-shaped GPT (``--preset``) with random bf16 weights (the same weights at
every layout: layout-independent initialisation), ``--batch`` requests of ``--prompt-len``
random prompt tokens, ``--new-tokens`` greedy tokens. Decode time is the time of a run
generating ``new_tokens + 1`` tokens minus the time of a run generating 1 token (prefill and
first token). Each layout is measured with the fused TP collective
(``fuse_tp_communication=True``) and with all-reduce; ``describe()["tp_communication"]`` is
recorded with each row, so the table says which path ran.

Run from the repository root under torchrun (one process per GPU)::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    torchrun --nproc-per-node 2 packages/mcore-inference/benchmarks/bench_parallel_decode.py \\
        --layouts tp2 pp2 dp2 --out $OUT/inference

Rank 0 writes ``parallel_decode.json`` and ``parallel_decode.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_models import GPTConfig, GPTModel, materialize, parallelize
from mcore_parallel import initialize

LAYOUTS = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "dp2": {},
    "tp4": {"tp": 4},
    "tp2_pp2": {"tp": 2, "pp": 2},
    "tp1": {},
}
"""Layout name -> initialize() sizes (the rest of the world is data parallel)."""


def _decode_seconds(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> float:
    def run(count: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=count)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start

    run(new_tokens + 1)  # warm-up: graph capture, symmetric buffers, Triton compilation
    return run(new_tokens + 1) - run(1)


def _measure(
    name: str, args: argparse.Namespace, config: GPTConfig, fused: bool
) -> dict[str, object]:
    state = initialize(**LAYOUTS[name])
    model = parallelize(GPTModel(config, device="meta"), state)

    materialize(model, state.device)
    model.eval()
    engine_config = InferenceConfig(
        max_batch_size=args.batch,
        max_sequence_length=args.prompt_len + args.new_tokens + 1,
        fuse_tp_communication=fused,
    )
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        0, config.vocab_size, (args.batch, args.prompt_len), generator=generator
    )
    with InferenceEngine(model, engine_config, state=state) as engine:
        seconds = _decode_seconds(engine, prompts.tolist(), args.new_tokens)
        description = engine.describe()
    state.destroy()
    del model
    torch.cuda.empty_cache()
    tokens = args.batch * args.new_tokens
    return {
        "layout": name,
        "fused_tp": fused,
        "decode_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "tp_communication": description["tp_communication"],
        "cuda_graphs": description["cuda_graphs"],
    }


def main() -> None:
    """Run the benchmark; rank 0 writes ``parallel_decode.json`` and ``.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--layouts", nargs="+", default=["tp2", "pp2", "dp2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default="bench_out/inference")
    args = parser.parse_args()
    config = GPTConfig.from_name(args.preset, dtype="bfloat16", perform_initialization=True)
    rows = []
    for name in args.layouts:
        for fused in (True, False):
            row = _measure(name, args, config, fused)
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
            if LAYOUTS[name].get("tp", 1) == 1:
                break  # no TP communication to compare
    if dist.get_rank() != 0:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "world_size": dist.get_world_size(),
        "preset": args.preset,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    (out / "parallel_decode.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Parallel decode: {args.preset}, batch {args.batch}, {args.prompt_len} prompt + "
        f"{args.new_tokens} new tokens, {result['world_size']} x {result['device']}",
        "",
        "| layout | TP reduction | tokens/s | decode s | graphs |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layout']} | {row['tp_communication']} | {row['tokens_per_second']:.0f} | "
            f"{row['decode_seconds']:.3f} | {row['cuda_graphs']} |"
        )
    (out / "parallel_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
