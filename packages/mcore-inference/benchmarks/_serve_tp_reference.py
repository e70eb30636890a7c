"""Greedy tokens of a direct tensor-parallel engine, for ``bench_serve.py``'s check of the
``--tp`` server (run on every rank by ``mcore_parallel.testing.run_distributed``).
"""

from __future__ import annotations

from typing import Any


def direct_tokens(
    directory: str, prompts: list[list[int]], config: Any, new_tokens: int
) -> list[list[int]]:
    """Each prompt generated alone (greedy, end-of-sequence ignored) by a ``tp = world size``
    engine built from the checkpoint as the server's ranks build theirs.

    Args:
        directory: The Hugging Face checkpoint directory.
        prompts: Prompt token ids.
        config: The server's ``InferenceConfig``.
        new_tokens: Tokens to generate per prompt.

    Returns:
        The generated tokens of each prompt (the same on every rank).
    """
    import torch.distributed as dist

    from mcore_inference import InferenceEngine, SamplingParams
    from mcore_models import GPTModel
    from mcore_parallel import initialize

    state = initialize(tp=dist.get_world_size())
    model = GPTModel.from_hf(directory, state=state, device=state.device).eval()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    with InferenceEngine(model, config, state=state) as engine:
        engine.capture_graphs()  # as the server does at startup
        tokens = [engine.generate([prompt], params)[0].tokens for prompt in prompts]
    state.destroy()
    return tokens
