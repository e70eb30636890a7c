"""``mcore-inference``: generate text with a Hugging Face checkpoint directory, on one or many ranks.

Each subcommand is a dataclass of options plus a function that runs it, registered in
:data:`COMMANDS`; tyro (extra ``cli``) builds the options from the dataclass, whose ``engine``
and ``sampling`` sections are :class:`~mcore_inference.InferenceConfig` and
:class:`~mcore_inference.SamplingParams` themselves, so every engine and sampling option exists
on the command line with the configs' defaults (``--engine.max-batch-size``,
``--sampling.temperature`` ...); options holding several values take them in a row
(``--prompt "first" "second"``, ``--sampling.stop-words "." "!"``). A new subcommand (``serve``) is one
more entry in :data:`COMMANDS`.

``generate`` needs ``config.json``, safetensors weights and ``tokenizer.json`` (extra ``hf``) in
the directory; the end-of-sequence ids of ``generation_config.json`` / ``config.json`` stop
generation. Under torchrun, ``--tp/--pp/--dp`` lay the ranks out (``tp * pp * dp`` = world
size), each rank loads only its slices of the checkpoint and rank 0 prints the results::

    torchrun --nproc-per-node 4 -m mcore_inference.cli generate --tp 2 --pp 2 \\
        --model ./Qwen2.5-0.5B --prompt "The capital of France is"

``serve --tp N`` needs no torchrun: the server starts its ``N`` engine ranks itself (rank ``r``
on GPU ``r``; see :mod:`mcore_inference.serve.engine_ranks`)::

    mcore-inference serve --model ./Qwen2.5-7B-Instruct --tp 2
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mcore_inference.config import InferenceConfig, SamplingParams
from mcore_inference.engine import InferenceEngine
from mcore_inference.errors import InferenceConfigError
from mcore_inference.serve.config import ServeConfig

__all__ = ["COMMANDS", "GenerateArgs", "main", "run_generate", "run_serve"]


@dataclasses.dataclass(kw_only=True)
class GenerateArgs:
    """Generate text for one or more prompts."""

    model: str
    """Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)."""
    prompt: tuple[str, ...]
    """Prompt texts (several in a row for a batch)."""
    tp: int = 1
    """Tensor-parallel size (under torchrun)."""
    pp: int = 1
    """Pipeline-parallel size (under torchrun)."""
    dp: int = 1
    """Data-parallel replicas (under torchrun); tp * pp * dp must equal the world size."""
    device: str | None = None
    """Device (default: cuda if available, else cpu)."""
    dtype: str | None = None
    """Parameter dtype (default: the checkpoint's)."""
    json: bool = False
    """Print one JSON object per prompt."""
    engine: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    """Engine options (its tokenizer_path defaults to the checkpoint directory)."""
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    """Sampling options of every prompt (the checkpoint's end-of-sequence ids are added)."""


def _eos_token_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            eos = json.loads(file.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def _parallel_state(args: GenerateArgs) -> Any:
    """The ParallelState of a torchrun launch, or None for one process."""
    if "RANK" not in os.environ and args.tp * args.pp * args.dp == 1:
        return None
    from mcore_parallel import initialize

    state = initialize(tp=args.tp, pp=args.pp)
    if state.dp_size != args.dp:
        world = state.world_size
        state.destroy()
        raise InferenceConfigError(
            f"--tp {args.tp} --pp {args.pp} --dp {args.dp} needs {args.tp * args.pp * args.dp} "
            f"ranks; torchrun started {world}"
        )
    return state


def run_generate(args: GenerateArgs) -> int:
    """Run ``mcore-inference generate``.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0 when every request finished, 1 otherwise.

    Raises:
        InferenceConfigError: If ``--tp/--pp/--dp`` do not match the number of ranks.
    """
    from mcore_models import GPTModel

    directory = Path(args.model)
    state = _parallel_state(args)
    device = args.device or (
        str(state.device) if state is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    model = GPTModel.from_hf(directory, state=state, dtype=args.dtype, device=device).eval()
    engine_config = args.engine
    if engine_config.tokenizer_path is None:
        engine_config = dataclasses.replace(engine_config, tokenizer_path=str(directory))
    eos = tuple(dict.fromkeys(args.sampling.stop_token_ids + _eos_token_ids(directory)))
    params = dataclasses.replace(args.sampling, stop_token_ids=eos)
    status = 0
    printing = state is None or state.rank == 0
    with InferenceEngine(model, engine_config, state=state) as engine:
        prompts = [engine.tokenizer.encode(text).ids for text in args.prompt]
        for text, result in zip(args.prompt, engine.generate(prompts, params)):
            if result.error:
                status = 1
            if not printing:
                continue
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
    if state is not None:
        state.destroy()
    return status


def run_serve(config: ServeConfig) -> int:
    """Run ``mcore-inference serve``: an OpenAI-compatible HTTP server (extra ``serve``).

    Args:
        config: Server options.

    Returns:
        The exit status: 0 after a graceful shutdown, 2 when an option does not fit the
        checkpoint or the machine (e.g. ``--tp``), 1 when the engine did not start; both
        errors are printed on one line of standard error.
    """
    from mcore_inference.serve.engine_spec import EngineProcessError
    from mcore_inference.serve.server import serve

    try:
        return serve(config)
    except (InferenceConfigError, EngineProcessError) as exc:
        # Before the server listens: an option that does not fit the checkpoint or the
        # machine (2), or an engine that did not start (1). One line, no traceback.
        print(f"mcore-inference serve: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InferenceConfigError) else 1


COMMANDS: dict[str, tuple[type, Callable[[Any], int]]] = {
    "generate": (GenerateArgs, run_generate),
    "serve": (ServeConfig, run_serve),
}
"""Subcommand name -> (options dataclass, function running it)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status of the subcommand (2 for an unknown one).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: mcore-inference {{{','.join(COMMANDS)}}} [options]  (see --help)"
    if not args or args[0] not in COMMANDS:
        print(usage)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        import tyro
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "the mcore-inference command line needs tyro: pip install 'mcore-inference[cli]'"
        ) from exc
    options, run = COMMANDS[args[0]]
    parsed: Any = tyro.cli(
        options, args=args[1:], prog=f"mcore-inference {args[0]}", description=options.__doc__
    )
    return run(parsed)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
