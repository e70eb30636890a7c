"""Host time per decode step of the engine's step loop on the CPU, with the forward stubbed out.

The forward of every step returns fixed logits (no model compute), so what is left is the
host's own work per decode step: scheduling, batch building, input packing, the sampler's
launches, the readback and applying the tokens (see ``_decode_profile.host_breakdown`` for the
phases). Each batch size runs with ``InferenceConfig.multi_step_decode`` 1 (one step per host
round trip) and with the values of ``--multi-step``; best of ``--repeats`` timings of
``--tokens`` decode steps.

Run from the repository root (no GPU needed)::

    export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
    python3 packages/mcore-inference/benchmarks/bench_host_step.py --batch-sizes 64,256,512
"""

from __future__ import annotations

import argparse
import json

import torch
from _decode_profile import host_breakdown

from mcore_inference import InferenceConfig, InferenceEngine, SamplingParams
from mcore_inference.stage import StageRunner
from mcore_models import GPTConfig, GPTModel


def main() -> None:
    """Print one JSON line of per-phase host microseconds per decode step for each engine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="64,256,512")
    parser.add_argument("--multi-step", default="8", help="multi_step_decode values besides 1")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *_, **__: None  # type: ignore[assignment]
    vocab = args.vocab
    model = GPTModel(GPTConfig.from_name("tiny", vocab_size=vocab, seed=1)).eval()
    fixed: dict[int, torch.Tensor] = {}

    def stub_forward(self, microbatch, inputs, num_real, max_context, received, **_):
        rows = len(microbatch.sample_rows)
        if rows not in fixed:
            generator = torch.Generator().manual_seed(rows)
            fixed[rows] = torch.randn((rows, vocab), generator=generator)
        return None, fixed[rows]

    StageRunner._eager = stub_forward  # type: ignore[method-assign]
    for batch in (int(b) for b in args.batch_sizes.split(",") if b):
        prompts = torch.randint(
            1, vocab, (batch, 8), generator=torch.Generator().manual_seed(0)
        ).tolist()
        for steps in [1] + [int(s) for s in args.multi_step.split(",") if s]:
            config = InferenceConfig(
                max_batch_size=batch,
                max_sequence_length=16 + 2 * args.tokens,
                multi_step_decode=steps,
            )
            with InferenceEngine(model, config) as engine:
                engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
                timings = [
                    host_breakdown(engine, prompts, args.tokens, SamplingParams)
                    for _ in range(args.repeats)
                ]
            best = min(timings, key=lambda timing: timing["wall"])
            print(
                json.dumps(
                    {"batch": batch, "multi_step_decode": steps}
                    | {key: round(value, 1) for key, value in best.items()}
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
