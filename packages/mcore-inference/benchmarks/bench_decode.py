"""Decode throughput of InferenceEngine against transformers ``generate`` and the HBM roofline.

Workload (docs/benchmarks/inference.md): a Qwen2.5-0.5B-shaped GPT with random bf16 weights,
``--prompt-len`` random prompt tokens per request, ``--new-tokens`` greedy tokens, batch sizes
1 and 64..512. For the engine, decode time is the time of a run generating ``new_tokens + 1``
tokens minus the time of a run generating 1 token (prefill and first token); the engine is
warmed up to the timed run's longest context first, so graph captures (one per block-table
width) and kernel compilation stay out of the timed run. For transformers (same weights,
exported with ``GPTModel.to_hf``, same process), a warm-up call of the timed call's length,
then the time between the first and the last generated token's logits (``new_tokens`` steps)
of the timed call; ``generate`` syncs with the GPU every step, so the host clock follows it.

Roofline: one decode step must read every parameter once plus the KV cache of every request
(at the mean context length); divided by the device-to-device copy bandwidth measured in the
same run, it bounds the tokens per second.

Profile (``--profile-batch-sizes``): kernels (GPU activities) per decode step, GPU time per
step and the GPU busy fraction, from torch.profiler traces of a warm engine with graphs on,
plus the kernels of most GPU time (see ``_decode_profile.py``). ``--compare-unfused`` runs
the engine with ``InferenceConfig(fused_decode=False)`` too (the model's own forward), and
transformers runs with its dynamic cache (``--hf-batch-sizes``) and with
``cache_implementation="static"`` (``--hf-static-batch-sizes``: it then compiles its forward
once per batch size, in the warm-up call).

Run from the repository root on one GPU::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_decode.py --out $OUT/inference
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from _decode_batch_contexts import batch_context_sweep
from _decode_contexts import context_sweep
from _decode_profile import graph_replay_us, host_breakdown, host_split, profile_decode

from mcore_inference import (
    InferenceConfig,
    InferenceEngine,
    SamplingParams,
    fused_decode,
    sample_step,
)
from mcore_models import GPTConfig, GPTModel


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    repeats = 20
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / repeats
    del source, target
    return 2 * (1 << 30) / seconds


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


SAMPLING: dict = {"temperature": 0.0}
"""Sampling parameters of the engine runs besides ``max_tokens`` (``--temperature``,
``--logprobs``; greedy by default)."""

TIMING_REPEATS = 1
"""Timed ``generate`` calls of each length per engine, the fastest kept (``--timing-repeats``)."""

LAST_GRAPH_US: dict[int, float] = {}
"""GPU time of a replay of each captured graph (by table width) of the last engine run."""


def _mcore_decode_seconds(
    model, prompts, new_tokens, *, use_cuda_graphs, profile_tokens=0, split=None, **overrides
) -> tuple[float, float, dict | None, list[list[int]]]:
    batch, prompt_len = len(prompts), len(prompts[0])
    config = InferenceConfig(
        max_batch_size=batch,
        max_sequence_length=prompt_len + new_tokens + 16,
        block_size=16,
        max_tokens_per_step=max(batch * prompt_len, batch),
        prefill_chunk_size=prompt_len,
        use_cuda_graphs=use_cuda_graphs,
        cuda_graph_batch_sizes=(batch,),
        **overrides,
    )
    with InferenceEngine(model, config) as engine:
        engine.generate(prompts, SamplingParams(**SAMPLING, max_tokens=4))  # warm-up
        # A second warm-up whose decode contexts reach the timed run's longest: past the first
        # attention split it captures the full-table graph and compiles the multi-split
        # attention, which would otherwise land inside the timed run (one-time costs).
        long_length = max(prompt_len, prompt_len + new_tokens - 4)
        long_prompt = (prompts[0] * (2 + new_tokens // prompt_len))[:long_length]
        engine.generate([long_prompt], SamplingParams(**SAMPLING, max_tokens=4))
        # Best of TIMING_REPEATS for each (the tokens compared are the first full run's).
        prefill = min(
            _timed(lambda: engine.generate(prompts, SamplingParams(**SAMPLING, max_tokens=1)))
            for _ in range(TIMING_REPEATS)
        )
        results: list = []
        full = _timed(
            lambda: results.extend(
                engine.generate(prompts, SamplingParams(**SAMPLING, max_tokens=new_tokens + 1))
            )
        )
        for _ in range(TIMING_REPEATS - 1):
            full = min(
                full,
                _timed(
                    lambda: engine.generate(
                        prompts, SamplingParams(**SAMPLING, max_tokens=new_tokens + 1)
                    )
                ),
            )
        profile = (
            profile_decode(engine, prompts, profile_tokens, SamplingParams)
            if profile_tokens
            else None
        )
        if split is not None:
            split.update(host_split(engine, prompts, 64, SamplingParams))
            phases = host_breakdown(engine, prompts, 64, SamplingParams)
            split.update({f"phase_{key}_us": value for key, value in phases.items()})
        LAST_GRAPH_US.clear()
        LAST_GRAPH_US.update(graph_replay_us(engine, batch, 64))
    gc.collect()
    return (
        full - prefill,
        prefill,
        profile,
        [
            (result.tokens, result.logprobs) if result.logprobs else result.tokens
            for result in results
        ],
    )


def _hf_decode_seconds(hf_model, prompts, new_tokens, **generate_options) -> tuple[float, float]:
    """``(decode, prefill)`` seconds of transformers ``generate`` for ``new_tokens + 1`` tokens.

    A warm-up call with the same arguments comes first: with a static cache transformers
    compiles its forward for the cache's shape, which depends on the generated length, so a
    warm-up of another length would leave the compilation in the timed call. The timed call
    stamps the host clock whenever a step's logits reach the logits processors (generate reads
    a flag back from the GPU every step, so the host follows the GPU); decode is the time from
    the first token's stamp to the last one's (``new_tokens`` steps), prefill the time before
    the first stamp.
    """
    import transformers

    input_ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(input_ids)

    class _Stamps(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def run(stamps: _Stamps | None = None, count: int = new_tokens + 1) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf_model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList([stamps] if stamps else []),
            **generate_options,
        )
        torch.cuda.synchronize()
        return start

    # Warm-up; with a static cache, of the timed length (its compilation is for that shape).
    run(count=new_tokens + 1 if generate_options else 4)
    stamps = _Stamps()
    start = run(stamps)
    return stamps.times[-1] - stamps.times[0], stamps.times[0] - start


def main() -> None:
    """Run the benchmark and write ``decode.json`` and ``decode.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument(
        "--overrides",
        default="",
        help="GPTConfig fields changed in the preset, e.g. the gpt-583m RL policy: --preset "
        "tiny --overrides hidden_size=1152,num_layers=24,num_attention_heads=16,"
        "num_query_groups=16,ffn_hidden_size=4608,vocab_size=32000,"
        "max_position_embeddings=4096,dtype=bfloat16",
    )
    parser.add_argument("--name", default=None, help="shape name in the result files")
    parser.add_argument("--batch-sizes", default="1,64,256,512")
    parser.add_argument("--hf-batch-sizes", default="1,64,256,512")
    parser.add_argument("--hf-static-batch-sizes", default="1,64,256,512")
    parser.add_argument("--eager-batch-sizes", default="1,64")
    parser.add_argument("--profile-batch-sizes", default="1,64")
    parser.add_argument("--profile-tokens", type=int, default=32)
    parser.add_argument(
        "--host-split-batch-sizes",
        default="1",
        help="batch sizes whose step time is split into host time, GPU waits and the graph's "
        "GPU time alone (see _decode_profile.host_split)",
    )
    parser.add_argument(
        "--compare-single-step",
        default="",
        help="batch sizes also run with InferenceConfig(multi_step_decode=1) (one decode step "
        "per host round trip; with --host-split-batch-sizes also its host split and phases)",
    )
    parser.add_argument(
        "--compare-multi-step",
        default="",
        help="S1/S2@B1/B2: batch sizes B1, B2 also run with InferenceConfig(multi_step_decode=S1) "
        "(then S2)",
    )
    parser.add_argument(
        "--compare-full-row-sampler",
        default="",
        help="batch sizes also run with sample_step.BINARY_SEARCH off (the temperature "
        "sampler's full-row comparison; only matters with --temperature > 0)",
    )
    parser.add_argument(
        "--multi-step",
        type=int,
        default=None,
        help="InferenceConfig.multi_step_decode of the default engine rows (default: the "
        "config's default)",
    )
    parser.add_argument(
        "--compare-unfused",
        action="store_true",
        help="also run the engine with InferenceConfig(fused_decode=False)",
    )
    parser.add_argument(
        "--compare-pdl",
        action="store_true",
        help="also run the engine with InferenceConfig.decode_pdl flipped from its default",
    )
    parser.add_argument(
        "--compare-attention-in-o-proj",
        default="",
        help="batch sizes also run with the fused decoder's attention in the o projection "
        "(fused_decode.ATTENTION_IN_O_PROJ) flipped from its default",
    )
    parser.add_argument(
        "--compare-attention-split",
        default="",
        help="SIZE@B1/B2: batch sizes B1, B2 also run with InferenceConfig(attention_split_size"
        "=SIZE)",
    )
    parser.add_argument(
        "--compare-down-splits",
        default="",
        help="S1/S2@B1/B2: batch sizes B1, B2 also run with the down projection in S1 (then "
        "S2) float32 split-K partials summed by the next norm (fused_decode.DOWN_PROJ_SPLITS)",
    )
    parser.add_argument(
        "--compare-o-splits",
        default="",
        help="S1/S2@B1/B2: as --compare-down-splits for the o projection (O_PROJ_SPLITS)",
    )
    parser.add_argument(
        "--compare-norm-pdl",
        default="",
        help="batch sizes also run with fused_decode.NORM_SWIGLU_PDL flipped",
    )
    parser.add_argument(
        "--repeat-default",
        default="",
        help="batch sizes whose default engine runs a second time after the variants (the "
        "spread of two runs of one setting)",
    )
    parser.add_argument(
        "--context-sweep",
        default="",
        help="context lengths at which the captured batch-1 step is timed with the attention "
        "inside the o projection and before it (see _decode_contexts.py)",
    )
    parser.add_argument(
        "--batch-context-sweep",
        default="",
        help="B1/B2@C1/C2: GPU time of the captured step of batch B at context C (every row), "
        "with the context-free part and the attention's cache bandwidth fitted per batch (see "
        "_decode_batch_contexts.py)",
    )
    parser.add_argument(
        "--hf-new-tokens",
        type=int,
        default=None,
        help="tokens timed for transformers (default: --new-tokens); its step time hardly "
        "depends on the context, so fewer steps measure the same rate in less time",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the engine runs (0: greedy; the token comparisons then "
        "compare seeded samples)",
    )
    parser.add_argument(
        "--logprobs", action="store_true", help="the engine runs return log-probabilities"
    )
    parser.add_argument(
        "--timing-repeats",
        type=int,
        default=1,
        help="timed generate calls of each length per engine, the fastest kept (the decode "
        "time is a difference of two calls: one slow call moves it by its whole delay)",
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    started = time.perf_counter()
    SAMPLING.update(temperature=args.temperature, return_logprobs=args.logprobs)
    global TIMING_REPEATS
    TIMING_REPEATS = max(1, args.timing_repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    hf_batch_sizes = {int(b) for b in args.hf_batch_sizes.split(",") if b}
    eager_batch_sizes = {int(b) for b in args.eager_batch_sizes.split(",") if b}
    hf_static_batch_sizes = {int(b) for b in args.hf_static_batch_sizes.split(",") if b}
    profile_batch_sizes = {int(b) for b in args.profile_batch_sizes.split(",") if b}
    split_batch_sizes = {int(b) for b in args.host_split_batch_sizes.split(",") if b}
    o_proj_batch_sizes = {int(b) for b in args.compare_attention_in_o_proj.split(",") if b}
    repeat_batch_sizes = {int(b) for b in args.repeat_default.split(",") if b}
    norm_pdl_batch_sizes = {int(b) for b in args.compare_norm_pdl.split(",") if b}
    split_size, _, split_batches = args.compare_attention_split.partition("@")
    attention_split_batch_sizes = {int(b) for b in split_batches.split("/") if b}
    down_splits, _, down_batches = args.compare_down_splits.partition("@")
    down_split_counts = [int(s) for s in down_splits.split("/") if s]
    down_batch_sizes = {int(b) for b in down_batches.split("/") if b}
    o_splits, _, o_batches = args.compare_o_splits.partition("@")
    o_split_counts = [int(s) for s in o_splits.split("/") if s]
    o_batch_sizes = {int(b) for b in o_batches.split("/") if b}
    hf_new_tokens = args.hf_new_tokens or args.new_tokens
    single_step_batch_sizes = {int(b) for b in args.compare_single_step.split(",") if b}
    full_row_batch_sizes = {int(b) for b in args.compare_full_row_sampler.split(",") if b}
    multi_steps, _, multi_batches = args.compare_multi_step.partition("@")
    multi_step_counts = [int(s) for s in multi_steps.split("/") if s]
    multi_step_batch_sizes = {int(b) for b in multi_batches.split("/") if b}
    engine_defaults = {} if args.multi_step is None else {"multi_step_decode": args.multi_step}

    overrides = dict(item.split("=", 1) for item in args.overrides.split(",") if item)
    config = GPTConfig.from_name(
        args.preset, **{k: v if k == "dtype" else int(v) for k, v in overrides.items()}
    )
    name = args.name or args.preset
    model = GPTModel(config, device=device).eval()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.kv_channels * 2
    bandwidth = _copy_bandwidth(device)
    generator = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(
        0, config.vocab_size, (max(batch_sizes), args.prompt_len), generator=generator
    ).tolist()

    hf_model = None
    if hf_batch_sizes or hf_static_batch_sizes:
        import transformers

        checkpoint = tempfile.mkdtemp(prefix="bench_decode_")
        model.to_hf(checkpoint)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).to(device)
        hf_model.eval()

    def write() -> None:
        _write_results(out, args, rows, profiles, started, meta)

    meta = {
        "device": torch.cuda.get_device_name(device),
        "name": name,
        "overrides": overrides,
        "dtype": str(config.dtype),
        "hf_new_tokens": hf_new_tokens,
        "parameter_bytes": param_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "bandwidth": bandwidth,
        "context_sweep": [],
        "batch_context_sweep": [],
    }
    rows, profiles = [], []
    for batch in batch_sizes:
        prompts = all_prompts[:batch]
        generated = batch * args.new_tokens
        mean_context = args.prompt_len + args.new_tokens / 2
        step_bytes = param_bytes + batch * mean_context * kv_bytes_per_token
        roofline = batch / (step_bytes / bandwidth)
        split: dict | None = {} if batch in split_batch_sizes else None
        decode, prefill, profile, tokens = _mcore_decode_seconds(
            model,
            prompts,
            args.new_tokens,
            use_cuda_graphs=True,
            profile_tokens=args.profile_tokens if batch in profile_batch_sizes else 0,
            split=split,
            **engine_defaults,
        )
        row = {
            "batch": batch,
            "mcore_graph_us": dict(LAST_GRAPH_US),
            "mcore_tokens_per_s": generated / decode,
            "mcore_decode_s": decode,
            "mcore_prefill_s": prefill,
            "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": generated / decode / roofline,
        }
        if split:
            row.update({f"step_{key}": value for key, value in split.items()})
        if profile is not None:
            # Busy fraction against the unprofiled step time of the throughput run.
            profile["gpu_busy_fraction_unprofiled"] = profile["gpu_us_per_step"] / (
                1e6 * decode / args.new_tokens
            )
            profiles.append(profile)
            row["kernels_per_step"] = profile["kernels_per_step"]
            row["gpu_busy_fraction"] = profile["gpu_busy_fraction_unprofiled"]
        if batch in single_step_batch_sizes:
            single_split: dict | None = {} if batch in split_batch_sizes else None
            single, _, single_profile, single_tokens = _mcore_decode_seconds(
                model,
                prompts,
                args.new_tokens,
                use_cuda_graphs=True,
                profile_tokens=args.profile_tokens if batch in profile_batch_sizes else 0,
                split=single_split,
                multi_step_decode=1,
            )
            if single_profile is not None:
                row["single_step_profile"] = {
                    key: single_profile[key]
                    for key in (
                        "kernels_per_step",
                        "gpu_us_per_step",
                        "wall_us_per_step",
                        "busy_span_us_per_step",
                        "idle_us_per_step",
                        "idle_before",
                    )
                }
            row["mcore_single_step_tokens_per_s"] = generated / single
            row["mcore_single_step_graph_us"] = dict(LAST_GRAPH_US)
            row["single_step_tokens_equal"] = single_tokens == tokens
            if single_split:
                row.update({f"single_step_{key}": value for key, value in single_split.items()})
        if batch in full_row_batch_sizes:
            sample_step.BINARY_SEARCH = False
            try:
                other, _, _, other_tokens = _mcore_decode_seconds(
                    model, prompts, args.new_tokens, use_cuda_graphs=True
                )
            finally:
                sample_step.BINARY_SEARCH = True
            row["mcore_full_row_sampler_tokens_per_s"] = generated / other
            row["full_row_sampler_tokens_equal"] = other_tokens == tokens
        for count in multi_step_counts if batch in multi_step_batch_sizes else ():
            other, _, _, other_tokens = _mcore_decode_seconds(
                model, prompts, args.new_tokens, use_cuda_graphs=True, multi_step_decode=count
            )
            row[f"mcore_multi_step_{count}_tokens_per_s"] = generated / other
            row[f"multi_step_{count}_tokens_equal"] = other_tokens == tokens
        if args.compare_unfused:
            unfused, _, _, _ = _mcore_decode_seconds(
                model, prompts, args.new_tokens, use_cuda_graphs=True, fused_decode=False
            )
            row["mcore_unfused_tokens_per_s"] = generated / unfused
            row["mcore_unfused_graph_us"] = dict(LAST_GRAPH_US)
        if args.compare_pdl:
            flipped, _, _, flipped_tokens = _mcore_decode_seconds(
                model,
                prompts,
                args.new_tokens,
                use_cuda_graphs=True,
                decode_pdl=not InferenceConfig().decode_pdl,
            )
            row["mcore_pdl_flipped_tokens_per_s"] = generated / flipped
            row["mcore_pdl_flipped_graph_us"] = dict(LAST_GRAPH_US)
            row["pdl_flipped_tokens_equal"] = flipped_tokens == tokens
        if batch in o_proj_batch_sizes:
            default = fused_decode.ATTENTION_IN_O_PROJ
            fused_decode.ATTENTION_IN_O_PROJ = not default
            try:
                flipped, _, _, flipped_tokens = _mcore_decode_seconds(
                    model, prompts, args.new_tokens, use_cuda_graphs=True
                )
            finally:
                fused_decode.ATTENTION_IN_O_PROJ = default
            row["mcore_o_proj_flipped_tokens_per_s"] = generated / flipped
            row["mcore_o_proj_flipped_graph_us"] = dict(LAST_GRAPH_US)
            row["o_proj_flipped_tokens_equal"] = flipped_tokens == tokens
        if batch in norm_pdl_batch_sizes:
            fused_decode.NORM_SWIGLU_PDL = not fused_decode.NORM_SWIGLU_PDL
            try:
                flipped, _, _, flipped_tokens = _mcore_decode_seconds(
                    model, prompts, args.new_tokens, use_cuda_graphs=True
                )
            finally:
                fused_decode.NORM_SWIGLU_PDL = not fused_decode.NORM_SWIGLU_PDL
            row["mcore_norm_pdl_flipped_tokens_per_s"] = generated / flipped
            row["mcore_norm_pdl_flipped_graph_us"] = dict(LAST_GRAPH_US)
            row["norm_pdl_flipped_tokens_equal"] = flipped_tokens == tokens
        for splits in down_split_counts if batch in down_batch_sizes else ():
            saved_splits = fused_decode.DOWN_PROJ_SPLITS
            fused_decode.DOWN_PROJ_SPLITS = (splits, 1 << 20)
            try:
                other, _, _, other_tokens = _mcore_decode_seconds(
                    model, prompts, args.new_tokens, use_cuda_graphs=True
                )
            finally:
                fused_decode.DOWN_PROJ_SPLITS = saved_splits
            row[f"mcore_down_splits_{splits}_tokens_per_s"] = generated / other
            row[f"mcore_down_splits_{splits}_graph_us"] = dict(LAST_GRAPH_US)
            row[f"down_splits_{splits}_tokens_equal"] = other_tokens == tokens
        for splits in o_split_counts if batch in o_batch_sizes else ():
            saved_splits = fused_decode.O_PROJ_SPLITS
            fused_decode.O_PROJ_SPLITS = (splits, 1 << 20)
            try:
                other, _, _, other_tokens = _mcore_decode_seconds(
                    model, prompts, args.new_tokens, use_cuda_graphs=True
                )
            finally:
                fused_decode.O_PROJ_SPLITS = saved_splits
            row[f"mcore_o_splits_{splits}_tokens_per_s"] = generated / other
            row[f"mcore_o_splits_{splits}_graph_us"] = dict(LAST_GRAPH_US)
            row[f"o_splits_{splits}_tokens_equal"] = other_tokens == tokens
        if batch in attention_split_batch_sizes:
            other, _, _, _ = _mcore_decode_seconds(
                model,
                prompts,
                args.new_tokens,
                use_cuda_graphs=True,
                attention_split_size=int(split_size),
            )
            row[f"mcore_split_{split_size}_tokens_per_s"] = generated / other
            row[f"mcore_split_{split_size}_graph_us"] = dict(LAST_GRAPH_US)
        if batch in repeat_batch_sizes:
            again, _, _, _ = _mcore_decode_seconds(
                model, prompts, args.new_tokens, use_cuda_graphs=True
            )
            row["mcore_repeat_tokens_per_s"] = generated / again
            row["mcore_repeat_graph_us"] = dict(LAST_GRAPH_US)
        if batch in eager_batch_sizes:
            eager, _, _, eager_tokens = _mcore_decode_seconds(
                model, prompts, args.new_tokens, use_cuda_graphs=False
            )
            row["mcore_eager_tokens_per_s"] = generated / eager
            row["mcore_eager_graph_us"] = dict(LAST_GRAPH_US)
            # Greedy tokens of the graph engine against the eager engine, token for token.
            row["eager_tokens_equal"] = eager_tokens == tokens
        rows.append(row)
        print(json.dumps(row), flush=True)
        write()  # after every engine row: a cut run keeps what it measured

    sweep = [int(c) for c in args.context_sweep.split(",") if c]
    meta["context_sweep"] = context_sweep(model, sweep) if sweep else []
    write()
    sweep_batches, _, sweep_contexts = args.batch_context_sweep.partition("@")
    if sweep_batches:
        meta["batch_context_sweep"] = batch_context_sweep(
            model,
            [int(b) for b in sweep_batches.split("/") if b],
            [int(c) for c in sweep_contexts.split("/") if c],
        )
        write()
    # The peers after every engine row, the files rewritten after each (the compilation of
    # transformers' static cache takes long: a cut run keeps what it measured).
    for row in rows:
        batch = row["batch"]
        prompts = all_prompts[:batch]
        if hf_model is not None and batch in hf_batch_sizes:
            hf_decode, hf_prefill = _hf_decode_seconds(hf_model, prompts, hf_new_tokens)
            row["hf_tokens_per_s"] = batch * hf_new_tokens / hf_decode
            row["hf_prefill_s"] = hf_prefill
            row["speedup_vs_hf"] = row["mcore_tokens_per_s"] / row["hf_tokens_per_s"]
            print(json.dumps({"batch": batch, "hf_tokens_per_s": row["hf_tokens_per_s"]}))
            write()
    for row in rows:
        batch = row["batch"]
        prompts = all_prompts[:batch]
        if hf_model is not None and batch in hf_static_batch_sizes:
            static_decode, _ = _hf_decode_seconds(
                hf_model, prompts, hf_new_tokens, cache_implementation="static"
            )
            row["hf_static_tokens_per_s"] = batch * hf_new_tokens / static_decode
            row["speedup_vs_hf_static"] = row["mcore_tokens_per_s"] / row["hf_static_tokens_per_s"]
            print(
                json.dumps(
                    {"batch": batch, "hf_static_tokens_per_s": row["hf_static_tokens_per_s"]}
                ),
                flush=True,
            )
            write()
    print((out / f"{'decode' if args.name is None else f'decode-{args.name}'}.md").read_text())


def _write_results(
    out: Path, args: argparse.Namespace, rows: list, profiles: list, started: float, meta: dict
) -> None:
    """Write ``decode.json`` and ``decode.md`` (``decode-<name>`` when named) under ``out``."""
    name, bandwidth, hf_new_tokens = meta["name"], meta["bandwidth"], meta["hf_new_tokens"]
    result = {
        "benchmark": "decode",
        "device": meta["device"],
        "torch": torch.__version__,
        "preset": args.preset,
        "overrides": meta["overrides"],
        "name": name,
        "dtype": meta["dtype"],
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "hf_new_tokens": hf_new_tokens,
        "parameter_bytes": meta["parameter_bytes"],
        "kv_bytes_per_token": meta["kv_bytes_per_token"],
        "copy_bandwidth_bytes_per_s": bandwidth,
        "decode_pdl": InferenceConfig().decode_pdl,
        "multi_step_decode": args.multi_step or InferenceConfig().multi_step_decode,
        "sampling": dict(SAMPLING),
        "timing_repeats": TIMING_REPEATS,
        "attention_in_o_proj": fused_decode.ATTENTION_IN_O_PROJ,
        "norm_swiglu_pdl": fused_decode.NORM_SWIGLU_PDL,
        "o_proj_splits": fused_decode.O_PROJ_SPLITS,
        "down_proj_splits": fused_decode.DOWN_PROJ_SPLITS,
        "rows": rows,
        "profiles": profiles,
        "context_sweep": meta["context_sweep"],
        "batch_context_sweep": meta["batch_context_sweep"],
        "elapsed_s": time.perf_counter() - started,
    }
    stem = "decode" if args.name is None else f"decode-{args.name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Decode, {name} shape (random bf16 weights), prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, greedy; {result['device']}, copy "
        f"{bandwidth / 1e12:.2f} TB/s; mcore with decode_pdl={result['decode_pdl']} (the PDL "
        f"column flips it); transformers timed over {hf_new_tokens} steps.",
        "",
        "| batch | mcore tok/s | roofline tok/s | of roofline | HF tok/s | vs HF | "
        "HF static tok/s | vs HF static | PDL flipped tok/s | unfused tok/s | eager tok/s | "
        "kernels/step | GPU busy |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if value is not None else "-"

    for row in rows:
        lines.append(
            f"| {row['batch']} | {row['mcore_tokens_per_s']:.0f} | "
            f"{row['roofline_tokens_per_s']:.0f} | {100 * row['fraction_of_roofline']:.0f}% | "
            f"{cell(row, 'hf_tokens_per_s', '.0f')} | {cell(row, 'speedup_vs_hf', '.1f')} | "
            f"{cell(row, 'hf_static_tokens_per_s', '.0f')} | "
            f"{cell(row, 'speedup_vs_hf_static', '.1f')} | "
            f"{cell(row, 'mcore_pdl_flipped_tokens_per_s', '.0f')} | "
            f"{cell(row, 'mcore_unfused_tokens_per_s', '.0f')} | "
            f"{cell(row, 'mcore_eager_tokens_per_s', '.0f')} | "
            f"{cell(row, 'kernels_per_step', '.0f')} | {cell(row, 'gpu_busy_fraction', '.0%')} |"
        )
    for row in rows:
        for key, what in (
            ("eager_tokens_equal", "the eager engine (no CUDA graphs)"),
            ("pdl_flipped_tokens_equal", "the engine with decode_pdl flipped"),
        ):
            if key in row:
                lines += ["", f"Batch {row['batch']}: greedy tokens equal to {what}: {row[key]}."]
    for row in rows:
        if "mcore_o_proj_flipped_tokens_per_s" in row:
            lines += [
                "",
                f"Batch {row['batch']}: with the fused decoder's attention in the o projection "
                f"{'off' if result['attention_in_o_proj'] else 'on'} (the default flipped): "
                f"{row['mcore_o_proj_flipped_tokens_per_s']:.0f} tok/s; greedy tokens equal: "
                f"{row['o_proj_flipped_tokens_equal']} (another summation order: they may "
                "differ).",
            ]
    for row in rows:
        variants = [
            f"{key.removeprefix('mcore_').removesuffix('_tokens_per_s')} {value:.0f}"
            for key, value in row.items()
            if key.endswith("_tokens_per_s")
            and key.startswith(
                (
                    "mcore_repeat_",
                    "mcore_norm_pdl_",
                    "mcore_split_",
                    "mcore_down_splits_",
                    "mcore_o_splits_",
                    "mcore_multi_step_",
                    "mcore_full_row_sampler_",
                )
            )
        ]
        graph_times = [
            f"{key[len('mcore_') : -len('graph_us')].rstrip('_') or 'default'} "
            + "/".join(f"{us:.0f}" for _, us in sorted(value.items()))
            for key, value in row.items()
            if key.endswith("graph_us") and value
        ]
        if graph_times:
            lines += [
                "",
                f"Batch {row['batch']}, GPU us of one captured step (replays back to back; "
                f"narrow/full table): {'; '.join(graph_times)}.",
            ]
        if variants:
            equal = {
                k: v
                for k, v in row.items()
                if k.startswith(
                    ("norm_pdl_", "down_splits_", "o_splits_", "multi_step_", "full_row_sampler_")
                )
            }
            lines += [
                "",
                f"Batch {row['batch']}, tok/s of variants (default "
                f"{row['mcore_tokens_per_s']:.0f}): {'; '.join(variants)}; greedy tokens "
                f"equal to the default: {equal}.",
            ]
    if meta["context_sweep"]:
        lines += [
            "",
            "Batch 1, GPU time of the captured step (every layer and the LM head, graph replays "
            "back to back) by context length, with the attention inside the o projection "
            "(`FusedDecoder(attention_in_o_proj=True)`: the attention in splits of 32 "
            "positions, merged by the o projection) and with the attention kernel before it "
            "(splits of 256 walked tile by tile, a merge kernel past 256):",
            "",
            "| context | attention in o us | attention kernel us | gain | same argmax |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['context']} | {r['fused_us']:.1f} | {r['unfused_us']:.1f} | "
            f"{r['unfused_us'] / r['fused_us']:.3f}x | {r['argmax_equal']} |"
            for r in meta["context_sweep"]
        ]
    if meta["batch_context_sweep"]:
        lines += [
            "",
            "GPU time of the captured step (every layer and the LM head, graph replays back to "
            "back, every row at the context) by batch and context; a line fitted per batch: the "
            "context-free part and the cache bytes the attention reads per second (copy "
            f"bandwidth {bandwidth / 1e12:.2f} TB/s):",
            "",
            "| batch | step us by context | context-free us | us per context token | "
            "attention TB/s |",
            "|---:|---|---:|---:|---:|",
        ]
        lines += [
            f"| {r['batch']} | "
            + ", ".join(f"{c}: {t:.0f}" for c, t in zip(r["contexts"], r["step_us"], strict=True))
            + f" | {r['fixed_us']:.0f} | {r['us_per_context_token']:.3f} | "
            f"{r['attention_bytes_per_s'] / 1e12:.2f} |"
            for r in meta["batch_context_sweep"]
        ]
    for row in rows:
        if "step_host_us_per_step" in row:
            lines += [
                "",
                f"Batch {row['batch']}, where a step's time goes (64 steps of a warm engine): "
                f"{row['step_wall_us_per_step']:.0f} us per step, of which the host's own work "
                f"{row['step_host_us_per_step']:.0f} us and its waits for the GPU "
                f"{row['step_wait_us_per_step']:.0f} us; the captured step alone (graph "
                f"replays back to back, no sampling) takes "
                f"{row.get('step_graph_us_per_step', float('nan')):.0f} us of GPU time.",
            ]
    phase_rows = [
        (row["batch"], label, {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)})
        for row in rows
        for label, prefix in (
            ("default", "step_phase_"),
            ("multi_step_decode=1", "single_step_phase_"),
        )
        if any(k.startswith(prefix) for k in row)
    ]
    if phase_rows:
        names = [key for key in phase_rows[0][2] if key != "wall_us"]
        lines += [
            "",
            "Host time per decode step by phase of the step loop (us; 64 steps of a warm "
            "engine, wall-clock timers around each phase; forward launch includes the graph "
            "replays and, with multi-step decode, the device-side sampling of every step):",
            "",
            "| batch | engine | wall | " + " | ".join(n.removesuffix("_us") for n in names) + " |",
            "|---:|---|---:|" + "---:|" * len(names),
        ]
        lines += [
            f"| {batch} | {label} | {phases.get('wall_us', float('nan')):.0f} | "
            + " | ".join(f"{phases.get(n, float('nan')):.0f}" for n in names)
            + " |"
            for batch, label, phases in phase_rows
        ]
    for row in rows:
        if "mcore_single_step_tokens_per_s" in row:
            lines += [
                "",
                f"Batch {row['batch']}: one decode step per host round trip "
                f"(multi_step_decode=1) {row['mcore_single_step_tokens_per_s']:.0f} tok/s "
                f"against {row['mcore_tokens_per_s']:.0f}; greedy tokens equal: "
                f"{row['single_step_tokens_equal']}.",
            ]
            if "single_step_profile" in row:
                single_profile = row["single_step_profile"]
                lines[-1] += (
                    f" Its profile: {single_profile['kernels_per_step']:.0f} GPU activities, "
                    f"{single_profile['gpu_us_per_step']:.0f} us of GPU time, busy "
                    f"{single_profile['busy_span_us_per_step']:.0f} us and idle "
                    f"{single_profile['idle_us_per_step']:.0f} us per step."
                )
            if "single_step_host_us_per_step" in row:
                lines[-1] += (
                    f" Its host work {row['single_step_host_us_per_step']:.0f} us and "
                    f"waits {row['single_step_wait_us_per_step']:.0f} us per step."
                )
    for profile in profiles:
        lines += [
            "",
            f"Profile at batch {profile['batch']} ({profile['profiled_tokens']} decode steps): "
            f"{profile['kernels_per_step']:.0f} GPU activities and "
            f"{profile['gpu_us_per_step']:.0f} us of GPU time per step (kernels overlap under "
            f"PDL); the GPU busy {profile['busy_span_us_per_step']:.0f} us and idle "
            f"{profile['idle_us_per_step']:.0f} us per step; wall "
            f"{profile['wall_us_per_step']:.0f} us per step under the profiler. Critical: how "
            "much later each kernel makes the busy span end (they sum to the busy span).",
            "",
            "| kernel | per step | us per step | critical us per step |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{k['name'][:80]}` | {k['per_step']:.1f} | {k['us_per_step']:.1f} | "
            f"{k['critical_us_per_step']:.1f} |"
            for k in profile["top_kernels"]
        ]
        if profile.get("idle_before"):
            gaps = "; ".join(
                f"`{k['name'][:60]}` {k['idle_us_per_step']:.1f} us" for k in profile["idle_before"]
            )
            lines += ["", f"Idle time per step by the activity that ends the gap: {gaps}."]
    lines.append("")
    lines.append(f"Benchmark wall time {result['elapsed_s']:.0f} s.")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
