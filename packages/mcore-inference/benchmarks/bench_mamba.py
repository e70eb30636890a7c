"""Hybrid Mamba model in the engine: prefill and decode with and without non-decode CUDA graphs.

Workload: a Nemotron-H-shaped hybrid model scaled down to fit the time budget (hidden 1024,
pattern ``M-M*M-M-M*M-`` = 12 layers: 6 Mamba-2, 2 attention, 4 squared-ReLU MLP; Mamba 32
heads x 64, 8 groups, state 128; bf16, random weights), on one GPU, in one process:

* short prefill: time to the first token of ``batch`` requests of ``prompt`` tokens
  (``max_tokens=1``), engine with decode AND non-decode graphs vs decode graphs only
  (``cuda_graph_prefill_token_counts=()``) vs no graphs, and transformers'
  ``NemotronHForCausalLM`` forward on the same weights (its torch path, as installed);
* decode: tokens per second generating ``new`` tokens at batch 1 / 16 / 64 (the time of a run
  generating ``new + 1`` tokens minus one generating 1), graphs vs eager;
* kernel: the Triton SSD scan (forward, forward + backward) against the torch chunked
  reference at 4096 tokens.

The seed report's claim checked here: non-decode graphs lower launch overhead for short
prefills. Writes ``mamba.json`` and ``mamba.md`` under ``--out``. Run from the repository root::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_mamba.py --out $OUT/mamba
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_kernels.ssd import ssd_scan_reference, ssd_scan_triton
from mcore_models.mamba import HybridModel, hybrid_preset

PATTERN = "M-M*M-M-M*M-"


def _model() -> HybridModel:
    config = hybrid_preset(
        "nemotron-h-8b",
        hidden_size=1024,
        layer_pattern=PATTERN,
        mamba_num_heads=32,
        ffn_hidden_size=4096,
        num_attention_heads=8,
        num_query_groups=2,
        vocab_size=32768,
        seed=0,
    )
    return HybridModel(config, device="cuda").eval()


def _time(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _engine(model: HybridModel, mode: str, batch: int) -> InferenceEngine:
    extra: dict[str, Any] = {}
    if mode == "eager":
        extra["use_cuda_graphs"] = False
    elif mode == "decode_graphs":
        extra["cuda_graph_prefill_token_counts"] = ()
    return InferenceEngine(
        model,
        InferenceConfig(
            max_batch_size=max(batch, 1),
            max_sequence_length=512,
            max_tokens_per_step=2048,
            prefill_chunk_size=512,
            **extra,
        ),
    )


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(0, vocab, (batch, length), generator=generator).tolist()


def bench_prefill(model: HybridModel, hf: Any) -> list[dict[str, Any]]:
    rows = []
    params = SamplingParams(temperature=0, max_tokens=1)
    for batch, length in ((1, 16), (1, 64), (1, 256), (8, 32)):
        prompts = _prompts(batch, length, model.config.vocab_size)
        row: dict[str, Any] = {"batch": batch, "prompt": length}
        for mode in ("all_graphs", "decode_graphs", "eager"):
            with _engine(model, mode, batch) as engine:
                row[f"{mode}_ms"] = 1e3 * _time(
                    lambda e=engine, p=prompts: e.generate(p, params), 10
                )
        ids = torch.tensor(prompts, device="cuda")
        with torch.no_grad():
            row["transformers_ms"] = 1e3 * _time(lambda i=ids: hf(i), 5)
        row["speedup_vs_decode_graphs"] = row["decode_graphs_ms"] / row["all_graphs_ms"]
        row["speedup_vs_transformers"] = row["transformers_ms"] / row["all_graphs_ms"]
        rows.append(row)
    return rows


def bench_decode(model: HybridModel, new: int) -> list[dict[str, Any]]:
    rows = []
    for batch in (1, 16, 64):
        prompts = _prompts(batch, 32, model.config.vocab_size)
        row: dict[str, Any] = {"batch": batch, "prompt": 32, "new_tokens": new}
        for mode in ("all_graphs", "eager"):
            with _engine(model, mode, batch) as engine:
                full = _time(
                    lambda e=engine, p=prompts: e.generate(
                        p, SamplingParams(temperature=0, max_tokens=new + 1)
                    ),
                    2,
                )
                first = _time(
                    lambda e=engine, p=prompts: e.generate(
                        p, SamplingParams(temperature=0, max_tokens=1)
                    ),
                    2,
                )
            row[f"{mode}_tok_s"] = batch * new / max(full - first, 1e-9)
        row["graph_speedup"] = row["all_graphs_tok_s"] / row["eager_tok_s"]
        rows.append(row)
    return rows


def bench_kernel() -> list[dict[str, Any]]:
    tokens, heads, head_dim, groups, state = 4096, 32, 64, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, heads, head_dim, device="cuda", generator=g).bfloat16()
    dt = torch.rand(tokens, heads, device="cuda", generator=g) * 0.1
    A = -torch.rand(heads, device="cuda", generator=g)
    B = torch.randn(tokens, groups, state, device="cuda", generator=g).bfloat16()
    C = torch.randn(tokens, groups, state, device="cuda", generator=g).bfloat16()
    D = torch.ones(heads, device="cuda")
    rows = []
    for name, scan in (("triton", ssd_scan_triton), ("torch_reference", ssd_scan_reference)):
        with torch.no_grad():
            fwd = _time(lambda s=scan: s(x, dt, A, B, C, D, chunk_size=128), 5)
        leaves = [t.clone().requires_grad_() for t in (x, dt, B, C)]

        def step(s=scan, leaves=leaves):
            y, _ = s(leaves[0], leaves[1], A, leaves[2], leaves[3], D, chunk_size=128)
            y.float().sum().backward()

        both = _time(step, 3)
        rows.append({"impl": name, "tokens": tokens, "fwd_ms": 1e3 * fwd, "fwd_bwd_ms": 1e3 * both})
    return rows


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Hybrid Mamba engine benchmark ({result['device']})",
        "",
        f"Model: {result['model']}",
        "",
        "## Prefill (time to first token, ms; lower is better)",
        "",
        "| batch | prompt | decode+non-decode graphs | decode graphs only | eager | transformers fwd | "
        "speedup vs decode-only graphs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["prefill"]:
        lines.append(
            f"| {r['batch']} | {r['prompt']} | {r['all_graphs_ms']:.2f} | {r['decode_graphs_ms']:.2f}"
            f" | {r['eager_ms']:.2f} | {r['transformers_ms']:.2f} | {r['speedup_vs_decode_graphs']:.2f}x |"
        )
    lines += [
        "",
        "## Decode (tokens/s)",
        "",
        "| batch | graphs | eager | speedup |",
        "|---|---|---|---|",
    ]
    for r in result["decode"]:
        lines.append(
            f"| {r['batch']} | {r['all_graphs_tok_s']:.0f} | {r['eager_tok_s']:.0f} | {r['graph_speedup']:.2f}x |"
        )
    lines += ["", "## SSD scan kernel (4096 tokens, 32 heads x 64, state 128, bf16)", ""]
    lines += ["| impl | fwd ms | fwd+bwd ms |", "|---|---|---|"]
    for r in result["kernel"]:
        lines.append(f"| {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the benchmark and write JSON + Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("mamba-results"))
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    import transformers

    model = _model()
    with tempfile.TemporaryDirectory() as directory:
        model.to_hf(directory)
        hf = transformers.NemotronHForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": f"pattern {PATTERN}, hidden 1024, bf16, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters",
        "prefill": bench_prefill(model, hf),
        "decode": bench_decode(model, args.new_tokens),
        "kernel": bench_kernel(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mamba.json").write_text(json.dumps(result, indent=2))
    (args.out / "mamba.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
