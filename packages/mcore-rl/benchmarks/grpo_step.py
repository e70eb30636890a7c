"""One GRPO step of a ~1B policy, phase by phase: 512 sequences x 512 tokens on one GPU.

Generation runs through the mcore-inference engine (CUDA graphs on) with prompts of
``--prompt-tokens`` random ids and no stop token, so every sequence is exactly
``--prompt-tokens + --new-tokens`` long; log-probs, reference log-probs (weights swapped in
from pinned host memory) and the training step run through the same code as ``mcore-rl grpo``.
The ``--group-size`` samples of a prompt share it, as in GRPO: by default the engine prefills
it once (``--share-prompt-prefixes``) and the packed training rows hold it once
(``--share-prompts``); ``--no-share-prompt-prefixes`` / ``--no-share-prompts`` measure without.

The reference point is NeMo-RL's CI bound for this shape, 13.4 s per step on 4 GPUs, as
quoted in the project's benchmark targets (``BENCHMARKS.md``, row "rl"); it is quoted, not
measured here, because NeMo-RL is not installed on the lent GPU.

Every step records ``torch.cuda.memory_allocated()`` at its start (the warm-up step
included); the result file gives the drift of the measured steps relative to the first of
them, which must stay within 1% (nothing accumulates from step to step). The warm-up step's
phases are reported separately: it pays for CUDA-graph capture, Triton compilation and the
allocator's first growth.

Run from the repository root::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-rl/benchmarks/grpo_step.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_rl.config import GRPOConfig
from mcore_rl.distributed import init_worker_state
from mcore_rl.presets import preset
from mcore_rl.rollout import Rollout
from mcore_rl.worker import GRPOWorker

NEMO_RL_BOUND_S = 13.4


def _generate(worker: GRPOWorker, prompts: list[list[int]], new_tokens: int) -> list[Rollout]:
    from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams

    config = InferenceConfig(
        max_batch_size=len(prompts),
        max_sequence_length=len(prompts[0]) + new_tokens,
        max_tokens_per_step=max(8192, len(prompts)),
        use_cuda_graphs=worker.config.rollout.use_cuda_graphs,
        seed=worker.config.run.seed,
        share_prompt_prefixes=worker.config.rollout.share_prompt_prefixes,
    )
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, return_logprobs=True)
    longest = max(len(p) for p in prompts) + new_tokens
    kept = worker.inference.engine_for(longest)  # the run's long-lived engine (keep_engine)
    if kept is not None:
        results = kept.generate(prompts, params)
    else:
        engine = InferenceEngine(worker.inference.model, config)
        try:
            results = engine.generate(prompts, params)
        finally:
            engine.close()
    rng = random.Random(0)
    return [
        Rollout(
            prompt_index=i // worker.config.rollout.group_size,
            prompt_ids=list(p),
            completion_ids=list(r.tokens),
            inference_logprobs=list(r.logprobs or []),
            reward=rng.random(),
            finish_reason="length",
            text="",
        )
        for i, (p, r) in enumerate(zip(prompts, results))
    ]


def main() -> None:
    """Runs warm-up and measured steps and writes JSON and Markdown results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for results.json / results.md")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument(
        "--preset",
        default=None,
        help="start from an mcore-rl preset's model (e.g. gpt-583m) instead of --model",
    )
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--microbatch-tokens",
        type=int,
        default=16384,
        help="tokens per packed row (16384: 32 sequences, half the gradient accumulations of 8192)",
    )
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kl-beta", type=float, default=0.01)
    parser.add_argument(
        "--reference-on-host",
        action="store_true",
        help="keep the reference weights in pinned host memory (default: device memory)",
    )
    parser.add_argument(
        "--share-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack each group's prompt once per row (packing.share_prompts)",
    )
    parser.add_argument(
        "--share-prompt-prefixes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine prefills each group's prompt once (rollout.share_prompt_prefixes)",
    )
    parser.add_argument("--name", default=None, help="stem of the result files")
    args = parser.parse_args()
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    model: dict[str, object] = {"name": args.model, "vocab_size": args.vocab_size, "dtype": dtype}
    if args.preset is not None:
        model = {**asdict(preset(args.preset).model), "dtype": dtype}
        args.model, args.vocab_size = args.preset, int(model["vocab_size"])  # type: ignore[call-overload]
    config = GRPOConfig.from_dict(
        {
            "model": model,
            "run": {"device": args.device, "progress": False},
            "rollout": {
                "num_prompts": args.sequences // args.group_size,
                "group_size": args.group_size,
                "max_new_tokens": args.new_tokens,
                "share_prompt_prefixes": args.share_prompt_prefixes,
            },
            "packing": {
                "max_tokens_per_microbatch": args.microbatch_tokens,
                "share_prompts": args.share_prompts,
            },
            "loss": {
                "kl_beta": args.kl_beta,
                "entropy_coef": 0.1,
                "reference_on_device": not args.reference_on_host,
            },
        }
    )
    state = init_worker_state(config)
    worker = GRPOWorker(config, state)
    rng = random.Random(0)
    vocab = args.vocab_size
    prompts = []
    for _ in range(config.rollout.num_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        prompts.extend([prompt] * config.rollout.group_size)

    def sync() -> None:
        if worker.device.type == "cuda":
            torch.cuda.synchronize()

    measured = []
    allocated: list[int] = []
    warmup: dict[str, float] = {}
    for step in range(args.steps + 1):
        times: dict[str, float] = {}
        sync()
        if worker.device.type == "cuda":
            allocated.append(torch.cuda.memory_allocated())
        start = time.perf_counter()
        with worker.generation_mode():
            rollouts = _generate(worker, prompts, args.new_tokens)
        sync()
        times["generate"] = time.perf_counter() - start
        worker.train_on_rollouts(rollouts, times)
        sync()
        push = time.perf_counter()
        with worker.generation_mode():
            worker.inference.push()
        sync()
        times["push"] = time.perf_counter() - push
        times["total"] = time.perf_counter() - start
        print(f"step {step}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), flush=True)
        if step > 0:
            measured.append(times)
        else:
            warmup = times
    phases = list(measured[0])
    mean = {p: sum(m[p] for m in measured) / len(measured) for p in phases}
    # Drift of the allocation at the start of every measured step against the first of them.
    steady = allocated[1:]
    drift = max((abs(a - steady[0]) / steady[0] for a in steady), default=0.0) if steady else 0.0
    device = torch.cuda.get_device_name() if worker.device.type == "cuda" else "cpu"
    result = {
        "device": device,
        "model": args.model,
        "vocab_size": vocab,
        "sequences": args.sequences,
        "tokens_per_sequence": args.prompt_tokens + args.new_tokens,
        "microbatch_tokens": args.microbatch_tokens,
        "kl_beta": args.kl_beta,
        "reference_on_device": not args.reference_on_host,
        "share_prompts": args.share_prompts,
        "share_prompt_prefixes": args.share_prompt_prefixes,
        "seconds": mean,
        "steps": measured,
        "warmup_step": warmup,
        "allocated_bytes_at_step_start": allocated,
        "allocated_drift": drift,
        "nemo_rl_bound_s_4_gpus": NEMO_RL_BOUND_S,
        "ratio_to_nemo_rl_bound": mean["total"] / NEMO_RL_BOUND_S,
        "peak_allocated_gib": (torch.cuda.max_memory_allocated() / 2**30)
        if worker.device.type == "cuda"
        else 0.0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("results" if args.preset is None else f"results-{args.preset}")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    rows = ["| phase | seconds | warm-up step |", "|---|---|---|"] + [
        f"| {p} | {mean[p]:.2f} | {warmup.get(p, 0.0):.2f} |" for p in phases
    ]
    if allocated:
        gib = ", ".join(f"{a / 2**30:.3f}" for a in allocated)
        rows += [
            "",
            f"Allocated at every step start (GiB, warm-up first): {gib}; drift over the "
            f"{len(steady)} measured steps: {drift:.3%} (bound 1%).",
        ]
    header = (
        f"GRPO step, {args.model} (vocab {vocab}), {args.sequences} x "
        f"{args.prompt_tokens + args.new_tokens} tokens, {device}, kl_beta {args.kl_beta}, "
        f"reference on {'host' if args.reference_on_host else 'device'}, shared prompts in "
        f"training {'on' if args.share_prompts else 'off'} and in generation "
        f"{'on' if args.share_prompt_prefixes else 'off'}; NeMo-RL CI bound "
        f"{NEMO_RL_BOUND_S} s on 4 GPUs (ratio {result['ratio_to_nemo_rl_bound']:.2f})\n\n"
    )
    (out / f"{stem}.md").write_text(header + "\n".join(rows) + "\n")
    print(header + "\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
