"""Decode of an MLA model with the latent KV cache against the same model with an MHA-equivalent
cache (up-projected per-head keys and values), in one run on one GPU.

Workload: a dense MLA GPT shaped like DeepSeek-V2-Lite's attention (hidden 2048, 16 heads,
``kv_lora_rank`` 512, rotary 64, no-position 128, value 128, full-rank queries; 12 layers to stay
inside the time budget) with random bf16 weights, ``--prompt-len`` random prompt tokens per
request, ``--new-tokens`` greedy tokens, CUDA graphs on. Decode time is the time of a run
generating ``new_tokens + 1`` tokens minus that of a run generating 1 token (both synchronized);
a request that fails or stops short raises instead of yielding a meaningless time. Batch sizes
still waiting once ``--budget-s`` seconds have passed are skipped (and listed as skipped) so
that the results are always written. KV bytes per token
are measured from the engine's cache storage (``cache.nbytes`` / token slots). A kernel
comparison times the paged absorbed-MLA attention against the paged attention over the
up-projected heads at the same contexts (``triton.testing.do_bench``).

Run from the repository root on one GPU (well under a minute on one H100)::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_mla_decode.py --out $OUT/mla
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_kernels.mla_paged_attention import paged_mla_attention
from mcore_kernels.paged_attention import paged_attention
from mcore_models import GPTConfig, GPTModel


def _model_config(layers: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=layers,
        num_attention_heads=16,
        ffn_hidden_size=5632,
        max_position_embeddings=8192,
        dtype="bfloat16",
        attention_type="mla",
        mla=dict(
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    )


def _timed(fn: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _generate(engine: InferenceEngine, prompts: list[list[int]], max_tokens: int) -> list:
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for result in results:
        if len(result.tokens) != max_tokens:
            raise RuntimeError(
                f"a request produced {len(result.tokens)} tokens, expected {max_tokens} "
                f"(finish reason {result.finish_reason}, error {result.error!r})"
            )
    return results


def _decode(model: GPTModel, prompts: list[list[int]], new_tokens: int, latent: bool) -> dict:
    batch, prompt_len = len(prompts), len(prompts[0])
    config = InferenceConfig(
        max_batch_size=batch,
        max_sequence_length=prompt_len + new_tokens + 16,
        block_size=16,
        max_tokens_per_step=batch * prompt_len,
        prefill_chunk_size=prompt_len,
        cuda_graph_batch_sizes=(batch,),
        mla_latent_kv_cache=latent,
    )
    with InferenceEngine(model, config) as engine:
        cache = engine.kv_cache
        assert cache is not None
        slots = cache.keys.shape[1] * cache.block_size
        bytes_per_token = cache.nbytes / slots
        _generate(engine, prompts, 4)  # warm-up: compilation and CUDA graph capture
        prefill = _timed(lambda: _generate(engine, prompts, 1))
        tokens: list[list[int]] = []

        def run() -> None:
            tokens.extend(r.tokens for r in _generate(engine, prompts, new_tokens + 1))

        full = _timed(run)
    gc.collect()
    torch.cuda.empty_cache()
    decode = full - prefill
    if decode <= 0:
        raise RuntimeError(f"decode time {decode:.6f} s <= 0 (full run {full:.6f} s)")
    return {
        "tokens_per_s": batch * new_tokens / decode,
        "decode_s": decode,
        "kv_bytes_per_token": bytes_per_token,
        "tokens": tokens,
    }


def _kernel_times(config: GPTConfig, batch: int, context: int) -> dict[str, float]:
    """Milliseconds of one layer's decode attention: absorbed-latent vs up-projected heads."""
    import triton.testing

    mla = config.mla
    assert mla is not None
    heads, block = config.num_attention_heads, 16
    blocks = batch * (context // block)
    device = torch.device("cuda")
    tables = torch.arange(blocks, dtype=torch.int32, device=device).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    dtype = torch.bfloat16
    latent = torch.randn(blocks, block, mla.latent_dim, dtype=dtype, device=device)
    q_latent = torch.randn(batch, heads, mla.kv_lora_rank, dtype=dtype, device=device)
    q_rope = torch.randn(batch, heads, mla.qk_rope_head_dim, dtype=dtype, device=device)
    keys = torch.randn(blocks, block, heads, mla.qk_head_dim, dtype=dtype, device=device)
    values = torch.randn_like(keys)
    q = torch.randn(batch, heads, mla.qk_head_dim, dtype=dtype, device=device)
    scale = mla.softmax_scale
    latent_ms = triton.testing.do_bench(
        lambda: paged_mla_attention(q_latent, q_rope, latent, tables, lens, scale=scale)
    )
    heads_ms = triton.testing.do_bench(
        lambda: paged_attention(q, keys, values, tables, lens, scale=scale)
    )
    return {"latent_ms": latent_ms, "heads_ms": heads_ms}


def main() -> None:
    """Run the benchmark and write ``mla_decode.json`` and ``mla_decode.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kernel-contexts", default="1024,4096")
    parser.add_argument(
        "--budget-s", type=float, default=40.0, help="skip batch sizes not started by then"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = _model_config(args.layers)
    model = GPTModel(config, device="cuda").eval()
    generator = torch.Generator().manual_seed(0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    all_prompts = torch.randint(
        0, config.vocab_size, (max(batch_sizes), args.prompt_len), generator=generator
    ).tolist()
    rows = []
    skipped = []
    for batch in batch_sizes:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(batch)
            continue
        prompts = all_prompts[:batch]
        latent = _decode(model, prompts, args.new_tokens, latent=True)
        heads = _decode(model, prompts, args.new_tokens, latent=False)
        same = sum(a == b for a, b in zip(latent.pop("tokens"), heads.pop("tokens")))
        row = {
            "batch": batch,
            "latent": latent,
            "mha_equivalent": heads,
            "speedup": heads["decode_s"] / latent["decode_s"],
            "kv_bytes_ratio": heads["kv_bytes_per_token"] / latent["kv_bytes_per_token"],
            "identical_sequences": same,
        }
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - started:.1f} s)", flush=True)
    kernel_rows = []
    for context in (int(c) for c in args.kernel_contexts.split(",")):
        for batch in (1, 64):
            times = _kernel_times(config, batch, context)
            kernel_rows.append({"batch": batch, "context": context, **times})
            print(json.dumps(kernel_rows[-1]), flush=True)
    mla = config.mla
    assert mla is not None
    result = {
        "benchmark": "mla_decode",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": {
            "layers": config.num_layers,
            "hidden": config.hidden_size,
            "heads": config.num_attention_heads,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "dtype": "bfloat16",
        },
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
        "skipped_batch_sizes": skipped,
        "kernel_rows": kernel_rows,
    }
    (out / "mla_decode.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"MLA decode, {config.num_layers} layers x 16 heads, kv_lora_rank 512 + rope 64 "
        f"(random bf16 weights), prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
        f"CUDA graphs; {result['device']}.",
        "",
        "| batch | latent tok/s | MHA-equivalent tok/s | speedup | latent KV B/token | "
        "MHA-equivalent KV B/token | ratio | same sequences |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lat, mha = row["latent"], row["mha_equivalent"]
        lines.append(
            f"| {row['batch']} | {lat['tokens_per_s']:.0f} | {mha['tokens_per_s']:.0f} | "
            f"{row['speedup']:.2f}x | {lat['kv_bytes_per_token']:.0f} | "
            f"{mha['kv_bytes_per_token']:.0f} | {row['kv_bytes_ratio']:.1f}x | "
            f"{row['identical_sequences']}/{row['batch']} |"
        )
    if skipped:
        lines += ["", f"Skipped (time budget {args.budget_s:.0f} s): batch {skipped}."]
    lines += [
        "",
        "One layer's decode attention (bf16, block 16):",
        "",
        "| batch | context | absorbed latent ms | up-projected heads ms | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in kernel_rows:
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['latent_ms']:.3f} | "
            f"{row['heads_ms']:.3f} | {row['heads_ms'] / row['latent_ms']:.2f}x |"
        )
    (out / "mla_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
