"""``mcore-inference generate``: generate text with a Hugging Face checkpoint directory;
``mcore-inference serve``: serve it over HTTP (see :mod:`mcore_inference.serve`).

The directory needs ``config.json``, safetensors weights (loaded by
``mcore_models.GPTModel.from_hf``) and ``tokenizer.json`` (read with the ``tokenizers`` package,
extra ``hf``). The end-of-sequence ids of ``generation_config.json`` / ``config.json`` stop
generation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from mcore_inference.config import InferenceConfig, SamplingParams
from mcore_inference.engine import InferenceEngine
from mcore_inference.serve.cli import add_serve_arguments, run_serve

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line parser.

    Returns:
        The parser of ``mcore-inference``.
    """
    parser = argparse.ArgumentParser(prog="mcore-inference", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    generate.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    defaults = SamplingParams()
    generate.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    generate.add_argument("--top-k", type=int, default=defaults.top_k, help="top-k (0: off)")
    generate.add_argument("--top-p", type=float, default=defaults.top_p, help="nucleus top-p")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--device", default=None, help="device (default: cuda if available)")
    generate.add_argument("--dtype", default=None, help="parameter dtype (default: checkpoint)")
    generate.add_argument(
        "--max-sequence-length", type=int, default=2048, help="prompt plus generated tokens"
    )
    generate.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    serve = commands.add_parser("serve", help="run an OpenAI-compatible HTTP server (extra: serve)")
    add_serve_arguments(serve)
    return parser


def _eos_token_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every request finished (``serve``: after a graceful shutdown),
        1 otherwise.
    """
    from mcore_models import GPTModel

    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    directory = Path(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = GPTModel.from_hf(directory, dtype=args.dtype, device=device).eval()
    config = InferenceConfig(
        max_batch_size=max(1, len(args.prompt)),
        max_sequence_length=args.max_sequence_length,
        tokenizer_path=str(directory),
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop_token_ids=_eos_token_ids(directory),
        stop_words=tuple(args.stop),
    )
    status = 0
    with InferenceEngine(model, config) as engine:
        prompts = [engine.tokenizer.encode(text).ids for text in args.prompt]
        for text, result in zip(args.prompt, engine.generate(prompts, params)):
            if result.error:
                status = 1
            if args.json:
                record = {
                    "prompt": text,
                    "text": result.text,
                    "tokens": result.tokens,
                    "finish_reason": result.finish_reason.value if result.finish_reason else None,
                    "status": result.status.value,
                    "error": result.error,
                }
                print(json.dumps(record))
            else:
                print(result.text if result.error is None else f"error: {result.error}")
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
