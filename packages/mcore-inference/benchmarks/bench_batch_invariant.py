"""Cost of the batch-invariant mode: training step, decode and GEMMs with and without it.

Workloads, each measured with ``batch_invariant`` off and on, in the same process on one GPU:

- training: a ``--train-preset`` (Llama-3.2-1B shape) GPT with random bf16 weights, one packed
  row of ``--train-seqs`` sequences of ``--train-len`` tokens, forward to label log-probs
  (``labels=``) plus backward; median of ``--train-steps`` steps after two warm-up steps;
- decode: the same model in the ``InferenceEngine`` with CUDA graphs, ``--prompt-len`` random
  prompt tokens and ``--new-tokens`` greedy tokens per request, at each of ``--batch-sizes``;
  decode time is a run of ``new_tokens + 1`` tokens minus a run of 1 token (prefill);
- GEMM: ``F.linear`` (cuBLAS) against the invariant kernel for the model's projection shapes;
- exactness: in the mode, the engine's log-probs of a request alone and inside the largest
  batch, and the training forward's log-probs of the generated sequences, compared bitwise
  (``max_abs_diff`` must be 0).

Run from the repository root on one GPU (about a minute)::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_batch_invariant.py --out $OUT/batch_invariant
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import operator
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_kernels.batch_invariant import batch_invariant_mode, linear_batch_invariant
from mcore_models import GPTConfig, GPTModel, PackedSeqParams


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(t in lowered for t in ("_gemm_kernel", "_gemm_tma_kernel", "_split_sum_kernel")):
        return "invariant GEMM"
    if any(t in lowered for t in ("gemm", "nvjet", "xmma", "cutlass", "gemv", "matmul")):
        return "cuBLAS GEMM"
    if any(t in lowered for t in ("_split_kernel", "_merge_kernel", "flash", "fmha", "attention")):
        return "attention"
    return "other"


def _kernel_ms(fn) -> tuple[dict[str, float], list[dict]]:
    """GPU time of ``fn``'s kernels by category, and the ops with the most host time.

    One profiled call (torch.profiler, CPU and CUDA activities).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    events = prof.key_averages()
    for event in events:
        micros = getattr(event, "self_device_time_total", None)
        if micros is None:
            micros = event.self_cuda_time_total
        if micros > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            category = _kernel_category(event.key)
            totals[category] = totals.get(category, 0.0) + micros / 1e3
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    top = [
        {"op": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
        for e in host
    ]
    return totals, top


def _training_step(model: GPTModel, steps: int, seqs: int, length: int, *, invariant: bool) -> dict:
    """Median step and no-grad forward seconds, and one step's kernel time by category."""
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, seqs * length), generator=generator)
    ids = ids.to(device)
    labels = torch.roll(ids, -1, dims=1)
    cu = torch.arange(0, seqs * length + 1, length, dtype=torch.int32, device=device)
    packed = PackedSeqParams(cu_seqlens=cu, max_seqlen=length)

    def forward() -> torch.Tensor:
        with batch_invariant_mode(invariant):
            return model(ids, packed_seq_params=packed, labels=labels)

    def step() -> None:
        (-forward().mean()).backward()
        model.zero_grad(set_to_none=True)

    def forward_only() -> None:
        with torch.no_grad():
            forward()

    for _ in range(2):
        step()
    kernel_ms, host_ops = _kernel_ms(step)
    return {
        "step_s": statistics.median(_timed(step) for _ in range(steps)),
        "forward_s": statistics.median(_timed(forward_only) for _ in range(steps)),
        "kernel_ms": kernel_ms,
        "host_ops": host_ops,
    }


def _engine(model: GPTModel, batch: int, max_len: int, *, invariant: bool) -> InferenceEngine:
    sizes = tuple(sorted({1, batch}))
    return InferenceEngine(
        model,
        InferenceConfig(
            max_batch_size=batch,
            max_sequence_length=max_len,
            max_tokens_per_step=max(2048, batch),
            cuda_graph_batch_sizes=sizes,
            use_cuda_graphs=True,
            batch_invariant=invariant,
        ),
    )


