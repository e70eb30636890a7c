"""One training step (forward + backward + fused AdamW) of GPTModel against transformers.

Both models get the same shape (default: the Llama-3.2-1B preset), bf16 parameters, random
tokens, sequence length 4096, and a fused ``torch.optim.AdamW``; the peer is
``transformers.LlamaForCausalLM`` with ``attn_implementation="sdpa"`` and its own causal-LM loss.
GPTModel runs SDPA attention, the fused residual-add + RMSNorm kernel and
``mcore_kernels.token_logprobs`` on bf16 logits for the loss. Reports tokens/s, MFU (PaLM FLOP
accounting, see ``GPTConfig.flops_per_token``) and peak memory, and the ratio to the peer.

Run from the repository root::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-models/benchmarks/bench_train_step.py --out $OUT/models
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mcore_kernels import token_logprobs
from mcore_models import GPTConfig, GPTModel
from mcore_models.gpt.hf import config_to_hf

# Dense bf16 tensor-core peak (TFLOP/s) from NVIDIA's H100 and H200 datasheets (SXM, without
# sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU, looked up by name.

    Args:
        device_name: ``torch.cuda.get_device_name()``.

    Returns:
        TFLOP/s, or None for an unknown device.
    """
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


def _mcore_step_fn(
    config: GPTConfig, device: torch.device, compile_layers: bool
) -> Callable[..., Any]:
    model = GPTModel(config, device=device).train()
    if compile_layers:
        for layer in model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        hidden = model(ids[:, :-1], return_hidden=True)
        logits = model.compute_logits(hidden, upcast=False)
        loss = -token_logprobs(logits.flatten(0, 1), ids[:, 1:].flatten()).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _hf_step_fn(config: GPTConfig, device: torch.device) -> Callable[..., Any]:
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="sdpa", dtype=config.dtype
    ).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        # Same tokens as the mcore step: predict ids[:, 1:] from ids[:, :-1].
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1].contiguous()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _time(step: Callable[..., Any], ids: torch.Tensor, warmup: int, steps: int) -> dict[str, float]:
    device = ids.device
    for _ in range(warmup):
        step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    result = {"step_s": elapsed, "loss": float(loss)}
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every variant and return the result dictionary.

    Args:
        args: Parsed command line.

    Returns:
        JSON-ready results.
    """
    device = torch.device(args.device)
    config = GPTConfig.from_name(args.preset, dtype=args.dtype, attention_backend="sdpa")
    if args.num_layers:
        config = config.replace(num_layers=args.num_layers)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or peak_tflops(device_name)
    tokens = args.batch * args.seq_len
    ids = torch.randint(
        0,
        config.vocab_size,
        (args.batch, args.seq_len + 1),
        device=device,
        generator=torch.Generator(device=device).manual_seed(0),
    )
    flops_per_token = config.flops_per_token(args.seq_len)
    variants: list[tuple[str, Callable[[], Callable[..., Any]]]] = [
        ("transformers LlamaForCausalLM (sdpa)", lambda: _hf_step_fn(config, device)),
        ("mcore GPTModel (sdpa)", lambda: _mcore_step_fn(config, device, False)),
    ]
    if args.compile:
        variants.append(
            ("mcore GPTModel (sdpa, compiled layers)", lambda: _mcore_step_fn(config, device, True))
        )
    rows = []
    for name, build in variants:
        row: dict[str, Any] = {"name": name}
        try:
            measured = _time(build(), ids, args.warmup, args.steps)
            row.update(measured)
            row["tokens_per_s"] = tokens / measured["step_s"]
            row["tflops"] = flops_per_token * row["tokens_per_s"] / 1e12
            if peak:
                row["mfu"] = row["tflops"] / peak
        except Exception as error:  # a failing variant must not lose the others' numbers
            row["error"] = f"{type(error).__name__}: {error}"
            row["traceback"] = traceback.format_exc()
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    baseline = rows[0].get("tokens_per_s")
    for row in rows:
        if baseline and "tokens_per_s" in row:
            row["ratio_vs_transformers"] = row["tokens_per_s"] / baseline
    import transformers

    return {
        "benchmark": "train_step",
        "device": device_name,
        "peak_tflops": peak,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": args.preset,
        "num_layers": config.num_layers,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "dtype": str(config.dtype),
        "parameters": config.num_parameters(),
        "flops_per_token": flops_per_token,
        "warmup": args.warmup,
        "steps": args.steps,
        "results": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    """Render the results as a Markdown table.

    Args:
        result: Output of :func:`run`.

    Returns:
        The table with a one-line header.
    """
    lines = [
        f"Training step, {result['preset']} shape ({result['parameters'] / 1e9:.2f}B parameters), "
        f"batch {result['batch']} x seq {result['seq_len']}, {result['dtype']}, "
        f"on {result['device']} (torch {result['torch']}, transformers {result['transformers']}).",
        "",
        "| implementation | step (ms) | tokens/s | TFLOP/s | MFU | peak mem (GiB) | vs transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["results"]:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error'][:80]} | | | | | |")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if "mfu" in row else "n/a"
        memory = f"{row['peak_memory_gib']:.1f}" if "peak_memory_gib" in row else "n/a"
        ratio = f"{row['ratio_vs_transformers']:.2f}x" if "ratio_vs_transformers" in row else "n/a"
        lines.append(
            f"| {row['name']} | {1000 * row['step_s']:.1f} | {row['tokens_per_s']:,.0f} | "
            f"{row['tflops']:.0f} | {mfu} | {memory} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments (default: ``sys.argv``).

    Returns:
        The namespace.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for train_step.json and .md")
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--num-layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd layers")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and write ``train_step.json`` and ``train_step.md`` under ``--out``.

    Args:
        argv: Arguments (default: ``sys.argv``).
    """
    args = parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / "train_step.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