def _decode_tokens_per_second(
    model: GPTModel, batch: int, prompt_len: int, new_tokens: int, *, invariant: bool
) -> float:
    generator = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(0, model.config.vocab_size, (prompt_len,), generator=generator).tolist()
        for _ in range(batch)
    ]
    with _engine(model, batch, prompt_len + new_tokens + 8, invariant=invariant) as engine:
        first = SamplingParams(temperature=0.0, max_tokens=1)
        full = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1)
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        prefill = _timed(lambda: engine.generate(prompts, first))
        total = _timed(lambda: engine.generate(prompts, full))
    return batch * new_tokens / max(total - prefill, 1e-9)


def _exactness(model: GPTModel, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """In the mode: one request alone vs in a batch, and engine vs training forward."""
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(
            0, model.config.vocab_size, (prompt_len + i % 7,), generator=generator
        ).tolist()
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, return_logprobs=True)
    with _engine(model, batch, prompt_len + new_tokens + 16, invariant=True) as engine:
        together = engine.generate(prompts, params)
        alone = engine.generate(prompts[:1], params)[0]
    batch_diff = max(abs(a - b) for a, b in zip(alone.logprobs, together[0].logprobs, strict=True))
    device = next(model.parameters()).device
    sample = list(zip(prompts[:8], together[:8], strict=True))
    sequences = [p + r.tokens for p, r in sample]
    lengths = [len(s) for s in sequences]
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))])
    ids = torch.tensor([functools.reduce(operator.iadd, sequences, [])], device=device)
    labels = torch.tensor(
        [functools.reduce(operator.iadd, ([*s[1:], 0] for s in sequences), [])], device=device
    )
    packed = PackedSeqParams(cu_seqlens=cu.to(device, torch.int32), max_seqlen=max(lengths))
    with torch.no_grad(), batch_invariant_mode():
        training = model(ids, packed_seq_params=packed, labels=labels)[0].cpu()
    train_diff = 0.0
    for i, (prompt, result) in enumerate(sample):
        first = int(cu[i]) + len(prompt) - 1
        values = training[first : first + len(result.tokens)].tolist()
        train_diff = max(
            train_diff, max(abs(a - b) for a, b in zip(values, result.logprobs, strict=True))
        )
    return {
        "batch_vs_alone_max_abs_diff": batch_diff,
        "engine_vs_training_max_abs_diff": train_diff,
    }


def _graph_ms(fn, calls: int) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph (no launch overhead)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def _gemm_table(config: GPTConfig, device: torch.device) -> list[dict]:
    from mcore_kernels.batch_invariant.matmul import gemm_config

    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    heads = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    rows = []
    for name, (out_f, in_f) in {
        "q, o": (heads, hidden),
        "k, v": (kv, hidden),
        "gate, up": (ffn, hidden),
        "down": (hidden, ffn),
        "lm_head": (config.vocab_size, hidden),
    }.items():
        weight = torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16)
        chosen = gemm_config(out_f, in_f, torch.bfloat16, device)
        for m in (1, 64, 256, 4096):
            x = torch.randn(m, in_f, device=device, dtype=torch.bfloat16)
            calls = 20 if m <= 256 else 3
            with torch.no_grad():
                cublas = _graph_ms(lambda x=x, w=weight: F.linear(x, w), calls)
                invariant = _graph_ms(lambda x=x, w=weight: linear_batch_invariant(x, w), calls)
            rows.append(
                {
                    "gemm": name,
                    "M": m,
                    "N": out_f,
                    "K": in_f,
                    "config": (
                        f"{chosen.block_m}x{chosen.block_n}x{chosen.block_k} w{chosen.warps} "
                        f"s{chosen.stages} split{chosen.splits}" + (" tma" if chosen.tma else "")
                    ),
                    "cublas_ms": cublas,
                    "invariant_ms": invariant,
                    "slowdown": invariant / cublas,
                    "invariant_tflops": 2 * m * out_f * in_f / invariant / 1e9,
                }
            )
    return rows


def _markdown(result: dict) -> str:
    lines = [
        f"# Batch-invariant mode: cost ({result['device']})",
        "",
        f"Model: {result['preset']} shape, bf16, random weights.",
        "",
        "| workload | off | on | on / off time |",
        "|---|---|---|---|",
    ]
    train = result["training"]
    off, on = train["off"], train["on"]
    lines.append(
        f"| training step ({train['tokens']} tokens, fwd+bwd) | {off['step_s'] * 1e3:.1f} ms | "
        f"{on['step_s'] * 1e3:.1f} ms | {on['step_s'] / off['step_s']:.2f}x |"
    )
    lines.append(
        f"| training forward only (no grad) | {off['forward_s'] * 1e3:.1f} ms | "
        f"{on['forward_s'] * 1e3:.1f} ms | {on['forward_s'] / off['forward_s']:.2f}x |"
    )
    for row in result["decode"]:
        lines.append(
            f"| decode batch {row['batch']} | {row['off_tok_s']:.0f} tok/s | "
            f"{row['on_tok_s']:.0f} tok/s | {row['off_tok_s'] / row['on_tok_s']:.2f}x |"
        )
    categories = sorted(set(off["kernel_ms"]) | set(on["kernel_ms"]))
    lines += [
        "",
        "Kernel time of one training step by kind (torch.profiler, ms):",
        "",
        "| kernels | off | on |",
        "|---|---|---|",
    ]
    for category in categories:
        lines.append(
            f"| {category} | {off['kernel_ms'].get(category, 0.0):.1f} | "
            f"{on['kernel_ms'].get(category, 0.0):.1f} |"
        )
    lines.append(
        f"| all kernels / step time | {sum(off['kernel_ms'].values()):.1f} / "
        f"{off['step_s'] * 1e3:.1f} | {sum(on['kernel_ms'].values()):.1f} / "
        f"{on['step_s'] * 1e3:.1f} |"
    )
    exact = result["exactness"]
    lines += [
        "",
        "Exactness in the mode (bf16, CUDA graphs): max |alone - in batch| = "
        f"{exact['batch_vs_alone_max_abs_diff']}, max |engine - training forward| = "
        f"{exact['engine_vs_training_max_abs_diff']}.",
        "",
        "GEMMs (forward; CUDA-graph replay, so no launch overhead):",
        "",
        "| GEMM | M | N | K | invariant config | cuBLAS ms | invariant ms | slowdown "
        "| invariant TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["gemm"]:
        lines.append(
            f"| {row['gemm']} | {row['M']} | {row['N']} | {row['K']} | {row['config']} | "
            f"{row['cublas_ms']:.4f} | {row['invariant_ms']:.4f} | {row['slowdown']:.2f}x | "
            f"{row['invariant_tflops']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the benchmark and write ``batch_invariant.json`` and ``.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train-preset", default="llama-3.2-1b")
    parser.add_argument("--train-seqs", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=1024)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = GPTConfig.from_name(args.train_preset, dtype=torch.bfloat16)
    model = GPTModel(config, device=device)
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": args.train_preset,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }
    train: dict = {"tokens": args.train_seqs * args.train_len}
    for enabled in (False, True):
        train["on" if enabled else "off"] = _training_step(
            model, args.train_steps, args.train_seqs, args.train_len, invariant=enabled
        )
        print("training", enabled, train, flush=True)
    result["training"] = train
    (out / "batch_invariant.json").write_text(json.dumps(result, indent=2))
    model.eval()
    largest = max(int(b) for b in args.batch_sizes.split(","))
    result["exactness"] = _exactness(model, min(largest, 64), args.prompt_len, 32)
    print(result["exactness"], flush=True)
    (out / "batch_invariant.json").write_text(json.dumps(result, indent=2))
    decode = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row: dict = {"batch": batch}
        for enabled in (False, True):
            with torch.no_grad():
                row["on_tok_s" if enabled else "off_tok_s"] = _decode_tokens_per_second(
                    model, batch, args.prompt_len, args.new_tokens, invariant=enabled
                )
            gc.collect()
        decode.append(row)
        print(row, flush=True)
    result["decode"] = decode
    (out / "batch_invariant.json").write_text(json.dumps(result, indent=2))
    result["gemm"] = _gemm_table(config, device)
    (out / "batch_invariant.json").write_text(json.dumps(result, indent=2))
    (out / "batch_invariant.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
